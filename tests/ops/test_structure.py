"""Tier: pure CPU (reads source files; imports nothing heavy).

The package layout of docs/design.md ("Where things live") as checks: the core imports nothing
from the NeMo-RL drop-in (nn_data.nemo_rl, and the old paths that alias it), megatron-core is
imported by nn_data.megatron_parallel alone, process groups live in nn_data.groups, the import
graph between nn_data's modules has no cycle, nothing edits sys.path or cites a file outside
the repository, the layout rules and the data checks' wordings live in nn_data.layout alone, and
the compat layer keeps no hidden state.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize
import warnings
from pathlib import Path

import pytest

from nn_data._alias import MODULE_PATHS

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():  # this file may live one folder deeper
    ROOT = ROOT.parent
PKG = ROOT / "nn_data"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, annotations: bool = False) -> set[str]:
    """Modules imported at module level or in functions; TYPE_CHECKING blocks excluded unless
    ``annotations`` (what runs vs. what the code depends on: the cycle check counts both)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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
# Every import, TYPE_CHECKING blocks included: an annotation-only import is a dependency too.
ALL_IMPORTS = {_module_name(p): _imports(p, annotations=True) for p in PKG.rglob("*.py")}
# The drop-in's home and the old paths that alias it (nn_data._alias makes each old path the new module):
# the module-path rows of nn_data._alias.MOVED whose home is in the drop-in.
DROP_IN = "nn_data.nemo_rl"
ALIASES = MODULE_PATHS
OLD_PATHS = {old: new for old, new in ALIASES.items() if new.startswith(DROP_IN + ".")}


def _in_drop_in(module: str) -> bool:
    return module == DROP_IN or module.startswith(DROP_IN + ".") or module in OLD_PATHS


CORE = [m for m in MODULES if not _in_drop_in(m)]


def test_layout_is_as_documented():
    assert "nn_data.nemo_rl.megatron_data" in MODULES and "nn_data.nemo_rl.megatron_data.dispatch" in MODULES
    assert "nn_data.layout" in MODULES and "nn_data.layout.host" in MODULES and "nn_data.layout.device" in MODULES
    assert "nn_data.testing.reference" in MODULES and "nn_data.reference" not in MODULES
    assert not [m for m in MODULES if m.startswith("nn_data.megatron_data_")]


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_nothing_from_the_nemo_rl_drop_in(module):
    bad = [i for i in MODULES[module] if _in_drop_in(i)]
    assert not bad, f"{module} imports {bad}"


# The drop-in enters nn_data by the public API (nn_data's __all__, the user's doors nn_data.layout, .planning
# and .logprobs, the lazy nn_data.adapters door and its documented tree_kv module) and one declared extension surface (nn_data.extension) alone, so a
# rename inside nn_data touches that one module and the drop-in could leave the package as a folder.
DROP_IN_DOORS = ("nn_data", "nn_data.adapters", "nn_data.adapters.tree_kv", "nn_data.layout", "nn_data.planning",
                 "nn_data.logprobs", "nn_data.extension")
DROP_IN_FILES = sorted((PKG / "nemo_rl").rglob("*.py"))


def _nn_data_imports(path: Path) -> list:
    """``(module, name)`` of every ``nn_data`` import of a file (module level, in functions and under
    ``TYPE_CHECKING``); ``name`` None for ``import nn_data.x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("nn_data"):
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("nn_data")]
    return found


@pytest.mark.parametrize("path", DROP_IN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_drop_in_imports_the_public_api_and_the_extension_surface_alone(path):
    import importlib

    bad = []
    for module, name in _nn_data_imports(path):
        if module == DROP_IN or module.startswith(DROP_IN + "."):
            continue
        if module not in DROP_IN_DOORS or name is None:
            bad.append(f"{module}.{name}" if name else module)
        elif name not in importlib.import_module(module).__all__:
            bad.append(f"{module}.{name}")
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; add what it needs to nn_data/extension.py"


def test_the_extension_surface_is_declared_and_each_name_used():
    """nn_data.extension says what it offers and why (its docstring), exports each name once, every name
    has an importer in the drop-in (a name nothing imports is deleted), and it imports nothing of the drop-in."""
    import nn_data.extension as extension

    assert extension.__doc__ and "drop-in" in extension.__doc__ and "so that" in extension.__doc__
    names = extension.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    used = {name for p in DROP_IN_FILES for module, name in _nn_data_imports(p) if module == "nn_data.extension"}
    assert set(names) == used, (sorted(set(names) - used), sorted(used - set(names)))
    assert not [i for i in MODULES["nn_data.extension"] if _in_drop_in(i)]


def test_the_extension_surface_is_narrow_and_each_name_has_a_caller_in_the_core():
    """At most 20 names, each with a caller inside the core besides its own home (a name only the drop-in
    needs lives in the drop-in), each said what it is for (a comment line above its group)."""
    import nn_data.extension as extension

    names = extension.__all__
    assert len(names) <= 20, names
    core = {p: _code_only(p.read_text()) for p in PKG.rglob("*.py")
            if "nemo_rl" not in p.parts and p.name != "extension.py"}
    for name in names:
        obj = getattr(extension, name)
        if inspect.ismodule(obj):  # a module: imported by another module of the core
            home = Path(obj.__file__)
            assert [p for p, code in core.items() if p != home and obj.__name__.rsplit(".", 1)[-1] in code], name
            continue
        uses = [line for code in core.values() for line in code.splitlines() if re.search(rf"\b{name}\b", line)
                and not re.match(rf"\s*(def|class) {name}\b|\s*(from|import) ", line)]
        assert uses, name


# The model adapters are about megatron-core models themselves (nn_data.adapters, opt-in, never
# imported by `import nn_data`); everything else reaches megatron-core through megatron_parallel.
MEGATRON_MODEL_CODE = {"nn_data.adapters.megatron_gpt", "nn_data.adapters._megatron_cpu",
                       "nn_data.adapters.megatron_pipeline", "nn_data.models.tiny_megatron"}


def test_only_megatron_parallel_imports_megatron_core():
    importers = sorted(m for m, imps in MODULES.items()
                       if any(i == "megatron" or i.startswith("megatron.") for i in imps))
    assert set(importers) - MEGATRON_MODEL_CODE == {"nn_data.megatron_parallel"}


def test_no_import_cycle_between_nn_data_modules():
    """No cycle in the import graph of nn_data's modules, imports under ``TYPE_CHECKING`` counted."""
    graph = {m: {i for i in imps if i in MODULES and i != m} for m, imps in ALL_IMPORTS.items()}
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
PLANNING_NAMES = {"nn_data.layout", "nn_data.layout.round_up", "nn_data.layout.internal",
                  "nn_data.layout.internal.INT32_MAX", "nn_data.layout.internal.checks", "nn_data.errors",
                  "nn_data.errors.PackingError", "nn_data._alias", "nn_data._alias.moved_attribute",
                  "nn_data._alias.renamed_method"}  # the last three: its 0.1.x names (nn_data._alias imports no nn_data)


@pytest.mark.parametrize("module", PLANNING)
def test_the_step_planner_is_host_code_on_the_layout_rules_alone(module):
    """nn_data.planning plans on the host: within nn_data it uses the layout's rounding, int32 limit and
    fixed-length check (through nn_data.layout's doors), the error class and the 0.1.x stubs, nothing of the ops, the
    NeMo-RL drop-in or megatron-core."""
    inner = {i for i in MODULES[module] if i.startswith("nn_data") and not i.startswith("nn_data.planning")}
    assert inner <= PLANNING_NAMES, inner - PLANNING_NAMES
    assert not [i for i in MODULES[module] if i == "megatron" or i.startswith("megatron.")]


INTERNAL_DOOR = "nn_data.layout.internal"


def _layout_submodule_imports(path: Path) -> list:
    """``nn_data.layout.<submodule>`` imports of a file other than the internal door (``from nn_data.layout
    import X`` names a door export, not a submodule, unless X is one)."""
    submodules = {p.stem for p in (PKG / "layout").glob("*.py") if p.stem not in ("__init__", "internal")}
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("nn_data.layout.") and node.module != INTERNAL_DOOR:
                bad.append(node.module)
            elif node.module == "nn_data.layout":
                bad += [f"nn_data.layout.{a.name}" for a in node.names if a.name in submodules]
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("nn_data.layout.") and a.name != INTERNAL_DOOR]
    return bad


def _names_from(path: Path, module: str) -> set:
    """The names a file imports ``from module``."""
    return {a.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0 for a in node.names}


OUTSIDE_THE_LAYOUT = sorted(p for folder in ("nn_data", "profiling", "scripts") for p in (ROOT / folder).rglob("*.py")
                            if PKG / "layout" not in p.parents)


@pytest.mark.parametrize("path", OUTSIDE_THE_LAYOUT, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_outside_the_layout_enters_it_by_its_two_doors(path):
    """Package, profiling and script code imports ``nn_data.layout`` (the user's door, its ``__all__``) or
    ``nn_data.layout.internal`` (the package's own door, its ``__all__``), never another submodule; the
    layout's own tests (tests/ops) may look inside."""
    import nn_data.layout
    import nn_data.layout.internal

    assert not _layout_submodule_imports(path)
    assert _names_from(path, "nn_data.layout") <= set(nn_data.layout.__all__)
    assert _names_from(path, INTERNAL_DOOR) <= set(nn_data.layout.internal.__all__)


def test_the_users_door_is_narrow_and_the_internal_door_holds_no_dead_name():
    """``nn_data.layout.__all__``: at most 16 names, each taught to users (README.md or a docs page other
    than the design map names it), none also in the internal door; the internal door at most 15, every one
    with an importer in nn_data, profiling or scripts (a name nothing imports is deleted, not kept)."""
    import nn_data.layout
    import nn_data.layout.internal

    user, internal = set(nn_data.layout.__all__), set(nn_data.layout.internal.__all__)
    assert len(user) <= 16 and len(internal) <= 15 and not user & internal, (len(user), len(internal), user & internal)
    taught = (ROOT / "README.md").read_text() + "".join(
        p.read_text() for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")
    assert not [n for n in user if not re.search(rf"\b{n}\b", taught)], "not taught to users"
    imported = set().union(*(_names_from(p, INTERNAL_DOOR) for p in OUTSIDE_THE_LAYOUT))
    assert internal <= imported, sorted(internal - imported)


def test_the_zigzag_shard_is_stated_once():
    """Every form of the shard (the host views, the host scan, the device map) follows
    ``rules.zigzag_pieces``; the chunk pair itself is used by that rule alone."""
    users = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if "zigzag_chunks(" in _code_only(p.read_text()))
    assert users == ["nn_data/layout/rules.py"], users
    for path in ("nn_data/layout/host.py", "nn_data/layout/index.py"):
        assert "zigzag_pieces(" in _code_only((ROOT / path).read_text()), path


def test_device_side_checks_have_one_home():
    """Every device-side check goes through ``nn_data._checks.device_assert`` (one 0-d flag, and under
    compile the ``nn_data::device_check`` op that inductor calls between its kernels: docs/compile-contract.md)."""
    users = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                   if re.search(r"_assert_async|_assert_scalar|device_assert_async", _code_only(p.read_text())))
    assert users == ["nn_data/_checks.py"], users


def test_pack_and_shard_has_one_runtime_every_caller_uses():
    """PackingSide (nn_data/packed_sides.py) is the one pack-and-shard runtime: PackedForward, staging, dynamic
    CP's rounds and the drop-in (its compiled graph and its tree microbatches) hand it a kind and get the
    finished PackedInfo; no other module builds a PackedInfo (the callers add their parts with
    PackedInfo.finished), and no sibling pipeline exists (the tree is a strategy, not a second module)."""
    for path in ("nn_data/packed_forward.py", "nn_data/staging.py", "nn_data/dynamic_cp/rounds.py",
                 "nn_data/nemo_rl/megatron_data/graph.py", "nn_data/nemo_rl/megatron_data/tree_inputs.py"):
        assert "PackingSide(" in _code_only((ROOT / path).read_text()), path
    assert "UnpackingSide(" in _code_only((ROOT / "nn_data/packed_forward.py").read_text())
    builders = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                      if re.search(r"\bPackedInfo\(", _code_only(p.read_text())))
    assert builders == ["nn_data/packed_sides.py"], builders
    modules = [m for p in PKG.rglob("*.py") for m in re.findall(r"class (\w*)\(nn\.Module\)", p.read_text())]
    assert "PackShard" not in modules and not [m for m in modules if m.endswith("Graph")], modules


def test_at_most_one_module_is_named_for_the_shared_prefix():
    """The tree is the general case: modules are named for it; GRPO groups are its depth-1 spelling."""
    named = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if "shared_prefix" in p.name)
    assert len(named) <= 1, named


def test_the_alignment_rule_has_one_home():
    """NeMo-RL's minimum_pad_factor (2*cp times tp with sequence parallelism) is written once:
    nn_data.planning.alignment; the compat layer, PackedForward and the planner ask Parallelism."""
    homes = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if "minimum_pad_factor" in p.read_text())
    assert homes == ["nn_data/planning/alignment.py"]
    for path in ("nn_data/packed_forward.py", "nn_data/nemo_rl/megatron_data/pack_helpers.py"):
        assert "Parallelism" in (ROOT / path).read_text(), path


def test_nothing_in_the_package_imports_nemo_rl():
    importers = sorted(m for m, imps in MODULES.items() if any(i == "nemo_rl" or i.startswith("nemo_rl.") for i in imps))
    assert not importers, f"{importers} import NeMo-RL; nn_data re-implements it and never depends on it"


def test_model_utils_builds_on_the_log_prob_core_not_on_token_logprobs():
    # nn_data.nemo_rl.model_utils reuses the chunked log-prob kernel, the zigzag places and the CP gather;
    # TokenLogProbs (nn_data's own convention) is a sibling, not a dependency.
    names = {name for module, name in _nn_data_imports(PKG / "nemo_rl" / "model_utils.py")}
    assert "token_logprobs_local" in names and not names & {"TokenLogProbs", "TokenLogProbsFromHidden"}


# ---- the layout's boundary (docs/design.md, "Layouts and executors") -------------------

PLAN = PKG / "layout"
# The loop oracle (nn_data/testing/reference.py) re-derives every rule on purpose: a reference that
# shared the plan's rules could not catch a wrong one.
ORACLE = PKG / "testing"
OUTSIDE_PLAN = sorted(p for p in PKG.rglob("*.py") if PLAN not in p.parents and ORACLE not in p.parents)


#: comments and literal text; from Python 3.12 on an f-string is tokens, its literal parts FSTRING_MIDDLE
_NOT_CODE = {tokenize.COMMENT, tokenize.STRING} | {getattr(tokenize, name) for name in
                                                   ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                                                   if hasattr(tokenize, name)}


def _code_only(text: str) -> str:
    """``text`` with comments and string literals blanked (their line breaks kept): rules are code."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    chars = list(text)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _NOT_CODE:
            for k in range(starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]):
                chars[k] = chars[k] if chars[k] == "\n" else " "
    return "".join(chars)


def _sources_outside_plan():
    for path in OUTSIDE_PLAN:
        yield path.relative_to(ROOT), _code_only(path.read_text())


def test_the_compat_layer_has_no_hidden_state():
    assert not (PKG / "nemo_rl" / "megatron_data" / "scope.py").exists()
    users = [m for m, imps in MODULES.items() if "contextvars" in imps]
    assert not users, f"{users} import contextvars"
    for gone in ("nn_data._index", "nn_data.plan", "nn_data.nemo_rl.megatron_data.engine",
                 "nn_data.nemo_rl.megatron_data.host_pack", "nn_data.nemo_rl.megatron_data.keys"):
        assert gone not in MODULES, f"{gone} is back: its content lives in nn_data.layout"
    for path in (PKG / "nemo_rl").rglob("*.py"):  # no memo keyed by an object's id() (ids are reused)
        assert not re.search(r"\bid\(", _code_only(path.read_text())), path


RULE_PATTERNS = {
    "the round-up (plan.rules.round_up)": [r"-\s*\(\s*-\s*[\w.\[\]]+\s*//\s*[\w.]+\s*\)\s*\*",
                                           r"\+\s*\(?\s*[\w.]+\s*-\s*1\s*\)?\s*\)\s*//\s*[\w.]+\s*\)?\s*\*"],
    "the slack rule (plan.rules.extend_last)": [r"cu\w*\[-1\]\s*=[^=]", r">=\s*first_final", r"\bdeficit\b\s*[+\-]",
                                                r"\+\s*deficit\b"],
    "the zigzag chunks (plan.rules.zigzag_chunks)": [r"2\s*\*\s*cp_size\s*-\s*1\s*-", r"two_c\s*-\s*1\s*-"],
    "the int32 limit (plan.rules.INT32_MAX)": [r"2\s*\*\*\s*31"],
}


@pytest.mark.parametrize("rule", sorted(RULE_PATTERNS))
def test_nothing_outside_the_plan_computes_a_layout_rule(rule):
    offenders = []
    for rel, text in _sources_outside_plan():
        for pattern in RULE_PATTERNS[rule]:
            for match in re.finditer(pattern, text):
                line = text[: match.start()].count("\n") + 1
                offenders.append(f"{rel}:{line}: {match.group(0)!r}")
    assert not offenders, f"{rule} computed outside nn_data/layout: {offenders}"


CHECK_WORDINGS = ["never decrease", "not a multiple of 2*cp_size", "is outside [0, ", "does not fit its segment",
                  "exceeds pad_full_seq_to", "largest packed length or boundary"]


def test_every_data_check_wording_lives_in_plan_checks():
    offenders = []
    for path in [*OUTSIDE_PLAN, *sorted(PLAN.glob("*.py"))]:
        if path == PLAN / "checks.py":
            continue
        text = path.read_text()
        docs = _docstring_lines(text)
        for line_no, line in enumerate(text.splitlines(), 1):
            if line_no in docs or line.lstrip().startswith("#") or '"' not in line:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line_no}: {w!r}" for w in CHECK_WORDINGS if w in line]
    assert not offenders, offenders


def _docstring_lines(text: str) -> set:
    """The line numbers of every docstring (the string statement opening a module, class or function)."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def test_the_device_executors_building_blocks_import_only_the_rules():
    assert {i for i in MODULES["nn_data.layout.index"] if i.startswith("nn_data")} <= {"nn_data.layout.rules",
            "nn_data.layout.rules.chunk_owner", "nn_data.layout.rules.segment_bounds", "nn_data.layout.rules.zigzag_pieces"}
    assert not [i for i in MODULES["nn_data.layout.rules"] if i.startswith("nn_data") and i != "nn_data.errors"
                and not i.startswith("nn_data.errors.")]


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_path_has_no_file_and_imports_as_its_home(old):
    """Each old path is a row of nn_data._alias's table alone (no file of its own to drift), and imports as
    the very module of its home (tests/ops/test_old_names.py walks every submodule below one)."""
    import importlib

    from nn_data._alias import home_of

    path = PKG / Path(*old.split(".")[1:])
    assert old not in MODULES and not path.with_suffix(".py").exists() and not path.is_dir(), old
    assert home_of(old) in MODULES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its one warning (tests/ops/test_old_names.py)
        assert importlib.import_module(old) is importlib.import_module(home_of(old))


def test_no_module_basename_means_two_things():
    """One name per module: ``find nn_data -name '*.py' | xargs -n1 basename | sort | uniq -d`` prints
    only ``__init__.py``."""
    from collections import Counter

    counts = Counter(p.name for p in PKG.rglob("*.py"))
    assert sorted(n for n, k in counts.items() if k > 1) == ["__init__.py"]


def test_process_groups_have_a_home_of_their_own():
    """The group resolver is nn_data.groups; the megatron-core boundary module holds PackedSeqParams only."""
    resolvers = ("nn_data.groups.group_info", "nn_data.groups.given_group_info")
    users = sorted(m for m, imps in MODULES.items() if any(r in imps for r in resolvers))
    assert "nn_data.cp_comm" in users and "nn_data.logprobs.from_logits" in users
    text = (PKG / "megatron_parallel.py").read_text()
    assert "def group_info" not in text and "def context_parallel_info" not in text
    assert not [m for m, imps in MODULES.items() if "nn_data.megatron_parallel.group_info" in imps]


EXECUTOR_OPS = ("pack", "shard", "unshard", "unpack")


def test_one_executor_protocol_chosen_in_one_place():
    """A layout holds one of two executors, ``HostExecutor`` (``layout/host.py``) and ``DeviceExecutor``
    (``layout/device.py``), each with ``pack``, ``shard``, ``unshard`` and ``unpack`` taking
    ``(layout, tensor, ...)``; each ``PackLayout`` method calls its executor's (no dispatcher), and nothing
    outside the layout builds one; the shared-prefix layout packs through ``device.gather_pack`` and
    its ``GatherMaps``, the one declared way maps enter a pack (no layout impostor)."""
    import inspect

    from nn_data.layout import PackLayout, device, host

    for executor in (host.HostExecutor, device.DeviceExecutor):
        for op in EXECUTOR_OPS:
            params = list(inspect.signature(getattr(executor, op)).parameters)
            assert params[:3] == ["self", "layout", params[2]] and params[2] in ("x", "packed", "shards"), (executor, op)
    assert PackLayout._fields[-1] == "executor" and len(PackLayout._fields) <= 7, PackLayout._fields
    text = _code_only((PKG / "layout" / "pack_layout.py").read_text())
    for op in EXECUTOR_OPS:
        assert text.count(f"layout.executor.{op}(layout, ") == 1, op
    callers = {}
    for path in PKG.rglob("*.py"):
        text = _code_only(path.read_text())
        if re.search(r"\b(HostExecutor|DeviceExecutor)\(", text):
            callers.setdefault(str(path.relative_to(ROOT)), set()).add("executor")
        if re.search(r"\bgather_pack\(", text):
            callers.setdefault(str(path.relative_to(ROOT)), set()).add("gather_pack")
    assert callers == {"nn_data/layout/build.py": {"executor"}, "nn_data/layout/host.py": {"executor"},
                       "nn_data/layout/pack_layout.py": {"executor"},
                       "nn_data/layout/device.py": {"executor", "gather_pack"},
                       "nn_data/layout/tree.py": {"gather_pack"}}, callers


def test_the_executor_is_chosen_once_not_inside_its_methods():
    """No executor method asks whether ``torch.compile`` is tracing: a host layout entering a traced region
    becomes a device layout once, in ``pack_layout.entered``, which the op door (``take_layout``) and the
    layout's own methods call."""
    import inspect

    from nn_data.layout import device, host

    for executor in (host.HostExecutor, device.DeviceExecutor):
        for op in EXECUTOR_OPS:
            source = textwrap.dedent(inspect.getsource(getattr(executor, op)))
            assert "is_compiling" not in _code_only(source), (executor, op)
    assert "entered(layout)" in _code_only((PKG / "layout" / "build.py").read_text())


def test_no_module_global_changes_what_compiles():
    """The device pack's form is a spec field (``PackSequences(pack_form=)``), never a module-level switch:
    the layout package has no function that rebinds a module global."""
    from nn_data import PackingError, PackSequences

    for path in (PKG / "layout").glob("*.py"):
        assert not re.search(r"^\s+global\s", _code_only(path.read_text()), re.M), path.name
    with pytest.raises(PackingError, match=r"pack_form='dense' is invalid; expected one of \('auto', 'scatter', 'gather'\)"):
        PackSequences(pack_form="dense")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nn_data_imports_no_old_path(module):
    """nn_data's own code imports each module by its home, never by an old path of nn_data._alias's table
    (those are for callers of earlier releases; a file of the package that used one would hide a move)."""
    from nn_data._alias import home_of

    assert not [i for i in MODULES[module] if home_of(i) is not None], module
