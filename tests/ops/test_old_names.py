"""Tier: pure CPU, one process (and a fresh interpreter for the import walk).

The 0.1.x names (CHANGELOG.md) keep working: the renamed ones warn and give the new object or the same
result; every path CHANGELOG.md promises (read from its table) and every submodule below an old path
(walked from nn_data._alias's table in a fresh interpreter, imported by the old name first) is the very
module of its new home, each old path and name warning once; names that never were in a release have no alias.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from nn_data import planning

ROOT = Path(__file__).resolve().parents[2]


def _warns(fn, match: str):
    with pytest.warns(DeprecationWarning, match=match):
        return fn()


def test_parallel_layout_is_parallelism_and_its_methods_warn():
    cls = _warns(lambda: planning.ParallelLayout, "use nn_data.planning.Parallelism")
    assert cls is planning.Parallelism
    p = planning.Parallelism(dp=1, cp=2)
    assert _warns(lambda: p.check_packed_length(8), "use Parallelism.check_fixed_total") == 8
    assert _warns(lambda: p.round_packed_length(5), "use Parallelism.round_fixed_total") == 8


def test_make_packed_seq_params_takes_packed_length_and_warns():
    from nn_data.megatron_parallel import make_packed_seq_params

    bounds = torch.tensor([0, 8], dtype=torch.int32)
    old = _warns(lambda: make_packed_seq_params(bounds, 8, 8, packed_length=8), r"pass total= \(the layout's T\)")
    new = make_packed_seq_params(bounds, 8, 8, total=8)
    assert old.max_seqlen_q == new.max_seqlen_q and torch.equal(old.cu_seqlens_q_padded, new.cu_seqlens_q_padded)


@pytest.mark.parametrize("name", ["group_info", "ParallelInfo", "SINGLE", "context_parallel_info",
                                  "tensor_parallel_info", "megatron_state"])
def test_the_group_names_of_megatron_parallel_moved_to_groups(name):
    from nn_data import groups, megatron_parallel

    got = _warns(lambda: getattr(megatron_parallel, name), rf"moved to nn_data.groups.{name}")
    assert got is getattr(groups, name)


def _promised() -> list:
    """``(old, home)`` of every row of CHANGELOG.md's table of 0.1.x paths that still work (a row's home
    is its first code span)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    table = text[text.index("| 0.1.x path (still works) | home |"):].split("\n\n", 1)[0].splitlines()[2:]
    rows = [re.findall(r"`([^`]+)`", line) for line in table]
    assert rows and all(len(r) >= 2 for r in rows), table
    return [(r[0], r[1]) for r in rows]


@pytest.mark.parametrize("old, new", _promised())
def test_every_path_changelog_promises_is_its_new_home(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the first use warns (the walk below counts them)
        if old.rpartition(".")[2][:1].isupper():  # an attribute (a class) of a module that stayed
            (where, _, name), (home, _, home_name) = old.rpartition("."), new.rpartition(".")
            assert getattr(importlib.import_module(where), name) is getattr(importlib.import_module(home), home_name)
        else:
            assert importlib.import_module(old) is importlib.import_module(new)


# A fresh interpreter imports every submodule of every old path by its OLD name first (nothing of it imported
# yet), then its home, and checks they are one object; then mock.patch on an old path reaches the call.
_WALK = """
import importlib, pkgutil, sys, warnings
from unittest import mock
from nn_data._alias import OLD_NAMES, OLD_PATHS
pairs = []
for old, new in sorted(OLD_PATHS.items()):
    spec = importlib.util.find_spec(new)
    pairs.append((old, new))
    for info in pkgutil.walk_packages(spec.submodule_search_locations or [], new + '.'):
        pairs.append((old + info.name[len(new):], info.name))
fresh = [old for old, new in pairs if new not in sys.modules]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):  # the second round warns no more
        for old, new in pairs:
            assert importlib.import_module(old) is importlib.import_module(new), (old, new)
        for old, new in OLD_NAMES.items():
            (where, _, name), (home, _, home_name) = old.rpartition('.'), new.rpartition('.')
            assert getattr(importlib.import_module(where), name) is getattr(importlib.import_module(home), home_name)
warned = sorted(str(w.message).split(' ')[0] for w in caught if 'is the 0.1.x path of' in str(w.message))
assert warned == sorted([*OLD_PATHS, *OLD_NAMES]), warned
with mock.patch('nn_data.megatron_data.dynamic_cp_iterator.dynamic_cp_microbatch_iterator', return_value='patched'):
    from nn_data.nemo_rl.megatron_data import get_microbatch_iterator
    assert get_microbatch_iterator(None, {}, 1, None, dynamic_cp=(None, None)) == 'patched'
for gone in ('nn_data.megatron_data.no_such_module', 'nn_data.lm_head', 'nn_data.automodel_data',
             'nn_data.nemo_rl.megatron_data.pack', 'nn_data.layout.shared_prefix'):
    try:
        importlib.import_module(gone)
    except ModuleNotFoundError as e:
        assert e.name == gone, e.name
    else:
        raise AssertionError(gone + ': a path that was never released (or has no home) imported')
print(len(pairs), len(fresh))
"""


def test_every_submodule_of_an_old_path_is_its_homes_imported_or_not():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _WALK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    pairs, fresh = map(int, run.stdout.split())
    assert pairs > 15 and fresh > 0  # the megatron_data package's submodules, some not imported before the walk


def test_patching_the_old_path_patches_what_process_microbatch_calls():
    from unittest import mock

    import nn_data.nemo_rl.megatron_data as new

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the old path's one warning (counted by the walk)
        import nn_data.megatron_data as old
    with mock.patch("nn_data.megatron_data.get_context_parallel_world_size", return_value=7):
        assert new.get_context_parallel_world_size() == 7 and old.get_context_parallel_world_size() == 7


def test_an_old_path_warns_at_the_importing_line_under_pythons_default_filters():
    """Python shows a DeprecationWarning by default only when it is attributed to ``__main__``: the alias
    attributes it to the line that imports the old path, past nn_data's and importlib's frames."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    code = "import nn_data\nimport nn_data.megatron_data\nimport nn_data.megatron_data.iterators\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("DeprecationWarning") == 1, run.stderr
    assert "<string>:2: DeprecationWarning: nn_data.megatron_data is the 0.1.x path of nn_data.nemo_rl.megatron_data" \
        in run.stderr, run.stderr
