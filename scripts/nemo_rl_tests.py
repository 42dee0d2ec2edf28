"""Run NeMo-RL's own unit tests against nn_data: import rewrites only, nothing of NeMo-RL copied here.

    python -m scripts.nemo_rl_tests /path/to/NeMo-RL [--out /tmp/nemo_rl_tests] [pytest args...]

Reads the test files of a NeMo-RL checkout (``--files``, default: the data-path and log-prob tests
nn_data re-implements), rewrites NeMo-RL's module paths to nn_data's drop-in (the import lines and
the ``mock.patch`` target strings alike), and runs pytest on the copies in ``--out`` with the checkout
first on the path (its tests import ``tests.unit...``). Where NeMo-RL's environment is missing (Ray,
its cluster code, megatron-bridge), each top-level import that fails is bound to the function of that
name compiled from the module's source alone (an input builder such as
``build_media_token_validity_mask``), else to a stand-in that raises when used, so the tests that need
it fail or skip by themselves and every other test runs.
docs/nemo-rl.md, "Running NeMo-RL's own tests against nn_data", has the results.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

#: NeMo-RL module -> nn_data module (the drop-in's paths).
REWRITES = {
    "nemo_rl.models.megatron.data": "nn_data.nemo_rl.megatron_data",
    "nemo_rl.distributed.batched_data_dict": "nn_data.nemo_rl.batched_data_dict",
    "nemo_rl.distributed.model_utils": "nn_data.nemo_rl.model_utils",
}

DEFAULT_FILES = (
    "tests/unit/models/megatron/test_megatron_data.py",
    "tests/unit/models/megatron/test_media_mask_packing.py",
)

#: NeMo-RL's tests that patch the packed branch's private helpers (``_pack_sequences_for_megatron``,
#: ``_shard_routed_experts_for_cp``, ``get_packed_seq_cp_partition_indices``) and assert on their calls or
#: feed the microbatch their mocked results. nn_data's packed branch packs every tensor in one call on one
#: layout and calls none of them, so these tests check a call sequence nn_data does not have; they are
#: deselected (``--all`` runs them). docs/nemo-rl.md lists them with why.
NOT_APPLICABLE = tuple(f"test_megatron_data.py::TestProcessMicrobatch::{name}" for name in (
    "test_process_microbatch_with_packing",
    "test_process_microbatch_keeps_full_thd_for_model_cp_slicing",
    "test_process_microbatch_marks_single_sequence_trailing_padding",
    "test_process_microbatch_keeps_full_mtp_mask_for_model_cp_slicing",
    "test_process_microbatch_with_packing_packs_mtp_loss_mask",
    "test_process_microbatch_packs_routed_experts_with_tokens",
    "test_model_cp_slicing_uses_shared_indices_for_router_replay",
))

STAND_IN = '''
def _from_source(module, name):
    """``name``, a top-level function of NeMo-RL's ``module``, compiled from its source file alone (when
    the module's own imports fail here); None when there is no such function."""
    import ast as _ast
    import sys as _sys

    for root in _sys.path:
        path = __import__("pathlib").Path(root, *module.split(".")).with_suffix(".py")
        if path.is_file():
            tree = _ast.parse(path.read_text())
            scope = {}
            for node in tree.body:  # the module's own imports that work here (typing, torch, ...)
                if isinstance(node, (_ast.Import, _ast.ImportFrom)):
                    try:
                        exec(compile(_ast.Module([node], []), str(path), "exec"), scope)
                    except ImportError:
                        pass
            for node in tree.body:
                if isinstance(node, _ast.FunctionDef) and node.name == name:
                    exec(compile(_ast.Module([node], []), str(path), "exec"), scope)
                    return scope[name]
    return None


class _Missing:
    """A stand-in for a name whose import failed here: using it raises, naming the import."""

    def __init__(self, what):
        self._what = what

    def __getattr__(self, name):
        raise ImportError(f"{self._what} is not importable on this machine")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._what} is not importable on this machine")
'''


def rewrite(source: str) -> str:
    """NeMo-RL's module paths as nn_data's, in code and strings alike."""
    for old, new in REWRITES.items():
        source = source.replace(old, new)
    return source


def guard_imports(source: str) -> str:
    """Every top-level import of ``ray``, ``nemo_rl.*``, ``megatron.bridge`` or ``tests.*`` inside a
    ``try``; on ImportError its names are bound to :class:`_Missing` stand-ins."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    guarded = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module]
            names = [a.asname or a.name for a in node.names]
        else:
            continue
        if any(m == "ray" or m.startswith(("ray.", "nemo_rl", "megatron.bridge", "tests.")) for m in mods):
            guarded.append((node.lineno, node.end_lineno, names, mods[0]))
    for start, end, names, mod in reversed(guarded):
        body = "".join("    " + line for line in lines[start - 1:end])
        stand_ins = "".join(f"    {n} = _from_source({mod!r}, {n!r}) or _Missing({mod!r} + '.{n}')\n" for n in names)
        lines[start - 1:end] = [f"try:\n{body}except ImportError:\n{stand_ins}"]
    text = "".join(lines)
    if guarded:  # the stand-in class after the module docstring and __future__ imports
        insert = max([n.end_lineno for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
                     or [tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0])
        out = text.splitlines(keepends=True)
        text = "".join(out[:insert]) + STAND_IN + "".join(out[insert:])
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.nemo_rl_tests", description=__doc__.split("\n\n")[0])
    ap.add_argument("nemo_rl", type=Path, help="a NeMo-RL checkout (its root: nemo_rl/ and tests/)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/nemo_rl_tests"), help="where the ported copies go")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="test files, relative to the checkout")
    ap.add_argument("--all", action="store_true", help="also run the tests of NOT_APPLICABLE")
    args, pytest_args = ap.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for rel in args.files:
        source = (args.nemo_rl / rel).read_text()
        (args.out / Path(rel).name).write_text(guard_imports(rewrite(source)))
    nn_data_root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.nemo_rl), str(nn_data_root),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[Path(f).name for f in args.files],
           *pytest_args]
    if not args.all:
        names = {Path(f).name for f in args.files}
        cmd += [f"--deselect={t}" for t in NOT_APPLICABLE if t.split("::")[0] in names]
    return subprocess.call(cmd, cwd=args.out, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
