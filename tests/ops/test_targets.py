"""Tier: pure CPU, single process.

PositionIds and NextTokenTargets on the packed layout, for the whole tensor (C=1)
and for each rank's zigzag shard (C>1, simulated in one process: these ops need no
communication), against the loop references; error messages; torch.compile
(fullgraph, one frame for a stream of microbatches) and a sync-free run on meta tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from tests.support.cp_cases import make_microbatch, pack_single
from nn_data import NextTokenTargets, PackingError, PackSequences, PositionIds, pad_to_row_capacity
from nn_data.testing.reference import reference_next_token_targets, reference_position_ids, reference_shard

IDS = torch.tensor([[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]])
CU = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
CU_PAD = torch.tensor([0, 4, 4, 12], dtype=torch.int32)


def test_docstring_examples():
    assert PositionIds()(IDS, CU_PAD).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert PositionIds(2, 1)(IDS, CU_PAD).tolist() == [[1, 2, 2, 3, 4, 5]]
    t = NextTokenTargets()(IDS, CU, CU_PAD)
    assert t.targets.tolist() == [[2, 3, -100, -100, 5, 6, 7, 8, -100, -100, -100, -100]]
    assert t.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert t.targets.dtype == torch.int64 and t.loss_mask.dtype == torch.float32


def test_last_token_never_targets_the_next_sequence():
    # verl PR 6564: rolling the flat packed tensor gave sequence 0's last token (3) the
    # first token of sequence 1 (4) as its target. Back-to-back sequences, no padding.
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    t = NextTokenTargets(ignore_index=-1)(ids, cu, cu)
    assert t.targets.tolist() == [[2, 3, -1, 5, 6, -1]]
    assert torch.roll(ids, -1, 1)[0, 2] == 4  # what the flat roll would have used
    assert t.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0]]


@st.composite
def packed_batches(draw):
    cp_size = draw(st.sampled_from([1, 2, 4]))
    rows = draw(st.integers(0, 5))
    seq_len = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=rows, max_size=rows))
    m = 2 * cp_size * draw(st.sampled_from([1, 2])) if cp_size > 1 else draw(st.sampled_from([1, 2, 3]))
    natural = sum(-(-n // m) * m for n in lengths)
    tail = draw(st.sampled_from([None, 0, 2 * cp_size, 6 * cp_size]))
    pad_full = None if tail is None else max(natural + tail, 2 * cp_size)
    capacity = draw(st.sampled_from([None, rows + 2])) if pad_full is not None else None
    return cp_size, lengths, seq_len, m, pad_full, capacity


def _pack(lengths, seq_len, m, pad_full, capacity, cp_size, host_reads=True):
    rows = len(lengths)
    code = 1000 * torch.arange(rows)[:, None] + torch.arange(seq_len) + 1  # [B, S] unique codes
    lens = torch.tensor(lengths, dtype=torch.int64)
    num_rows = None
    if capacity is not None:
        code, lens, num_rows = pad_to_row_capacity(code, lens, capacity)
    p = 2 * cp_size if cp_size > 1 else 1
    return PackSequences(m, p, pad_full, host_reads=host_reads)(code, lens, num_rows)


@settings(max_examples=examples(60), deadline=None)
@given(packed_batches(), st.sampled_from(["host", "device", "host, boundaries", "device, boundaries"]))
def test_positions_and_targets_match_the_references_on_every_rank(case, executor):
    """On both executors: the pack's plan made on the host or on the device (``host_reads=False``), and
    the ops given that plan (``layout=``) or the boundaries."""
    cp_size, lengths, seq_len, m, pad_full, capacity = case
    host_reads, travel = executor.startswith("host"), not executor.endswith("boundaries")
    r = _pack(lengths, seq_len, m, pad_full, capacity, cp_size, host_reads)
    assert (r.layout.host is not None) == host_reads
    total = r.packed.shape[1]
    full_pos = reference_position_ids(r.cu_seqlens_padded, total)
    full_t, full_m = reference_next_token_targets(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
    seen = 0

    def shard(t, rank):  # the reference shard needs segments divisible by 2C, which C=1 does not ask
        return t if cp_size == 1 else reference_shard(t, r.cu_seqlens_padded, cp_size, rank)

    for rank in range(cp_size):
        if travel:
            pos = PositionIds(cp_size, rank)(r.packed, layout=r.layout)
            t = NextTokenTargets(cp_size, rank)(r.packed, layout=r.layout)
        else:
            pos = PositionIds(cp_size, rank, host_reads=host_reads)(r.packed, r.cu_seqlens_padded)
            t = NextTokenTargets(cp_size, rank, host_reads=host_reads)(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
        assert torch.equal(pos, shard(full_pos, rank))
        assert torch.equal(t.targets, shard(full_t, rank))
        assert torch.equal(t.loss_mask, shard(full_m, rank))
        # codes 1000*b + s + 1: a target inside its own sequence is the token's code + 1
        local_ids = shard(r.packed, rank)
        has = t.loss_mask.bool()
        assert torch.equal(t.targets[has], local_ids[has] + 1)
        seen += int(has.sum())
    assert seen == sum(max(n - 1, 0) for n in lengths)  # every token with a successor, exactly once


def test_padding_positions_continue_counting_inside_the_segment():
    r = _pack([3, 0, 5], 8, 4, 20, None, 1)  # segments 4, 0, 16 (the last absorbs the tail)
    assert r.cu_seqlens_padded.tolist() == [0, 4, 4, 20]
    assert PositionIds()(r.packed, r.cu_seqlens_padded).tolist() == [[0, 1, 2, 3] + list(range(16))]
    empty = PackSequences(1, 1, 6)(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert PositionIds()(empty.packed, empty.cu_seqlens_padded).tolist() == [[0, 1, 2, 3, 4, 5]]
    t = NextTokenTargets()(empty.packed, empty.cu_seqlens, empty.cu_seqlens_padded)
    assert t.targets.tolist() == [[-100] * 6] and t.loss_mask.sum() == 0


def test_bad_arguments_name_the_argument_and_the_valid_values():
    with pytest.raises(PackingError, match=r"cp_rank=2 is invalid; expected an int in \[0, 2\)"):
        PositionIds(2, 2)
    with pytest.raises(PackingError, match="packed_ids must be integer token ids"):
        NextTokenTargets()(IDS.float(), CU, CU_PAD)
    with pytest.raises(PackingError, match="T=12 is not a multiple of 2\\*cp_size=8"):
        NextTokenTargets(4, 0)(IDS, CU, CU_PAD)
    with pytest.raises(PackingError, match="cu_seqlens has 3 entries; expected 4"):
        NextTokenTargets()(IDS, CU[:3], CU_PAD)
    with pytest.raises(PackingError, match="segment 0 of cu_seqlens_padded is 6 tokens long, not a multiple of"):
        NextTokenTargets(2, 0)(torch.zeros(1, 8, dtype=torch.int64), torch.tensor([0, 3, 5]), torch.tensor([0, 6, 8]))
    with pytest.raises(PackingError, match=r"the length 5 of sequence 1 \(from cu_seqlens\) does not fit its "
                                           r"segment of cu_seqlens_padded"):
        NextTokenTargets()(IDS, torch.tensor([0, 3, 8, 8]), CU_PAD)
    with pytest.raises(PackingError, match="must start at 0, never decrease and end at 12"):
        PositionIds()(IDS, torch.tensor([0, 4, 4, 10]))


def _stream(cp_size: int):
    """Microbatches of one static shape: capacity 4 rows, S 16, T 80, lengths varying."""
    out = []
    for lengths in ([5, 0, 16, 3], [0, 0, 0, 0], [16, 16, 16, 16], [1, 7], [], [12]):
        mb = make_microbatch(lengths, cp_size, pad_full_seq_to=80, capacity=4, name=str(lengths))
        out.append(pack_single(mb).result)
    return out


@pytest.mark.compile
def test_compiled_positions_and_targets_match_eager_with_one_frame():
    ops = [PositionIds(), NextTokenTargets(), PositionIds(2, 1), NextTokenTargets(2, 1)]

    def all_four(ids, cu, cu_pad):
        return (ops[0](ids, cu_pad), *ops[1](ids, cu, cu_pad), ops[2](ids, cu_pad), *ops[3](ids, cu, cu_pad))

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(all_four, fullgraph=True, backend=counter)
    for r in _stream(2):
        got = compiled(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
        want = all_four(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert counter.frame_count == 1


def test_ops_run_on_meta_tensors_so_they_never_read_values_on_the_host():
    ids = torch.empty(1, 80, dtype=torch.int64, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    assert PositionIds(2, 1, validate=False, host_reads=False)(ids, cu).shape == (1, 40)
    t = NextTokenTargets(4, 3, validate=False, host_reads=False)(ids, cu, cu)
    assert t.targets.shape == t.loss_mask.shape == (1, 20)
