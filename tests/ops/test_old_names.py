"""Tier: pure CPU, one process (and a fresh interpreter for the warn-once walk).

The 0.1.x names keep working from one home, ``nn_data._alias.MOVED``: every row gives its home's object (a module
path the very module, every submodule below it too), warns once per process at the caller's line, and is listed
in CHANGELOG.md's table; nothing else in nn_data warns of a deprecation; names that never were in a release
have no alias.
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

from nn_data._alias import MODULE_PATHS, MOVED

ROOT = Path(__file__).resolve().parents[2]


def _home_object(name: str):
    """The object a row's home names (``module`` or ``module:Name``)."""
    where, _, attr = name.partition(":")
    return getattr(importlib.import_module(where), attr) if attr else importlib.import_module(where)


def _bounds():
    return torch.tensor([0, 8], dtype=torch.int32)


# The rows that are no module path or attribute: a call through the old name and one through the new, equal.
CALLS = {
    "nn_data.planning:Parallelism.check_packed_length": (
        lambda: _home_object("nn_data.planning:Parallelism")(dp=1, cp=2).check_packed_length(8),
        lambda: _home_object("nn_data.planning:Parallelism")(dp=1, cp=2).check_fixed_total(8)),
    "nn_data.planning:Parallelism.round_packed_length": (
        lambda: _home_object("nn_data.planning:Parallelism")(dp=1, cp=2).round_packed_length(5),
        lambda: _home_object("nn_data.planning:Parallelism")(dp=1, cp=2).round_fixed_total(5)),
    "nn_data.megatron_parallel:make_packed_seq_params(packed_length=)": (
        lambda: _home_object("nn_data.megatron_parallel:make_packed_seq_params")(_bounds(), 8, 8, packed_length=8),
        lambda: _home_object("nn_data.megatron_parallel:make_packed_seq_params")(_bounds(), 8, 8, total=8)),
}


def _same(a, b) -> bool:
    if hasattr(a, "cu_seqlens_q_padded"):  # a PackedSeqParams: its fields
        return a.max_seqlen_q == b.max_seqlen_q and torch.equal(a.cu_seqlens_q_padded, b.cu_seqlens_q_padded)
    return a == b


def _use(old: str):
    """``(through the old name, through the new)`` for a row of MOVED."""
    if old in CALLS:
        return tuple(call() for call in CALLS[old])
    return _home_object(old), _home_object(MOVED[old])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_name_gives_its_homes_object_and_warns(old):
    home = MOVED[old].replace(":", ".")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import nn_data._alias as alias

        alias._WARNED.discard(old)  # this process may have warned already (another test): warn again here
        if old in MODULE_PATHS:
            sys.modules.pop(old, None)
        got, new = _use(old)
    assert got is new if old not in CALLS else _same(got, new), old
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert f"{old.replace(':', '.')} is the 0.1.x name of {home}; use {home} (CHANGELOG.md)" in messages, messages


# A fresh interpreter uses every row twice (module paths: every submodule below each, by its OLD name first, nothing
# of it imported yet) and counts the warnings: one per row; then mock.patch on an old path reaches the call.
_WALK = """
import importlib, pkgutil, sys, warnings
from unittest import mock
from nn_data._alias import MODULE_PATHS, MOVED
from tests.ops.test_old_names import _use, _same, CALLS
pairs = []
for old, new in sorted(MODULE_PATHS.items()):
    pairs.append((old, new))
    for info in pkgutil.walk_packages(importlib.util.find_spec(new).submodule_search_locations or [], new + '.'):
        pairs.append((old + info.name[len(new):], info.name))
fresh = [old for old, new in pairs if new not in sys.modules]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):
        for old, new in pairs:
            assert importlib.import_module(old) is importlib.import_module(new), (old, new)
        for old in MOVED:
            got, new = _use(old)
            assert (got is new) if old not in CALLS else _same(got, new), old
warned = sorted(str(w.message).split(' ')[0] for w in caught if 'is the 0.1.x name of' in str(w.message))
assert warned == sorted(old.replace(':', '.') for old in MOVED), warned
with mock.patch('nn_data.megatron_data.iterators.dynamic_cp_microbatch_iterator', return_value='patched'):
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
for module, name in (('nn_data.planning', 'PackShard'), ('nn_data.megatron_parallel', 'plan_step')):
    try:
        getattr(importlib.import_module(module), name)
    except AttributeError as e:
        assert repr(name) in str(e), e
    else:
        raise AssertionError(module + '.' + name + ': a name that never moved here resolved')
print(len(pairs), len(fresh))
"""


def test_every_old_name_warns_once_per_process_and_every_submodule_is_its_homes():
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


@pytest.mark.parametrize("code, line, old", [
    ("import nn_data\nimport nn_data.megatron_data\nimport nn_data.megatron_data.iterators\n", 2,
     "nn_data.megatron_data"),
    ("from nn_data import planning\nplanning.ParallelLayout\nplanning.ParallelLayout\n", 2, "nn_data.planning.ParallelLayout"),
    ("from nn_data.planning import Parallelism\np = Parallelism(dp=1)\np.round_packed_length(3)\n"
     "p.round_packed_length(3)\n", 3, "nn_data.planning.Parallelism.round_packed_length"),
])
def test_an_old_name_warns_once_at_the_callers_line_under_pythons_default_filters(code, line, old):
    """Python shows a DeprecationWarning by default only when it is attributed to ``__main__``: the warning is
    attributed to the line that uses the old name, past nn_data's and importlib's frames."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("DeprecationWarning") == 1, run.stderr
    assert f"<string>:{line}: DeprecationWarning: {old} is the 0.1.x name of" in run.stderr, run.stderr


def test_changelog_lists_every_old_name_and_nothing_else_warns():
    """Each row of MOVED is a row of CHANGELOG.md's table of 0.1.x names (its module and name, then its home's);
    no module of nn_data but its one home raises a DeprecationWarning."""
    text = (ROOT / "CHANGELOG.md").read_text()
    table = text[text.index("| 0.1.x name (still works, warns once) | 0.2 |"):].split("\n\n", 1)[0].splitlines()[2:]
    for old, new in MOVED.items():
        needles = [part for name in (old, new) for part in (name.partition(":")[0], *re.findall(r"\w+", name.partition(":")[2]))]
        assert [line for line in table if all(n in line for n in needles)], (old, new, needles)
    warners = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "nn_data").rglob("*.py")
                     if "DeprecationWarning" in p.read_text())
    assert warners == ["nn_data/_alias.py"], warners
