"""Tier: pure CPU, one process.

The 0.1.x names (CHANGELOG.md) keep working: the renamed ones warn and give the new object or the same
result; every path CHANGELOG.md promises (read from its table) and every submodule below an old path
(walked from nn_data._alias's table in a fresh interpreter, imported by the old name first) is the very
module of its new home.
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

from nn_data import layout, planning
from nn_data.layout import Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths

ROOT = Path(__file__).resolve().parents[2]


def _warns(fn, match: str):
    with pytest.warns(DeprecationWarning, match=match):
        return fn()


def test_layout_spec_is_pack_spec_with_the_old_keywords():
    spec = _warns(lambda: layout.LayoutSpec(4, 2, packed_length=16, packed_length_name="pad_packed_seq_to"),
                  r"nn_data.layout.LayoutSpec is deprecated \(0.2.0\); use nn_data.layout.PackSpec")
    assert spec == PackSpec(4, 2, fixed_total=16, arg_name="pad_packed_seq_to")


def test_plan_from_lengths_is_layout_from_lengths():
    assert _warns(lambda: layout.plan_from_lengths, "use nn_data.layout.layout_from_lengths") is layout_from_lengths


def test_plan_from_boundaries_keeps_its_signature_and_its_pair():
    bounds = torch.tensor([0, 4, 8], dtype=torch.int32)
    old = _warns(lambda: layout.plan_from_boundaries, "layout_from_boundaries over a Boundaries record")
    got, flag = old(bounds, 8, op="test", cp_size=2, extra=torch.tensor(True))
    new = layout_from_boundaries(Boundaries(bounds, 8), op="test", cp_size=2)
    assert got.host == new.host and flag is True
    _, flag = old(bounds, 8, op="test", extra=torch.tensor(False))
    assert flag is False


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
        warnings.simplefilter("error")  # an alias does not warn: both paths are published
        if old.rpartition(".")[2][:1].isupper():  # an attribute (a class) of a module that stayed
            (where, _, name), (home, _, home_name) = old.rpartition("."), new.rpartition(".")
            assert getattr(importlib.import_module(where), name) is getattr(importlib.import_module(home), home_name)
        else:
            assert importlib.import_module(old) is importlib.import_module(new)


# A fresh interpreter imports every submodule of every old path by its OLD name first (nothing of it imported
# yet), then its home, and checks they are one object; then mock.patch on an old path reaches the call.
_WALK = """
import importlib, pkgutil, sys
from unittest import mock
from nn_data._alias import OLD_PATHS
pairs = []
for old, new in sorted(OLD_PATHS.items()):
    spec = importlib.util.find_spec(new)
    pairs.append((old, new))
    for info in pkgutil.walk_packages(spec.submodule_search_locations or [], new + '.'):
        pairs.append((old + info.name[len(new):], info.name))
fresh = [old for old, new in pairs if new not in sys.modules]
for old, new in pairs:
    assert importlib.import_module(old) is importlib.import_module(new), (old, new)
with mock.patch('nn_data.megatron_data.dynamic_cp.dynamic_cp_microbatch_iterator', return_value='patched'):
    from nn_data.nemo_rl.megatron_data import get_microbatch_iterator
    assert get_microbatch_iterator(None, {}, 1, None, dynamic_cp=(None, None)) == 'patched'
try:
    import nn_data.megatron_data.no_such_module
except ModuleNotFoundError as e:
    assert e.name == 'nn_data.megatron_data.no_such_module', e.name
else:
    raise AssertionError('an old path with no home imported')
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

    import nn_data.megatron_data as old
    import nn_data.nemo_rl.megatron_data as new

    with mock.patch("nn_data.megatron_data.get_context_parallel_world_size", return_value=7):
        assert new.get_context_parallel_world_size() == 7 and old.get_context_parallel_world_size() == 7


def _old_names() -> list:
    from nn_data._alias import OLD_NAMES

    return sorted(OLD_NAMES.items())


@pytest.mark.parametrize("old, new", _old_names())
def test_every_old_attribute_is_its_homes_object(old, new):
    """Each row of ``nn_data._alias.OLD_NAMES`` (an attribute of a module that stayed, or of the former single
    ``nn_data.logprobs`` module, now a package) gives its home's very object, without a warning."""
    (where, _, name), (home, _, home_name) = old.rpartition("."), new.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(importlib.import_module(where), name) is getattr(importlib.import_module(home), home_name)


def test_the_log_prob_modules_old_paths_are_the_packages_modules():
    """The log-prob code moved into ``nn_data.logprobs`` (issue 35): each earlier module path is its module."""
    import nn_data.linear_logprob
    import nn_data.lm_head
    import nn_data.logprobs.filters
    import nn_data.sampling
    import nn_data.shared_prefix_logprobs

    assert nn_data.lm_head is nn_data.logprobs.from_hidden and nn_data.linear_logprob is nn_data.logprobs.kernels
    assert nn_data.sampling is nn_data.logprobs.filters
    assert nn_data.shared_prefix_logprobs is nn_data.logprobs.from_shared_prefix
    assert nn_data.lm_head.TokenLogProbsFromHidden is nn_data.TokenLogProbsFromHidden
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        nn_data.logprobs.nothing_here


@pytest.mark.parametrize("name", ["packed_segments", "segment_bounds", "take_layout", "INT32_MAX", "ZigzagLocal"])
def test_a_name_that_moved_to_the_internal_door_still_works_and_warns(name):
    from nn_data.layout import internal

    assert name not in layout.__all__
    got = _warns(lambda: getattr(layout, name), rf"nn_data.layout.{name} is for nn_data's own use")
    assert got is getattr(internal, name)
