"""Tier: pure CPU, one process.

The 0.1.x names (CHANGELOG.md) keep working: the renamed ones warn and give the new object or the same
result; the moved modules are the very modules of their new homes.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from nn_data import layout, planning
from nn_data.layout import Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths


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


@pytest.mark.parametrize("old, new", [("nn_data.megatron_data", "nn_data.nemo_rl.megatron_data"),
                                      ("nn_data.model_utils", "nn_data.nemo_rl.model_utils"),
                                      ("nn_data.batched_data_dict", "nn_data.nemo_rl.batched_data_dict"),
                                      ("nn_data.models.masks", "nn_data.masks")])
def test_a_moved_module_is_its_new_home(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a module alias does not warn: both paths are published
        assert importlib.import_module(old) is importlib.import_module(new)


def test_patching_the_old_path_patches_what_process_microbatch_calls():
    from unittest import mock

    import nn_data.megatron_data as old
    import nn_data.nemo_rl.megatron_data as new

    with mock.patch("nn_data.megatron_data.get_context_parallel_world_size", return_value=7):
        assert new.get_context_parallel_world_size() == 7 and old.get_context_parallel_world_size() == 7
