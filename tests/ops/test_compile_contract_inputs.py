"""Tier: pure CPU, single process (eager; one tiny aot_eager compile for the unpack device assert).

Inputs the compile contract must refuse or handle without a hidden sync: non-integer
lengths however given, unpack boundaries past T, and no host-to-device copy of Python data (counted
by HostSyncCounter, which the ``meta`` device lets run without a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nn_data import (
    PackingError,
    PackSequences,
    PositionIds,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_to_row_capacity,
)
from nn_data.diagnostics import HostSyncCounter, cuda_sync_warnings
from nn_data.nemo_rl.megatron_data import _pack_sequences_for_megatron, _unpack_sequences_from_megatron
from nn_data.nemo_rl.megatron_data.graph import run_graph
from nn_data.nemo_rl.megatron_data.options import DropInSpec, PackOptions
from nn_data.rows import with_dynamic_row_length
from nn_data.testing.coded import coded_batch

NOT_INTEGERS = r"seq_lengths=.* is invalid: not all integers; expected integer lengths"


@pytest.mark.parametrize("lengths", [[1.5, 2, 3], (1.5, 2, 3), np.array([1.5, 2.0, 3.0]), [2.0, 2, 3], [1, 2, "3"]],
                         ids=["list", "tuple", "numpy", "list-float-valued", "list-str"])
def test_non_integer_lengths_are_refused_not_truncated(lengths):
    ids = coded_batch([2, 2, 3], 4)
    with pytest.raises(PackingError, match=r"seq_lengths=.* is invalid") as info:
        _pack_sequences_for_megatron(ids, lengths, 1)
    assert repr(lengths) in str(info.value)  # the value as given
    with pytest.raises(PackingError, match=r"seq_lengths=.* is invalid"):
        _unpack_sequences_from_megatron(torch.zeros(1, 8, 2), lengths, None, torch.tensor([0, 2, 4, 7]), 3, 4)


def test_non_integer_lengths_message_and_integer_inputs_still_work():
    ids = coded_batch([2, 2, 3], 4)
    with pytest.raises(PackingError, match=NOT_INTEGERS + r".*nothing is rounded or truncated"):
        _pack_sequences_for_megatron(ids, [1.5, 2, 3], 1)
    with pytest.raises(PackingError, match=r"seq_lengths must be a 1-D integer tensor, got shape \(3,\) and dtype torch.float32"):
        _pack_sequences_for_megatron(ids, torch.tensor([1.5, 2, 3]), 1)
    want = _pack_sequences_for_megatron(ids, torch.tensor([2, 2, 3]), 1)
    for given in ([2, 2, 3], (2, 2, 3), np.array([2, 2, 3]), np.array([2, 2, 3], dtype=np.int32)):
        got = _pack_sequences_for_megatron(ids, given, 1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4])
    out = _unpack_sequences_from_megatron(want[0][..., None], np.array([2, 2, 3]), want[3], want[4], 3, 4)
    assert torch.equal(out[..., 0], torch.where(ids > 0, ids, 0))


def test_unpack_refuses_boundaries_past_t():
    packed = torch.arange(1, 13).view(1, 12)
    lengths, bounds = torch.tensor([3, 5]), torch.tensor([0, 4, 40])  # the last boundary is past T = 12
    with pytest.raises(PackingError, match=r"cu_seqlens_padded\[2\] = 40 is outside \[0, T=12\]"):
        UnpackSequences(5)(packed, lengths, bounds)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded\[0\] = -4 is outside \[0, T=12\]"):
        UnpackSequences(5)(packed, lengths, torch.tensor([-4, 4, 12]))
    torch._dynamo.reset()
    compiled = torch.compile(UnpackSequences(5), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"every boundary of cu_seqlens_padded must lie in \[0, T\]"):
        compiled(packed, lengths, bounds)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_padded must start at 0, never decrease and end at T"):
        compiled(packed, lengths, torch.tensor([0, 4, 9]))  # ends before T (unpadded boundaries, say)
    assert compiled(packed, lengths, torch.tensor([0, 4, 12])).tolist() == [[1, 2, 3, 0, 0], [5, 6, 7, 8, 9]]
    torch._dynamo.reset()


def test_host_sync_counter_counts_python_data_copied_to_a_device():
    on_meta = torch.zeros(2, device="meta")
    with HostSyncCounter() as syncs:
        torch.tensor(3, device="meta")
        torch.as_tensor([1, 2], device="meta")
        torch.asarray([1, 2], device="meta")
        on_meta.new_tensor([4, 5])
        torch.tensor([1, 2])  # on the CPU: no copy to a device
        torch.as_tensor(torch.zeros(2), device="meta")  # from a tensor, not from Python data
        torch.full((), 3, device="meta")  # written on the device
    assert syncs.count == 4
    assert syncs.calls == ["torch.tensor", "torch.as_tensor", "torch.asarray", "Tensor.new_tensor"]
    assert torch.tensor.__module__ != __name__ and not hasattr(torch.tensor, "__wrapped__")  # restored


def test_cuda_sync_warnings_count_each_sync_but_not_the_debug_modes_notice():
    """The CUDA counter's filter (no GPU needed: the warnings are made here with the texts torch uses)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations")  # set_sync_debug_mode's first call in a process
        warnings.warn("called a synchronizing CUDA operation")  # a sync (c10)
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("TensorFloat32 tensor cores for float32 matrix multiplication available")
    assert [str(w.message) for w in cuda_sync_warnings(caught)] == ["called a synchronizing CUDA operation"] * 2


def test_no_python_data_copied_to_the_device():
    """Row padding, B = 0 boundaries and the ops' static path build every tensor on the device."""
    ids = torch.zeros(3, 6, dtype=torch.int64, device="meta")
    lengths = torch.zeros(3, dtype=torch.int64, device="meta")
    empty = torch.zeros(0, dtype=torch.int64, device="meta")
    with HostSyncCounter() as syncs:
        padded = pad_to_row_capacity(ids, lengths, 8)
        r = PackSequences(4, pad_full_seq_to=32, validate=False, host_reads=False)(padded.x, padded.seq_lengths, padded.num_rows)
        none = PackSequences(4, pad_full_seq_to=32, validate=False, host_reads=False)(ids[:0], empty)  # B = 0: [0, T] on the device
        for result in (r, none):
            local = ShardForContextParallel(2, 1, validate=False, host_reads=False)(result.packed, result.cu_seqlens_padded)
            UnshardFromContextParallel(2, validate=False, host_reads=False)(local.expand(2, -1), result.cu_seqlens_padded)
            PositionIds(2, 1, validate=False, host_reads=False)(result.packed, result.cu_seqlens_padded)
        UnpackSequences(6, validate=False, host_reads=False)(r.packed, padded.seq_lengths, r.cu_seqlens_padded)
    assert syncs.count == 0, syncs.calls


def test_compat_compiled_path_copies_no_python_data():
    """The compiled switch's row padding and row count (run on ``meta`` through the eager backend;
    the first call compiles outside the counter)."""
    torch._dynamo.reset()
    ids = torch.zeros(3, 6, dtype=torch.int64, device="meta")
    lengths = torch.zeros(3, dtype=torch.int64, device="meta")
    options = PackOptions(compile=True, row_capacity=4, backend="eager")
    kw = dict(spec=DropInSpec(4, 1, cp_size=2), total=32, cp_rank=0, options=options)
    run_graph(ids, lengths, {}, **kw)
    with HostSyncCounter() as syncs:
        full, local = run_graph(ids, lengths, {}, **kw)
    assert syncs.count == 0, syncs.calls
    assert full["input_ids"].shape == (1, 32) and local["input_ids"].shape == (1, 16)
    torch._dynamo.reset()


def test_with_dynamic_row_length_gives_empty_batches_row_major_strides():
    x = with_dynamic_row_length(torch.zeros(8, 0, 4, 2))
    assert x.shape == (8, 0, 4, 2) and x.stride() == (0, 8, 2, 1)
    y = torch.zeros(3, 5)
    assert with_dynamic_row_length(y) is y
    with pytest.raises(PackingError, match=r"t must have at least 2 dims \[B, S, \*\], got shape \(3,\)"):
        with_dynamic_row_length(torch.zeros(3))
