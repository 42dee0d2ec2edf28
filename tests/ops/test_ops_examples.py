"""Tier: pure CPU, single process, eager mode.

Worked examples of the core ops with exact expected tensors.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch

from nn_data import (
    PackingError,
    PackSequences,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_to_row_capacity,
)
from nn_data.diagnostics import HostSyncCounter
from nn_data.layout.host import HostBounds
from nn_data.testing.reference import reference_pack


def _ids(rows):
    """Rows of token ids padded with 0 to the longest row."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def test_zero_length_row_and_multiple_4():
    x = _ids([[11, 12, 13], [], [31, 32, 33, 34, 35]])
    r = PackSequences(pad_individual_seqs_to_multiple_of=4)(x, torch.tensor([3, 0, 5]))
    assert r.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert r.cu_seqlens_padded.tolist() == [0, 4, 4, 12]
    assert r.packed.tolist() == [[11, 12, 13, 0, 31, 32, 33, 34, 35, 0, 0, 0]]
    assert r.max_seqlen.item() == 8
    assert r.cu_seqlens.dtype == r.cu_seqlens_padded.dtype == torch.int32
    # Eagerly the layout gets a host executor (one read of the lengths): its Python ints move the data.
    assert r.layout.host == HostBounds([3, 0, 5], [0, 3, 3, 8], [0, 4, 4, 12], [4, 0, 8], 8, 3)
    assert type(r.layout.executor).__name__ == "HostExecutor"
    assert r.layout.positions().tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert r.layout.segment_ids().tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2]
    # On the device (compiled, or host_reads=False) the executor holds index maps: B*S <= 16T, the scatter form.
    d = PackSequences(pad_individual_seqs_to_multiple_of=4, host_reads=False)(x, torch.tensor([3, 0, 5]))
    assert d.layout.host is None
    assert d.layout.executor.dest.tolist() == [[0, 1, 2, 12, 12], [12] * 5, [4, 5, 6, 7, 8]]
    assert torch.equal(d.packed, r.packed) and torch.equal(d.cu_seqlens_padded, r.cu_seqlens_padded)


def test_host_reads_picks_the_executor_and_validate_only_validates():
    """The executor follows ``host_reads`` (and the compile state), never ``validate``: eagerly a host executor
    after one read whatever ``validate`` says, a device executor with no read for ``host_reads=False``."""
    x = _ids([[11, 12, 13], [], [31, 32, 33, 34, 35]])
    expected = PackSequences(4)(x, torch.tensor([3, 0, 5])).packed
    for validate in (True, False):
        for host_reads in (True, False):
            pack = PackSequences(4, pad_full_seq_to=16, validate=validate, host_reads=host_reads)
            with HostSyncCounter() as syncs:
                r = pack(x, torch.tensor([3, 0, 5]))
            assert type(r.layout.executor).__name__ == ("HostExecutor" if host_reads else "DeviceExecutor")
            assert syncs.count == int(host_reads), (validate, host_reads, syncs.calls)
            assert torch.equal(r.packed[:, :12], expected) and not r.packed[:, 12:].any()
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 9"):
        PackSequences(4, pad_full_seq_to=16)(x, torch.tensor([9, 0, 5]))  # validate: checked on the host executor


def test_gather_form_layout_when_the_batch_is_mostly_padding():
    """B*S > 16T: the layout reads the T packed positions (source, valid) instead of all B*S."""
    x = torch.zeros(3, 80, dtype=torch.int64)
    x[0, :3], x[2, :5] = torch.tensor([11, 12, 13]), torch.tensor([31, 32, 33, 34, 35])
    r = PackSequences(pad_individual_seqs_to_multiple_of=4, host_reads=False)(x, torch.tensor([3, 0, 5]))
    assert r.layout.executor.dest is None
    assert r.layout.executor.gather.source.tolist() == [0, 1, 2, 3, 160, 161, 162, 163, 164, 165, 166, 167]
    assert r.layout.executor.gather.valid.tolist() == [True] * 3 + [False] + [True] * 5 + [False] * 3
    assert r.packed.tolist() == [[11, 12, 13, 0, 31, 32, 33, 34, 35, 0, 0, 0]]
    assert torch.equal(r.layout.pack(x.bool()), r.packed.bool())


def test_multiple_8_and_packed_multiple():
    x = _ids([[1] * 9, [2] * 3])
    r = PackSequences(8, 32)(x, torch.tensor([9, 3]))
    assert r.cu_seqlens_padded.tolist() == [0, 16, 32]  # 16 + 8 = 24 -> rounded up to 32, last absorbs
    assert r.packed.tolist() == [[1] * 9 + [0] * 7 + [2] * 3 + [0] * 13]
    assert r.max_seqlen.item() == 16


def test_no_padding_requested_copies_cu_seqlens():
    x = _ids([[5, 6], [7, 8, 9]])
    r = PackSequences()(x, torch.tensor([2, 3]))
    assert r.cu_seqlens_padded.tolist() == r.cu_seqlens.tolist() == [0, 2, 5]
    assert r.cu_seqlens_padded.data_ptr() != r.cu_seqlens.data_ptr()
    assert r.packed.tolist() == [[5, 6, 7, 8, 9]]


def test_pad_full_seq_to_extends_last_segment():
    x = _ids([[1, 2, 3], [4, 5, 6, 7, 8]])
    r = PackSequences(4, pad_full_seq_to=20)(x, torch.tensor([3, 5]))
    assert r.cu_seqlens_padded.tolist() == [0, 4, 20]
    assert r.packed.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8] + [0] * 11]
    assert r.max_seqlen.item() == 16  # the extended last segment counts


def test_pad_full_seq_to_with_trailing_zero_length_row():
    """NeMo-RL: the last sequence absorbs the slack even when it is empty."""
    x = _ids([[1, 2, 3], []])
    r = PackSequences(4, pad_full_seq_to=12)(x, torch.tensor([3, 0]))
    assert r.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert r.max_seqlen.item() == 8


def test_cp2_two_16_token_sequences_pad_full_seq_to_40():
    x = torch.arange(1, 33).view(2, 16)  # row 0: 1..16, row 1: 17..32
    lengths = torch.tensor([16, 16])
    r = PackSequences(4, pad_full_seq_to=40)(x, lengths)
    assert r.cu_seqlens_padded.tolist() == [0, 16, 40]
    # Segments 16 and 24 long -> chunks of 4 and 6 tokens.
    rank0 = ShardForContextParallel(2, 0)(r.packed, r.cu_seqlens_padded)
    rank1 = ShardForContextParallel(2, 1)(r.packed, r.cu_seqlens_padded)
    assert rank0.tolist() == [[1, 2, 3, 4, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22] + [0] * 6]
    assert rank1.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 0, 0]]
    full = UnshardFromContextParallel(2)(torch.cat([rank0, rank1]), r.cu_seqlens_padded)
    assert torch.equal(full, r.packed)
    out = UnpackSequences(16)(full, lengths, r.cu_seqlens_padded)
    assert torch.equal(out, x)


def test_cp1_shard_is_identity():
    packed = torch.arange(6).view(1, 6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert ShardForContextParallel(1, 0)(packed, cu) is packed
    assert torch.equal(UnshardFromContextParallel(1)(packed, cu), packed)


def test_unshard_small_example():
    shards = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]])
    out = UnshardFromContextParallel(2)(shards, torch.tensor([0, 8]))
    assert out.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_unpack_uses_padded_offsets():
    packed = torch.tensor([[11, 12, 13, 0, 31, 32, 33, 34, 35, 0, 0, 0]])
    out = UnpackSequences(5)(packed, torch.tensor([3, 0, 5]), torch.tensor([0, 4, 4, 12]))
    assert out.tolist() == [[11, 12, 13, 0, 0], [0, 0, 0, 0, 0], [31, 32, 33, 34, 35]]


def test_unpack_trailing_dims_and_fill_value():
    packed = torch.arange(1, 9, dtype=torch.float32).view(1, 4, 2)
    out = UnpackSequences(3, fill_value=-1.0)(packed, torch.tensor([1, 2]), torch.tensor([0, 2, 4]))
    assert out.tolist() == [[[1, 2], [-1, -1], [-1, -1]], [[5, 6], [7, 8], [-1, -1]]]


def test_layout_reused_for_masks_and_routed_experts():
    lengths = torch.tensor([2, 0, 3])
    ids = _ids([[1, 2], [], [3, 4, 5]])
    mask = ids != 0
    layers, topk = 2, 3
    experts = torch.arange(3 * 3 * layers * topk).view(3, 3, layers, topk) + 100
    r = PackSequences(2, pad_full_seq_to=8)(ids, lengths)
    packed_mask = r.layout.pack(mask)
    packed_experts = r.layout.pack(experts, fill=torch.arange(topk))
    assert packed_mask.dtype == torch.bool
    assert packed_mask.tolist() == [[True, True, True, True, True, False, False, False]]
    assert packed_experts.shape == (1, 8, layers, topk)
    pad_route = torch.arange(topk).expand(layers, topk)
    ref = reference_pack(experts, lengths, 2, 1, 8, fill=torch.arange(topk)).packed
    assert torch.equal(packed_experts, ref)
    for t in (5, 6, 7):
        assert torch.equal(packed_experts[0, t], pad_route)
    assert torch.equal(packed_experts[0, 2], experts[2, 0])


def test_row_capacity_keeps_real_rows_exact():
    x = _ids([[1, 2, 3], [4, 5]])
    lengths = torch.tensor([3, 2])
    plain = PackSequences(4, pad_full_seq_to=16)(x, lengths)
    padded = pad_to_row_capacity(x, lengths, capacity=5)
    assert padded.x.shape == (5, 3) and padded.seq_lengths.tolist() == [3, 2, 0, 0, 0]
    assert padded.num_rows.item() == 2
    r = PackSequences(4, pad_full_seq_to=16)(padded.x, padded.seq_lengths, padded.num_rows)
    assert torch.equal(r.packed, plain.packed)
    assert r.cu_seqlens_padded.tolist() == [0, 4, 16, 16, 16, 16]  # the last real row absorbs the slack
    assert r.cu_seqlens_padded[:3].tolist() == plain.cu_seqlens_padded.tolist()
    assert r.cu_seqlens.tolist() == [0, 3, 5, 5, 5, 5]
    assert r.max_seqlen.item() == plain.max_seqlen.item() == 12


def test_empty_batch_is_valid():
    x = torch.zeros(0, 4, dtype=torch.int64)
    r = PackSequences(4, pad_full_seq_to=8)(x, torch.zeros(0, dtype=torch.int64))
    assert r.packed.tolist() == [[0] * 8]
    assert r.cu_seqlens.tolist() == [0] and r.cu_seqlens_padded.tolist() == [8]
    assert r.max_seqlen.item() == 8  # one padding pseudo-segment [0, T], as a padding row would give
    padded = pad_to_row_capacity(x, torch.zeros(0, dtype=torch.int64), capacity=2)
    rp = PackSequences(4, pad_full_seq_to=8)(padded.x, padded.seq_lengths, padded.num_rows)
    assert rp.cu_seqlens_padded.tolist() == [0, 8, 8] and rp.max_seqlen.item() == 8
    shard = ShardForContextParallel(2, 1)(r.packed, r.cu_seqlens_padded)
    assert shard.shape == (1, 4)
    out = UnpackSequences(4)(r.packed, torch.zeros(0, dtype=torch.int64), r.cu_seqlens_padded)
    assert out.shape == (0, 4)
    r0 = PackSequences()(x, torch.zeros(0, dtype=torch.int64))
    assert r0.packed.shape == (1, 0) and r0.cu_seqlens_padded.tolist() == [0]


def test_host_sync_counter_counts_reference_loop_syncs():
    """The NeMo-RL-style loop syncs 2B+1 times (B lengths, B+1 boundaries); the counter sees them."""
    from nn_data.diagnostics import HostSyncCounter
    from nn_data.testing.reference import reference_shard

    x = torch.ones(5, 8, dtype=torch.int64)
    lengths = torch.tensor([8, 4, 0, 4, 8])
    with HostSyncCounter() as syncs:
        ref = reference_pack(x, lengths, 4, 1, 32)
        reference_shard(ref.packed, ref.cu_seqlens_padded, 2, 0)
    assert syncs.count == 2 * 5 + 1


def test_unpack_of_an_empty_microbatch_stays_in_the_autograd_graph():
    # A model's output for a microbatch of no row (B = 0), or a packed tensor of no token (T = 0),
    # unpacks to rows a loss can still call backward() on (a PP stream's empty microbatch does).
    for lengths, bounds, total in (([], [8], 8), ([0, 0], [0, 0, 0], 0)):
        out = torch.randn(1, total, 3, requires_grad=True)
        rows = UnpackSequences(5)(out, torch.tensor(lengths, dtype=torch.long), torch.tensor(bounds))
        assert rows.shape == (len(lengths), 5, 3) and not rows.any()
        rows.sum().backward()
        assert out.grad is not None and not out.grad.any()


@pytest.mark.parametrize("host_reads", [True, False])  # the host executor, and the device executor
def test_an_all_empty_pack_of_features_stays_in_autograd(host_reads):
    ids = torch.zeros(2, 4, dtype=torch.int64)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    layout = PackSequences(4, 1, 16, host_reads=host_reads)(ids, torch.tensor([0, 0])).layout
    packed = layout.pack(x)
    assert packed.requires_grad and packed.shape == (1, 16, 3)
    (grad,) = torch.autograd.grad(packed.sum(), x)  # raised "does not require grad" before
    assert torch.equal(grad, torch.zeros_like(x))


@pytest.mark.parametrize("lengths", [[3, 2, 5], (3, 2, 5), np.array([3, 2, 5])])
def test_pack_sequences_takes_lengths_as_a_list_tuple_or_numpy_array(lengths):
    ids = torch.arange(1, 16).view(3, 5)
    r = PackSequences(4)(ids, lengths)
    assert r.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert torch.equal(UnpackSequences(5)(r.packed, layout=r.layout), ids * (torch.arange(5) < torch.tensor(
        [3, 2, 5])[:, None]))
