"""Tier: pure CPU, single process (hypothesis; one torch.compile with the aot_eager backend).

The packed, CP-sharded padding mask (``PackLayout.padding_mask``, ``PackedInfo.padding_mask``): True
exactly at the padding positions of this rank's shard (each segment's slack, the extended last segment,
every position of a microbatch of no sequence), on plans made on the host and on the device, with row
capacity, compiled in one graph with no host sync.

The oracle packs the ``[B, S]`` valid-token mask with the loop reference (padding False), inverts it and
takes the rank's zigzag shard with the loop reference.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackSequences, pad_to_row_capacity
from nn_data.diagnostics import HostSyncCounter
from nn_data.packed_forward import PackedForward
from nn_data.testing.coded import coded_batch, valid_mask
from nn_data.testing.reference import reference_pack, reference_padding_mask, reference_shard
from tests.support.hypothesis_profiles import examples


def _round_up(x, m):
    return -(-x // m) * m


def expected_padding(lengths, seq_len, m, full, cp, rank) -> torch.Tensor:
    """``[1, T/C]`` bool from the loop references: True where no valid token sits (two independent
    spellings of the same oracle must agree)."""
    ref = reference_pack(valid_mask(lengths, seq_len), lengths, m, 1, full, fill=False)
    want = reference_shard(~ref.packed, ref.cu_seqlens_padded, cp, rank)
    assert torch.equal(want, reference_padding_mask(lengths, m, 1, full, cp, rank))
    return want


@st.composite
def cases(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    rows = draw(st.integers(0, 9))
    seq_len = draw(st.integers(0, 20))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=rows, max_size=rows))
    m = 2 * cp * draw(st.integers(1, 3)) if cp > 1 else draw(st.integers(1, 6))
    natural = sum(_round_up(n, m) for n in lengths)
    step = m * 2 * cp // math.gcd(m, 2 * cp)
    full = _round_up(natural + draw(st.integers(0, 30)), step) or step
    capacity = draw(st.one_of(st.none(), st.integers(rows, rows + 3))) if rows else None
    return dict(cp=cp, rank=draw(st.integers(0, cp - 1)), lengths=lengths, seq_len=seq_len, m=m, full=full,
                capacity=capacity, device_plan=draw(st.booleans()))


@settings(max_examples=examples(120), deadline=None)
@given(cases())
def test_padding_mask_is_true_exactly_at_the_padding_of_the_shard(case):
    lengths, seq_len, cp, rank = case["lengths"], case["seq_len"], case["cp"], case["rank"]
    x, lens = coded_batch(lengths, seq_len), torch.tensor(lengths, dtype=torch.int64)
    # host_reads=False plans on the device (index maps, no read); the default plans on the host.
    pack = PackSequences(case["m"], pad_full_seq_to=case["full"], host_reads=not case["device_plan"])
    num_rows = None
    if case["capacity"] is not None:
        x, lens, num_rows = pad_to_row_capacity(x, lens, case["capacity"])
    layout = pack(x, lens, num_rows).layout
    assert (layout.host is None) == case["device_plan"]
    got = layout.padding_mask(cp, rank)
    want = expected_padding(lengths, seq_len, case["m"], case["full"], cp, rank)
    assert got.dtype == torch.bool and got.shape == (1, case["full"] // cp)
    assert torch.equal(got, want), (got.int().tolist(), want.int().tolist())
    assert torch.equal(layout.padding_mask(cp, rank, places=layout.local_places(cp, rank)), got)


def test_worked_example_and_no_sequence():
    layout = PackSequences(4, pad_full_seq_to=12)(coded_batch([3, 0, 5], 5), torch.tensor([3, 0, 5])).layout
    assert layout.padding_mask().int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1]]
    assert layout.padding_mask(2, 0).int().tolist() == [[0, 1, 0, 0, 1, 1]]  # positions 0, 3, 4, 5, 10, 11
    empty = PackSequences(4, pad_full_seq_to=8)(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert empty.layout.padding_mask(2, 1).tolist() == [[True] * 4]


def test_device_plan_builds_it_with_no_host_sync_and_compiles_into_one_graph():
    pack = PackSequences(4, pad_full_seq_to=32, validate=False, host_reads=False)

    def mask(x, lens, num_rows):
        return pack(x, lens, num_rows).layout.padding_mask(2, 1)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mask, backend=counter, fullgraph=True)
    for lengths in ([3, 0, 5], [8, 8, 1, 4], [], [0]):
        padded = pad_to_row_capacity(coded_batch(lengths, 8), torch.tensor(lengths, dtype=torch.int64), 4)
        with HostSyncCounter() as syncs:
            eager = mask(*padded)
        assert syncs.count == 0, syncs.calls
        assert torch.equal(compiled(*padded), eager)
        assert torch.equal(eager, expected_padding(lengths, 8, 4, 32, 2, 1))
    assert counter.frame_count == 1


def test_packed_forward_hands_the_model_this_ranks_padding_mask():
    seen = {}

    def probe(input_ids, position_ids, packed):
        seen["info"] = packed
        return input_ids[..., None].float()

    lengths = [3, 0, 6]
    PackedForward(probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16, row_capacity=5)(
        coded_batch(lengths, 7), torch.tensor(lengths))
    info = seen["info"]
    assert torch.equal(info.padding_mask, expected_padding(lengths, 7, 4, 16, 1, 0))
    assert info.padding_mask.tolist() == [[False] * 3 + [True] + [False] * 6 + [True] * 6]
