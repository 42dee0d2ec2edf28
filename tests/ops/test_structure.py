"""Tier: pure CPU (reads source files; imports nothing heavy).

The package layout of docs/design.md ("Where things live") as checks: the core imports nothing
from the NeMo-RL layer, megatron-core is imported by nn_data.megatron_parallel alone, the import
graph between nn_data's modules has no cycle, and nothing edits sys.path or cites a file outside
the repository.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():  # this file may live one folder deeper
    ROOT = ROOT.parent
PKG = ROOT / "nn_data"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules imported at module level or in functions, TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


MODULES = {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}
CORE = [m for m in MODULES if not m.startswith("nn_data.megatron_data") and m != "nn_data.batched_data_dict"]


def test_layout_is_as_documented():
    assert "nn_data.megatron_data" in MODULES and "nn_data.megatron_data.engine" in MODULES
    assert "nn_data.testing.reference" in MODULES and "nn_data.reference" not in MODULES
    assert not [m for m in MODULES if m.startswith("nn_data.megatron_data_")]


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_nothing_from_the_nemo_rl_layer(module):
    bad = [i for i in MODULES[module] if i.startswith("nn_data.megatron_data")]
    assert not bad, f"{module} imports {bad}"


# The model adapters are about megatron-core models themselves (nn_data.adapters, opt-in, never
# imported by `import nn_data`); everything else reaches megatron-core through megatron_parallel.
MEGATRON_MODEL_CODE = {"nn_data.adapters.megatron_gpt", "nn_data.adapters._megatron_cpu",
                       "nn_data.adapters.megatron_pipeline", "nn_data.models.tiny_megatron"}


def test_only_megatron_parallel_imports_megatron_core():
    importers = sorted(m for m, imps in MODULES.items()
                       if any(i == "megatron" or i.startswith("megatron.") for i in imps))
    assert set(importers) - MEGATRON_MODEL_CODE == {"nn_data.megatron_parallel"}


def test_no_import_cycle_between_nn_data_modules():
    graph = {m: {i for i in imps if i in MODULES and i != m} for m, imps in MODULES.items()}
    # A package's __init__ re-exports its submodules; an edge submodule -> own package is the
    # normal "from package import name" and would be a cycle only through __init__ itself.
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if m.startswith(n + ".") or n == "nn_data":  # a submodule importing its own package
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [m, n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_nothing_edits_sys_path_or_cites_files_outside_the_repository():
    offenders = []
    for folder in ("nn_data", "tests", "profiling", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text()
            if "sys.path.insert" in text or "sys.path.append" in text:
                offenders.append(f"{path.relative_to(ROOT)}: sys.path edit")
            if "SPEC section" in text or "SPEC.md" in text:
                offenders.append(f"{path.relative_to(ROOT)}: cites SPEC")
    readme = (ROOT / "README.md").read_text()
    if "SPEC" in readme:
        offenders.append("README.md: cites SPEC")
    assert not offenders, offenders


PLANNING = sorted(m for m in MODULES if m == "nn_data.planning" or m.startswith("nn_data.planning."))
PLANNING_MAY_IMPORT = {"nn_data._checks", "nn_data._index", "nn_data.errors"}


@pytest.mark.parametrize("module", PLANNING)
def test_the_step_planner_is_host_code_on_the_layout_rules_alone(module):
    """nn_data.planning plans on the host: within nn_data it uses the rounding of _index, the int32
    limit of _checks and the error class, nothing of the ops, the NeMo-RL layer or megatron-core."""
    inner = {i for i in MODULES[module] if i.startswith("nn_data") and not i.startswith("nn_data.planning")}
    names = ("round_up", "PackingError", "INT32_MAX", "check_int32")
    assert inner <= PLANNING_MAY_IMPORT | {f"{m}.{n}" for m in PLANNING_MAY_IMPORT for n in names}
    assert not [i for i in MODULES[module] if i == "megatron" or i.startswith("megatron.")]


def test_the_alignment_rule_has_one_home():
    """NeMo-RL's minimum_pad_factor (2*cp times tp with sequence parallelism) is written once:
    nn_data.planning.alignment; the compat layer, PackedForward and the planner ask ParallelLayout."""
    homes = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if "minimum_pad_factor" in p.read_text())
    assert homes == ["nn_data/planning/alignment.py"]
    for path in ("nn_data/packed_forward.py", "nn_data/megatron_data/pack.py", "nn_data/megatron_data/engine.py"):
        assert "ParallelLayout" in (ROOT / path).read_text(), path


def test_nothing_in_the_package_imports_nemo_rl():
    importers = sorted(m for m, imps in MODULES.items() if any(i == "nemo_rl" or i.startswith("nemo_rl.") for i in imps))
    assert not importers, f"{importers} import NeMo-RL; nn_data re-implements it and never depends on it"


def test_model_utils_builds_on_the_log_prob_core_not_on_token_logprobs():
    # nn_data.model_utils reuses the chunked log-prob kernel, the zigzag places and the CP gather;
    # TokenLogProbs (nn_data's own convention) is a sibling, not a dependency.
    from_logprobs = {i for i in MODULES["nn_data.model_utils"] if i.startswith("nn_data.logprobs.")}
    assert from_logprobs == {"nn_data.logprobs.token_logprobs_local"}
