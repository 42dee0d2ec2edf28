"""Tier: pure CPU, single process, torch.compile with the inductor backend (compiled modules are
shared per module to keep the cold-compile cost to a few graphs).

The ops under torch.compile(fullgraph=True): captured whole, compiled once per shape key,
compiled == eager exactly, no host syncs on the static path, device-side asserts for bad data.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend

from tests.support.hypothesis_profiles import examples
from nn_data import (
    NextTokenTargets,
    PackSequences,
    PositionIds,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_rows,
    pad_to_row_capacity,
)
from nn_data.diagnostics import HostSyncCounter
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.testing.coded import coded_batch

R, S, M, C, T = 8, 24, 4, 2, 200  # capacity, row length, multiple, cp size, pad_full_seq_to


class Chain(torch.nn.Module):
    """pack -> shard on every rank -> unshard -> unpack, plus routed experts on the same layout."""

    def __init__(self):
        super().__init__()
        self.pack = PackSequences(M, pad_full_seq_to=T)
        self.shards = torch.nn.ModuleList(ShardForContextParallel(C, r) for r in range(C))
        self.unshard = UnshardFromContextParallel(C)
        self.unpack = UnpackSequences(S)

    def forward(self, x, experts, lengths, num_rows):
        r = self.pack(x, lengths, num_rows)
        packed_experts = r.layout.pack(experts, fill=torch.arange(experts.shape[-1], device=x.device))
        local = torch.cat([shard(r.packed, r.cu_seqlens_padded) for shard in self.shards])  # [C, T/C]
        restored = self.unshard(local, r.cu_seqlens_padded)
        return r, packed_experts, local, self.unpack(restored, lengths, r.cu_seqlens_padded)


@pytest.fixture(scope="module")
def compiled_chain():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    chain = Chain()
    yield chain, torch.compile(chain, fullgraph=True, backend=counter), counter
    torch._dynamo.reset()


def _microbatch(gen: torch.Generator, rows: int):
    lengths = torch.randint(0, S + 1, (rows,), generator=gen)
    x = coded_batch(lengths.tolist(), S)
    experts = coded_batch(lengths.tolist(), S, (2, 3))
    padded = pad_to_row_capacity(x, lengths, R)
    return x, lengths, padded, pad_rows(experts, R)


def _assert_same(a, b):
    ra, ea, la, ua = a
    rb, eb, lb, ub = b
    for name in ("packed", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        assert torch.equal(getattr(ra, name), getattr(rb, name)), name
    # The plan's internal form differs (compiled: device index maps; eager: the host's ints): compare
    # what it packs, its segment ids and positions (docs/compile-contract.md, "Eager == compiled").
    assert ra.layout.host is None and rb.layout.host is not None
    assert ra.layout.total == rb.layout.total and ra.layout.rows == rb.layout.rows
    assert torch.equal(ra.layout.segment_ids(), rb.layout.segment_ids())
    assert torch.equal(ra.layout.positions(), rb.layout.positions())
    assert torch.equal(ea, eb) and torch.equal(la, lb) and torch.equal(ua, ub)


@pytest.mark.compile
def test_stream_of_microbatches_compiles_once(compiled_chain):
    chain, compiled, counter = compiled_chain
    gen = torch.Generator().manual_seed(1)
    row_counts = [8, 3, 0, 1, 5, 8, 2, 7, 4, 6, 1, 8, 3, 5, 2, 7, 6, 4, 8, 1, 0, 5, 3, 8]
    for rows in row_counts:
        x, lengths, padded, experts = _microbatch(gen, rows)
        got = compiled(padded.x, experts, padded.seq_lengths, padded.num_rows)
        _assert_same(got, chain(padded.x, experts, padded.seq_lengths, padded.num_rows))
        ref = reference_pack(x, lengths, M, 1, T)
        assert torch.equal(got[0].packed, ref.packed)
        if rows:
            assert torch.equal(got[0].cu_seqlens_padded[: rows + 1], ref.cu_seqlens_padded)
        for rank in range(C):
            assert torch.equal(got[2][rank : rank + 1], reference_shard(ref.packed, ref.cu_seqlens_padded, C, rank))
        assert torch.equal(got[3][:rows], torch.where(torch.arange(S) < lengths[:, None], x, 0))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for {len(row_counts)} microbatches"


@pytest.mark.compile
@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(0, R), seed=st.integers(0, 2**31 - 1))
def test_compiled_equals_eager_on_random_microbatches(compiled_chain, rows, seed):
    chain, compiled, counter = compiled_chain
    _, _, padded, experts = _microbatch(torch.Generator().manual_seed(seed), rows)
    args = (padded.x, experts, padded.seq_lengths, padded.num_rows)
    _assert_same(compiled(*args), chain(*args))
    assert counter.frame_count == 1


@pytest.mark.compile
def test_compiled_device_asserts_refuse_bad_data(compiled_chain):
    _, compiled, counter = compiled_chain
    x = torch.ones(R, S, dtype=torch.int64)
    experts = torch.ones(R, S, 2, 3, dtype=torch.int64)
    too_long = torch.full((R,), S)  # 8 * 24 = 192 fits in 200; make it not fit:
    with pytest.raises(RuntimeError, match=r"seq_lengths value must be in \[0, S\] \(S = x.shape\[1\]"):
        compiled(x, experts, torch.tensor([-1, 0, 0, 0, 0, 0, 0, 0]), torch.tensor(R))
    with pytest.raises(RuntimeError, match=r"rows at or past num_rows must have length 0"):
        compiled(x, experts, too_long, torch.tensor(3))
    assert counter.frame_count == 1
    big = PackSequences(M, pad_full_seq_to=188)
    compiled_big = torch.compile(big, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"exceeds pad_full_seq_to=188"):
        compiled_big(x, too_long)
    overflow = torch.compile(PackSequences(pad_packed_seq_to_multiple_of=2**31), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"the packed total of seq_lengths exceeds 2147483647 \(2\*\*31 - 1\)"):
        overflow(x, too_long)  # T learned from the data: the int32 limit is a device assert


@pytest.mark.compile
def test_default_constructed_ops_compile_without_breaks():
    """``torch.compile(op, fullgraph=True)`` on ops as constructed with default arguments."""
    torch._dynamo.reset()
    pack_counter, unpack_counter = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")
    pack = torch.compile(PackSequences(), fullgraph=True, backend=pack_counter)  # T is data-dependent here
    unpack = torch.compile(UnpackSequences(6), fullgraph=True, backend=unpack_counter)
    for lengths in ([2, 6, 1], [0, 0, 0], [6, 6, 6], [1, 0, 3]):
        lengths = torch.tensor(lengths)
        x = coded_batch(lengths.tolist(), 6)
        got, want = pack(x, lengths), PackSequences()(x, lengths)
        assert torch.equal(got.packed, want.packed) and torch.equal(got.cu_seqlens_padded, want.cu_seqlens_padded)
        assert torch.equal(unpack(got.packed, lengths, got.cu_seqlens_padded), torch.where(x > 0, x, 0))
    assert pack_counter.frame_count == 1  # the data-dependent T stays symbolic (unbacked)
    # unpack sees packed inputs of a new length T: dynamo specialises on the first T, then
    # marks it dynamic (the usual automatic-dynamic recompile), then no more.
    assert unpack_counter.frame_count == 2
    torch._dynamo.reset()


@pytest.mark.compile
def test_captured_graph_has_no_host_sync():
    """``fullgraph=True`` alone does not prove an op sync-free (scalar capture is on): read the graph."""
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    _, _, padded, experts = _microbatch(torch.Generator().manual_seed(3), 5)
    torch.compile(Chain(), fullgraph=True, backend=backend)(padded.x, experts, padded.seq_lengths, padded.num_rows)
    code = "\n".join(g.code for g in backend.fw_graphs)
    for forbidden in ("_local_scalar_dense", "nonzero", "item(", "masked_select"):
        assert forbidden not in code, forbidden
    assert "nn_data.device_check" in code  # the validation became device-side checks (no sync)
    torch._dynamo.reset()


def test_static_path_runs_on_meta_tensors():
    """Meta tensors have no values: any value-dependent op in the static path would fail here."""
    x = torch.empty(R, S, dtype=torch.int64, device="meta")
    lengths = torch.empty(R, dtype=torch.int64, device="meta")
    num_rows = torch.empty((), dtype=torch.int64, device="meta")
    r = PackSequences(M, pad_full_seq_to=T, validate=False, host_reads=False)(x, lengths, num_rows)
    assert r.packed.shape == (1, T) and r.cu_seqlens_padded.shape == (R + 1,)
    local = ShardForContextParallel(C, 1, validate=False, host_reads=False)(r.packed, r.cu_seqlens_padded)
    assert local.shape == (1, T // C)
    restored = UnshardFromContextParallel(C, validate=False, host_reads=False)(local.expand(C, -1), r.cu_seqlens_padded)
    assert restored.shape == (1, T)
    out = UnpackSequences(S, validate=False, host_reads=False)(restored, lengths, r.cu_seqlens_padded)
    assert out.shape == (R, S)


@pytest.mark.parametrize("host_reads, expected", [(False, 0), (True, 1)])
def test_eager_sync_count(host_reads, expected):
    """Eagerly an op given boundaries reads them once on the host executor (its validation), never on the
    device executor (``host_reads=False``); ``validate`` plays no part in the count."""
    x, lengths, padded, _ = _microbatch(torch.Generator().manual_seed(4), 6)
    pack = PackSequences(M, pad_full_seq_to=T, host_reads=host_reads)
    shard = ShardForContextParallel(C, 0, host_reads=host_reads)
    unpack = UnpackSequences(S, host_reads=host_reads)
    for op in ("pack", "shard", "unpack"):
        with HostSyncCounter() as syncs:
            r = pack(padded.x, padded.seq_lengths, padded.num_rows)
        if op == "shard":
            with HostSyncCounter() as syncs:
                shard(r.packed, r.cu_seqlens_padded)
        elif op == "unpack":
            with HostSyncCounter() as syncs:
                unpack(r.packed, padded.seq_lengths, r.cu_seqlens_padded)
        assert syncs.count == expected, (op, syncs.count)
    with HostSyncCounter() as syncs:  # without pad_full_seq_to: T and the checks share one sync
        PackSequences(M, host_reads=host_reads)(x, lengths)
    assert syncs.count == 1


def test_the_eager_chain_on_the_travelling_layout_costs_one_sync():
    """pack -> shard on every rank -> unshard -> unpack (and positions, targets) with ``layout=``: the
    pack's read of the lengths is the microbatch's one sync; nothing later reads the device."""
    x, lengths, padded, _ = _microbatch(torch.Generator().manual_seed(5), 6)
    with HostSyncCounter() as syncs:
        r = PackSequences(M, pad_full_seq_to=T)(padded.x, padded.seq_lengths, padded.num_rows)
        shards = [ShardForContextParallel(C, k)(r.packed, layout=r.layout) for k in range(C)]
        restored = UnshardFromContextParallel(C)(torch.cat(shards), layout=r.layout)
        out = UnpackSequences(S)(restored, layout=r.layout)
        PositionIds(C, 1)(r.packed, layout=r.layout)
        NextTokenTargets(C, 1)(r.packed, layout=r.layout)
    assert syncs.count == 1, syncs.calls
    assert torch.equal(out[:6], torch.where(torch.arange(S) < lengths[:, None], x, 0)) and not out[6:].any()


def test_host_reads_false_validates_on_the_device_without_a_sync():
    x, lengths, padded, _ = _microbatch(torch.Generator().manual_seed(6), 5)
    ops = dict(pack=PackSequences(M, pad_full_seq_to=T, host_reads=False),
               shard=ShardForContextParallel(C, 0, host_reads=False),
               unshard=UnshardFromContextParallel(C, host_reads=False), unpack=UnpackSequences(S, host_reads=False))
    with HostSyncCounter() as syncs:
        r = ops["pack"](padded.x, padded.seq_lengths, padded.num_rows)
        local = ops["shard"](r.packed, r.cu_seqlens_padded)
        restored = ops["unshard"](local.expand(C, -1), r.cu_seqlens_padded)
        out = ops["unpack"](r.packed, padded.seq_lengths, r.cu_seqlens_padded)
    assert syncs.count == 0, syncs.calls
    assert r.layout.host is None and restored.shape == (1, T)
    assert torch.equal(out[:5], torch.where(torch.arange(S) < lengths[:, None], x, 0))
    with pytest.raises(RuntimeError, match=r"every seq_lengths value must be in \[0, S\]"):
        ops["pack"](padded.x, padded.seq_lengths.clone().fill_(S + 1), padded.num_rows)  # a device assert
    with pytest.raises(RuntimeError, match=r"cu_seqlens_padded must start at 0, never decrease and end at T"):
        ops["unpack"](r.packed, padded.seq_lengths, r.cu_seqlens_padded.clamp(max=T - 8))


@pytest.mark.compile
def test_shard_and_unshard_compile_alone_once_per_stream():
    """Each CP op compiled on its own (as constructed, ``fullgraph=True``): one graph for a stream."""
    torch._dynamo.reset()
    counters = [CompileCounterWithBackend("aot_eager") for _ in range(3)]
    shard = torch.compile(ShardForContextParallel(C, 1), fullgraph=True, backend=counters[0])
    unshard = torch.compile(UnshardFromContextParallel(C), fullgraph=True, backend=counters[1])
    unpack = torch.compile(UnpackSequences(S), fullgraph=True, backend=counters[2])
    gen = torch.Generator().manual_seed(7)
    for rows in (8, 2, 5, 0, 8, 1):
        x, lengths, padded, _ = _microbatch(gen, rows)
        r = PackSequences(M, pad_full_seq_to=T)(padded.x, padded.seq_lengths, padded.num_rows)
        local = [ShardForContextParallel(C, k)(r.packed, r.cu_seqlens_padded) for k in range(C)]
        assert torch.equal(shard(r.packed, r.cu_seqlens_padded), local[1])
        assert torch.equal(unshard(torch.cat(local), r.cu_seqlens_padded), r.packed)
        out = unpack(r.packed, padded.seq_lengths, r.cu_seqlens_padded)
        assert torch.equal(out[:rows], torch.where(torch.arange(S) < lengths[:, None], x, 0))
    assert [c.frame_count for c in counters] == [1, 1, 1]
    torch._dynamo.reset()


def test_a_host_layout_entering_a_compiled_region_runs_on_the_device_executor(monkeypatch):
    """The executor is chosen once, where a travelling host layout enters the traced region (an op's
    ``layout=`` door, or the layout's own method): no host executor method runs while tracing, and the
    compiled moves equal the eager ones. (Dynamo's eager backend: what is traced is the point here.)"""
    from nn_data.layout import host

    traced = []
    for name in ("pack", "shard", "unshard", "unpack"):
        real = getattr(host.HostExecutor, name)

        def recording(self, *args, _real=real, _name=name, **kwargs):
            traced.append((_name, torch.compiler.is_compiling()))
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(host.HostExecutor, name, recording)
    lengths = torch.tensor([5, 0, 24, 13])
    x = coded_batch(lengths, S)
    r = PackSequences(M, pad_full_seq_to=T)(x, lengths)
    assert isinstance(r.layout.executor, host.HostExecutor)
    shard, unpack = ShardForContextParallel(C, 1), UnpackSequences(S)

    def moves(packed, layout):
        local = shard(packed, layout=layout)  # [1, T/C]: the op's door
        return local, layout.shard(packed, C, 1), unpack(packed, layout=layout), layout.pack(x)  # the methods

    eager = moves(r.packed, r.layout)
    traced.clear()
    torch._dynamo.reset()
    compiled = torch.compile(moves, backend="eager", fullgraph=True)(r.packed, r.layout)
    assert [t for t in traced if t[1]] == []
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    torch._dynamo.reset()
