"""Tier: pure CPU, single process; the block-mask test compiles create_block_mask (flex on a CPU:
forward only, float32) and the stream test compiles one inductor graph (module-scoped).

Shared-prefix packing (nn_data.layout.shared_prefix_layout, nn_data.masks.PrefixRule): each group's
prompt packed once, then its responses, against a loop reference built rollout by rollout: the
packed row, positions, slots, unpack to every rollout's own row, the attention rule equal to each
rollout alone; validation on the one host read and as device asserts; one compiled graph, no sync.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, TreeLayout, shared_prefix_layout
from nn_data.masks import PrefixRule, document_causal_mask, document_mask
from tests.support.hypothesis_profiles import examples
from tests.support.shared_prefix_reference import places, reference, rollouts
from tests.support.flex_release import needs_cpu_flex


# ---- the attention rule, from each rollout alone ------------------------------------------------

def rollout_mask(groups, prefix, lengths, token, seg, window=None):
    """``[T, T]`` bool from each rollout alone: a real query, token ``s`` of rollout ``b`` (of its
    leader for a prompt position), sees exactly the packed places of ``b``'s tokens ``s' <= s`` (within
    the window). Padding queries' rows are left False (the caller checks only that they see themselves)."""
    total = len(token)
    place = places(groups, prefix, token)
    out = torch.zeros(total, total, dtype=torch.bool)
    for i, t in enumerate(token):
        if t is None:
            continue
        b, s = t
        for s2 in range(s + 1):
            if window is None or s - s2 < window:
                out[i, place[(b, s2)]] = True
    return out


# ---- fixed cases ---------------------------------------------------------------------------------

CASE = dict(groups=[7, 7, 9], prefix=[2, 2, 1], lengths=[4, 3, 3])


def test_the_contracts_example():
    x = rollouts(**CASE, seq_len=4)
    sp = shared_prefix_layout(torch.tensor(CASE["lengths"]), torch.tensor(CASE["prefix"]),
                              torch.tensor(CASE["groups"]), row_len=4, spec=PackSpec(1), input_ids=x)
    assert isinstance(sp, TreeLayout) and sp.layout.rows == 6 and sp.total == 8
    assert sp.layout.cu_seqlens_padded.tolist() == [0, 2, 4, 4, 5, 6, 8]
    assert sp.pack(x).tolist() == [[1000, 1001, 1502, 1503, 2502, 3000, 3501, 3502]]
    assert sp.positions().tolist() == [0, 1, 2, 3, 2, 0, 1, 2]
    assert sp.segment_ids().tolist() == [0, 0, 1, 1, 3, 4, 5, 5]
    rule = sp.prefix_rule()
    assert rule.rollout_ids.tolist() == [0, 0, 0, 0, 1, 2, 2, 2] and rule.visible.all()
    every = torch.iinfo(torch.int64).max
    assert rule.shared.tolist() == [[every, 0, 0, 0], [2, every, 0, 0], [0, 0, every, 0], [0, 0, 0, 0]]
    # each rollout's path over the keys: rollout 1 sees the prompt (positions 0, 1) and itself, not r0's own
    assert rule.paths().int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 1, 0, 0, 0],
                                           [0, 0, 0, 0, 0, 1, 1, 1], [0] * 8]
    assert torch.equal(sp.unpack(sp.pack(x), fill=-7), x)


@pytest.mark.parametrize("groups, prefix, lengths", [
    ([], [], []),  # B = 0
    ([3], [4], [6]),  # a group of one
    ([1, 1, 1], [3, 3, 3], [3, 5, 3]),  # empty responses
    ([1, 1, 2], [0, 0, 0], [4, 0, 2]),  # P = 0: no prompt at all, an empty rollout
    ([5, 6, 5, 6], [2, 3, 2, 3], [4, 6, 2, 3]),  # groups interleaved
])
@pytest.mark.parametrize("m, fixed_total", [(1, None), (4, 64)])
def test_edge_cases_match_the_reference(groups, prefix, lengths, m, fixed_total):
    seq_len = 6
    _check_against_reference(groups, prefix, lengths, seq_len, m, fixed_total, host_reads=True)
    if fixed_total is not None:
        _check_against_reference(groups, prefix, lengths, seq_len, m, fixed_total, host_reads=False)


def _check_against_reference(groups, prefix, lengths, seq_len, m, fixed_total, host_reads, window=3):
    x = rollouts(groups, prefix, lengths, seq_len, trailing=(2,))
    sp = shared_prefix_layout(torch.tensor(lengths, dtype=torch.int64), torch.tensor(prefix, dtype=torch.int64),
                              torch.tensor(groups, dtype=torch.int64), row_len=seq_len,
                              spec=PackSpec(m, fixed_total=fixed_total), input_ids=x, host_reads=host_reads)
    ref, positions, token, seg = reference(groups, prefix, lengths, x, m, fixed_total)
    packed = sp.pack(x)
    assert torch.equal(packed, ref.packed)
    assert torch.equal(sp.layout.cu_seqlens_padded, ref.cu_seqlens_padded)
    assert sp.positions().tolist() == positions and sp.segment_ids().tolist() == seg
    real = [v for v, t in zip(packed[0, :, 0].tolist(), token) if t is not None]
    expected = {int(v) for b, n in enumerate(lengths) for v in x[b, :n, 0].tolist()}  # prompts once
    assert len(real) == len(set(real)) and set(real) == expected  # each token exactly once
    want = torch.where((torch.arange(seq_len) < torch.tensor(lengths, dtype=torch.int64)[:, None])[..., None], x, 0)
    assert torch.equal(sp.unpack(packed), want.view(len(lengths), seq_len, 2))
    rule = sp.prefix_rule()
    q = torch.arange(sp.total)
    real_rows = torch.tensor([t is not None for t in token], dtype=torch.bool)
    for w in (None, window):
        got = document_causal_mask(q, sp.segment_ids(), w, rule)
        want = rollout_mask(groups, prefix, lengths, token, seg, w)
        assert torch.equal(got[real_rows], want[real_rows])
        assert got.diagonal().all()  # a padding query sees itself at least: a finite softmax
    return sp


@st.composite
def batches(draw):
    sizes = draw(st.lists(st.integers(1, 4), max_size=4))  # G per group
    groups, prefix, lengths = [], [], []
    seq_len = draw(st.integers(1, 7))
    for g, size in enumerate(sizes):
        p = draw(st.integers(0, seq_len))
        groups += [g] * size
        prefix += [p] * size
        lengths += [draw(st.integers(p, seq_len)) for _ in range(size)]
    order = draw(st.permutations(range(len(groups))))  # groups need not be contiguous
    return [groups[i] for i in order], [prefix[i] for i in order], [lengths[i] for i in order], seq_len


@settings(max_examples=examples(40), deadline=None)
@given(batch=batches(), m=st.sampled_from([1, 2, 4]), fixed=st.booleans(), host_reads=st.booleans())
def test_round_trips_and_the_rule_against_the_reference(batch, m, fixed, host_reads):
    groups, prefix, lengths, seq_len = batch
    fixed_total = 128 if fixed else None
    _check_against_reference(groups, prefix, lengths, seq_len, m, fixed_total, host_reads or not fixed)


def test_unpack_keeps_gradients_and_sums_a_shared_prompt():
    x = rollouts(**CASE, seq_len=4)
    sp = shared_prefix_layout(torch.tensor(CASE["lengths"]), torch.tensor(CASE["prefix"]),
                              torch.tensor(CASE["groups"]), row_len=4, spec=PackSpec(1))
    packed = torch.zeros(1, sp.total, dtype=torch.float64, requires_grad=True)
    sp.unpack(packed).sum().backward()
    assert packed.grad[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]  # the group of two reads the prompt twice


def test_shard_unshard_and_padding_mask_delegate_to_the_slot_layout():
    x = rollouts(**CASE, seq_len=4)
    sp = shared_prefix_layout(torch.tensor(CASE["lengths"]), torch.tensor(CASE["prefix"]),
                              torch.tensor(CASE["groups"]), row_len=4, spec=PackSpec(4, fixed_total=32))
    packed = sp.pack(x)
    shards = torch.cat([sp.shard(packed, 2, r) for r in range(2)])
    assert torch.equal(sp.unshard(shards, 2), packed)
    for r in range(2):
        assert torch.equal(sp.local_places(2, r).source, sp.layout.local_places(2, r).source)
        assert torch.equal(sp.padding_mask(2, r), sp.layout.padding_mask(2, r))


# ---- validation ----------------------------------------------------------------------------------

def _build(lengths, prefix, groups, x=None, **kw):
    kw.setdefault("spec", PackSpec(1, fixed_total=32))
    return shared_prefix_layout(torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups), row_len=4,
                                input_ids=x, **kw)


@pytest.mark.parametrize("prefix, groups, x, message", [
    ([5, 2], [0, 1], None, r"prefix_lengths\[0\] = 5 is outside \[0, seq_lengths\[0\]=4\]"),
    ([2, -1], [0, 1], None, r"prefix_lengths\[1\] = -1 is outside \[0, seq_lengths\[1\]=3\]"),
    ([2, 1], [0, 0], None, r"prefix_lengths\[1\] = 1 but rollout 0 of the same group \(group_ids\[1\] = "
                           r"group_ids\[0\] = 0\) has prefix_lengths\[0\] = 2"),
    ([2, 2], [4, 4], torch.tensor([[1, 2, 3, 4], [1, 9, 3, 0]]), r"input_ids\[1, :2\] differs from input_ids\[0, :2\]"),
])
def test_bad_prefixes_are_refused_naming_the_argument_and_value(prefix, groups, x, message):
    with HostSyncCounter() as syncs, pytest.raises(PackingError, match=message):
        _build([4, 3], prefix, groups, x)
    assert syncs.count == 1  # the one read, which is also the check
    with pytest.raises(RuntimeError, match="nn_data.shared_prefix_layout: "):
        _build([4, 3], prefix, groups, x, host_reads=False)  # a device assert


def test_metadata_is_refused_before_any_read():
    with pytest.raises(PackingError, match=r"prefix_lengths has 1 entries; expected 2 \(one per rollout"):
        _build([4, 3], [1], [0, 0])
    with pytest.raises(PackingError, match=r"group_ids must be a 1-D integer tensor, got shape \(2,\) and dtype "
                                           r"torch.float32"):
        shared_prefix_layout(torch.tensor([4, 3]), torch.tensor([1, 1]), torch.tensor([0.0, 1.0]), row_len=4,
                             spec=PackSpec(1))
    with pytest.raises(PackingError, match=r"input_ids has shape \(2, 5\); expected \[B, S, \*\] = \[2, 4, \*\]"):
        _build([4, 3], [1, 1], [0, 1], torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 5 is outside \[0, S=4\]"):
        _build([4, 5], [1, 1], [0, 1])
    with pytest.raises(PackingError, match=r"exceeds pad_full_seq_to=4"):
        _build([4, 3], [1, 1], [0, 1], spec=PackSpec(1, fixed_total=4))


def test_row_capacity_padding_rows_join_no_group():
    x = rollouts([0, 0, 0, 0], [2, 2, 0, 0], [4, 3, 0, 0], 4)
    sp = _build([4, 3, 0, 0], [2, 2, 0, 0], [0, 0, 0, 0], x, num_rows=torch.tensor(2))
    assert sp.layout.cu_seqlens_padded.tolist() == [0, 2, 4, 4, 32, 32, 32, 32, 32]
    assert torch.equal(sp.unpack(sp.pack(x), fill=-7), x)
    with pytest.raises(PackingError, match=r"seq_lengths\[2\] = 1 but row 2 is a padding row \(num_rows=2\)"):
        _build([4, 3, 1, 0], [2, 2, 0, 0], [0, 0, 1, 1], num_rows=torch.tensor(2))


def test_unpack_refuses_rows_shorter_than_a_rollout():
    sp = _build([4, 3], [1, 1], [0, 1])
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 4 is outside \[0, seq_len=3\]"):
        sp.unpack(torch.zeros(1, 32), seq_len=3)
    on_device = _build([4, 3], [1, 1], [0, 1], host_reads=False)
    with pytest.raises(RuntimeError, match=r"TreeLayout.unpack: seq_lengths must be in \[0, seq_len\]"):
        on_device.unpack(torch.zeros(1, 32), seq_len=3)
    assert on_device.unpack(torch.zeros(1, 32), seq_len=5).shape == (2, 5)


# ---- the masks -----------------------------------------------------------------------------------

def test_no_prefix_is_todays_rule_bit_for_bit():
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    q = torch.tensor([7, 0, 4, 2])
    keys = torch.arange(8)
    old = (seg[q][:, None] == seg[None, :]) & (keys[None, :] <= q[:, None])
    assert torch.equal(document_causal_mask(q, seg), old)
    assert torch.equal(document_causal_mask(q, seg, 2), old & (q[:, None] - keys[None, :] < 2))
    assert torch.equal(document_mask(q, seg, kind="dense", prefix=None).dense, old)


def test_document_mask_checks_the_rule_it_is_given():
    seg = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(PackingError, match=r"prefix.positions has shape \(3,\); expected \[4\]"):
        document_mask(torch.arange(4), seg, prefix=PrefixRule(seg, seg > 0, seg[:3], seg.view(2, 2)))
    with pytest.raises(PackingError, match=r"prefix.shared has shape \(4,\); expected \[B\+1, B\+1\]"):
        document_mask(torch.arange(4), seg, prefix=PrefixRule(seg, seg > 0, seg, seg))
    with pytest.raises(PackingError, match=r"prefix must be a PrefixRule"):
        document_mask(torch.arange(4), seg, prefix=(seg, seg, seg))


@needs_cpu_flex
def test_block_mask_equals_the_dense_one_where_flex_runs_on_the_cpu():
    from torch.nn.attention.flex_attention import create_mask

    groups, prefix, lengths = [0, 0, 0, 1, 1], [40, 40, 40, 9, 9], [70, 41, 90, 60, 9]
    sp = shared_prefix_layout(torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups), row_len=90,
                              spec=PackSpec(6, fixed_total=384))
    q, seg, rule = sp.local_places(3, 1).source, sp.segment_ids(), sp.prefix_rule()  # a CP rank's 128 queries
    with torch.no_grad():
        mask = document_mask(q, seg, kind="block", window=50, prefix=rule)
        dense = document_mask(q, seg, kind="dense", window=50, prefix=rule)
        for block, full in ((mask.block, dense.dense), (mask.sliding.block, dense.sliding.dense)):
            # the device named: without it a CUDA build of torch (2.11's, say) picks CUDA, driver or not
            assert torch.equal(create_mask(block.mask_mod, None, None, q.shape[0], sp.total, device=q.device)[0, 0],
                               full)
            blocks = full.view(1, 128, sp.total // 128, 128).any(3).any(1)  # [1, T/128]: a block with a True
            assert torch.equal(block.to_dense()[0, 0].bool(), blocks)  # the non-empty blocks


# ---- compiled: one graph over a stream, no sync --------------------------------------------------

B, S, T = 6, 12, 96
STREAM = [([0, 0, 0, 0, 0, 0], [5] * 6, [9, 12, 5, 7, 6, 11]),  # one group of 6
          ([0, 0, 1, 1, 2, 2], [3, 3, 0, 0, 12, 12], [4, 3, 8, 0, 12, 12]),
          ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], [12, 2, 3, 9, 5, 6]),  # six groups of one
          ([4, 4, 4, 9, 9, 9], [7, 7, 7, 2, 2, 2], [12, 8, 7, 2, 10, 3])]


def _step(x, lengths, prefix, groups):
    sp = shared_prefix_layout(lengths, prefix, groups, row_len=S, spec=PackSpec(4, fixed_total=T), input_ids=x)
    packed = sp.pack(x)
    rule = sp.prefix_rule()
    shards = torch.cat([sp.shard(packed, 2, r) for r in range(2)])
    return packed, sp.positions(), rule, sp.unpack(sp.unshard(shards, 2))


@pytest.fixture(scope="module")
def compiled_step():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    yield torch.compile(_step, fullgraph=True, backend=counter), counter
    torch._dynamo.reset()


def test_one_graph_and_no_sync_over_a_stream(compiled_step):
    compiled, counter = compiled_step
    for k, (groups, prefix, lengths) in enumerate(STREAM):
        x = rollouts(groups, prefix, lengths, S)
        args = (x, torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups))
        if k:
            with HostSyncCounter() as syncs:
                got = compiled(*args)
            assert syncs.count == 0, syncs.calls
        else:
            got = compiled(*args)
        want = _step(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
        assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
        ref, positions, _, _ = reference(groups, prefix, lengths, x, 4, T)
        assert torch.equal(got[0], ref.packed) and got[1].tolist() == positions
        assert torch.equal(got[3], torch.where(torch.arange(S) < args[1][:, None], x, 0))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(STREAM)} microbatches"


def test_compiled_checks_are_device_asserts(compiled_step):
    compiled, counter = compiled_step
    groups, prefix, lengths = STREAM[1]
    x = rollouts(groups, prefix, lengths, S)
    x[1, 0] += 1  # rollout 1's prompt differs from its leader's
    with pytest.raises(RuntimeError, match="must share their prompt tokens"):
        compiled(x, torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups))
    assert counter.frame_count == 1


def test_the_device_path_reads_nothing():
    """host_reads=False on ``meta`` tensors: any value-dependent op would fail, any read would count."""
    meta = dict(dtype=torch.int64, device="meta")
    lengths, prefix, groups = torch.zeros(B, **meta), torch.zeros(B, **meta), torch.zeros(B, **meta)
    x = torch.zeros(B, S, **meta)
    with HostSyncCounter() as syncs:
        sp = shared_prefix_layout(lengths, prefix, groups, row_len=S, spec=PackSpec(4, fixed_total=T), input_ids=x,
                                  host_reads=False)
        packed = sp.pack(x)
        sp.prefix_rule(), sp.positions()
        sp.unpack(sp.unshard(torch.cat([sp.shard(packed, 2, r) for r in range(2)]), 2))
    assert syncs.count == 0, syncs.calls
