"""Tier: pure CPU, single process, torch.compile(fullgraph=True). The stream runs through inductor
(one module-scoped compile); the error cases use the eager / aot_eager backends.

The compile contract of the core ops: one graph for a stream whatever varies (lengths,
row counts under a row capacity, the row length ``S``, ``S = 0`` and ``1`` included), compiled ==
eager on every returned field, errors that keep their message when a user compiles an op directly,
data errors as device asserts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.exc import Unsupported
from torch._dynamo.testing import CompileCounterWithBackend

from tests.support.hypothesis_profiles import examples
from nn_data import (
    PackingError,
    PackSequences,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_rows,
    pad_to_row_capacity,
)
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.rows import with_dynamic_row_length
from nn_data.testing.coded import coded_batch

R, M, C, T = 8, 4, 2, 256  # row capacity, multiple, cp size, pad_full_seq_to (8 rows x 24 tokens fit)
# 15 distinct row lengths (0 and 1 included, 1 and 0 again at the end), row counts 0..R.
STREAM = [(5, 8), (0, 0), (1, 3), (7, 5), (9, 1), (11, 8), (13, 2), (2, 7), (3, 4), (4, 6), (6, 8), (8, 1),
          (10, 2), (12, 3), (24, 8), (17, 0), (1, 5), (0, 6)]


class Chain(torch.nn.Module):
    """pack (validate=True) -> routed experts on the layout -> shard on every rank -> unshard -> unpack
    to the batch's own row length ``x.shape[1]``."""

    def __init__(self):
        super().__init__()
        self.pack = PackSequences(M, pad_full_seq_to=T)
        self.shards = torch.nn.ModuleList(ShardForContextParallel(C, r) for r in range(C))
        self.unshard = UnshardFromContextParallel(C)
        self.unpack = UnpackSequences(0)

    def forward(self, x, experts, lengths, num_rows):
        r = self.pack(x, lengths, num_rows)
        packed_experts = r.layout.pack(experts, fill=torch.arange(experts.shape[-1], device=x.device))
        local = torch.cat([shard(r.packed, r.cu_seqlens_padded) for shard in self.shards])  # [C, T/C]
        restored = self.unshard(local, r.cu_seqlens_padded)
        return r, packed_experts, local, self.unpack(restored, lengths, r.cu_seqlens_padded, seq_len=x.shape[1])


@pytest.fixture(scope="module")
def chain():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    module = Chain()
    yield module, torch.compile(module, fullgraph=True, backend=counter), counter
    torch._dynamo.reset()


def _inputs(gen, seq_len, rows):
    lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen)
    x = coded_batch(lengths.tolist(), seq_len)
    padded = pad_to_row_capacity(x, lengths, R)
    experts = pad_rows(coded_batch(lengths.tolist(), seq_len, (2, 3)), R)
    args = (with_dynamic_row_length(padded.x), with_dynamic_row_length(experts), padded.seq_lengths, padded.num_rows)
    return x, lengths, args


def _assert_same(got, want):
    """Every returned field. The layout may take its other form in the graph (a symbolic S takes the
    gather form, a static one may scatter), so it is compared by what it does, not by its tensors."""
    (rg, eg, lg, ug), (rw, ew, lw, uw) = got, want
    for name in ("packed", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        a, b = getattr(rg, name), getattr(rw, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (rg.layout.total, rg.layout.rows, rg.layout.row_len) == (rw.layout.total, rw.layout.rows, rw.layout.row_len)
    assert torch.equal(rg.layout.cu_seqlens_padded, rw.layout.cu_seqlens_padded)
    assert torch.equal(rg.layout.segment_ids(), rw.layout.segment_ids())
    assert torch.equal(rg.layout.positions(), rw.layout.positions())
    for a, b in ((eg, ew), (lg, lw), (ug, uw)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_one_graph_for_a_stream_of_row_lengths_and_row_counts(chain):
    module, compiled, counter = chain
    gen = torch.Generator().manual_seed(0)
    assert len({s for s, _ in STREAM}) >= 12 and {b for _, b in STREAM} == set(range(R + 1))
    for seq_len, rows in STREAM:
        x, lengths, args = _inputs(gen, seq_len, rows)
        got = compiled(*args)
        _assert_same(got, module(*args))
        ref = reference_pack(x, lengths, M, 1, T)
        assert torch.equal(got[0].packed, ref.packed)
        for rank in range(C):
            assert torch.equal(got[2][rank : rank + 1], reference_shard(ref.packed, ref.cu_seqlens_padded, C, rank))
        assert got[3].shape == (R, seq_len)
        assert torch.equal(got[3][:rows], torch.where(torch.arange(seq_len) < lengths[:, None], x, 0))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(STREAM)} microbatches"


@settings(max_examples=examples(30), deadline=None)
@given(seq_len=st.integers(0, 24), rows=st.integers(0, R), seed=st.integers(0, 2**31 - 1))
def test_compiled_equals_eager_on_generated_cases(chain, seq_len, rows, seed):
    module, compiled, counter = chain
    _, _, args = _inputs(torch.Generator().manual_seed(seed), seq_len, rows)
    _assert_same(compiled(*args), module(*args))
    assert counter.frame_count == 1


def test_data_errors_stay_device_asserts(chain):
    """Compiled: ``torch._assert_async`` (a RuntimeError naming the argument and the valid range),
    no recompile. Eager: PackingError with the value."""
    module, compiled, counter = chain
    _, _, args = _inputs(torch.Generator().manual_seed(1), 6, 3)
    bad = args[2].clone()
    bad[1] = 7  # > S = 6
    with pytest.raises(RuntimeError, match=r"every seq_lengths value must be in \[0, S\] \(S = x.shape\[1\]"):
        compiled(args[0], args[1], bad, args[3])
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 7 is outside \[0, S=6\]"):
        module(args[0], args[1], bad, args[3])
    assert counter.frame_count == 1


def test_pack_with_validation_does_not_specialise_on_the_row_length():
    """``PackSequences(validate=True)`` and a tensor packed along its layout, compiled alone: the
    device-assert messages name ``S`` without formatting its value (which would add an ``Eq(S, n)``
    guard: one graph per ``S``, and a failure at the 9th), so one graph serves the stream."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    pack = PackSequences(M, pad_full_seq_to=T)

    def fn(x, experts, lengths, num_rows):
        r = pack(x, lengths, num_rows)
        return r.packed, r.cu_seqlens, r.cu_seqlens_padded, r.max_seqlen, r.layout.pack(experts)

    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(3)
    for seq_len, rows in STREAM:
        _, _, args = _inputs(gen, seq_len, rows)
        for a, b in zip(compiled(*args), fn(*args)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def _observed(fn, *args, **kwargs) -> str:
    """What a user sees when the op is compiled with ``fullgraph=True`` and raises while traced:
    torch 2.13 turns the exception into ``Unsupported: Observed exception`` and keeps its text."""
    with pytest.raises(Unsupported) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("case", ["x-1d", "lengths-float", "lengths-count", "device", "experts-S"])
def test_errors_of_an_op_the_user_compiles_keep_their_message(case):
    torch._dynamo.reset()
    pack = PackSequences(M, pad_full_seq_to=T)
    x, lengths = coded_batch([3, 0, 5], 6), torch.tensor([3, 0, 5])
    if case == "experts-S":
        def fn(x, experts, lengths):
            return pack(x, lengths).layout.pack(experts)

        experts = torch.zeros(3, 5, 2)
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        text = _observed(compiled, x, experts, lengths)  # static sizes: the eager message, values included
        assert "x has shape (3, 5, 2); the layout was built for [B, S] = [3, 6], so x must be [3, 6, *]" in text
        # Unbacked row lengths cannot be compared while tracing: a device assert names what is valid.
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        with pytest.raises(RuntimeError, match=r"x must be \[B, S, \*\] with the layout's S"):
            compiled(with_dynamic_row_length(x), with_dynamic_row_length(experts), lengths)
        return
    compiled = torch.compile(pack, fullgraph=True, backend="eager")
    bad = {
        "x-1d": ((x[0], lengths), "x must have at least 2 dims [B, S, *], got shape (6,)"),
        "lengths-float": ((x, lengths.float()), "seq_lengths must be a 1-D integer tensor, got shape (3,) and dtype torch.float32"),
        "lengths-count": ((x, lengths[:2]), "seq_lengths has 2 entries; expected 3"),
        "device": ((x, lengths.to("meta")), "tensors must be on one device, got x on cpu, seq_lengths on meta"),
    }
    args, message = bad[case]
    with pytest.raises(PackingError) as eager:
        pack(*args)
    assert str(eager.value) == message
    assert message in _observed(compiled, *args)
    torch._dynamo.reset()


def test_unpack_compiled_alone_serves_every_row_length():
    """``UnpackSequences`` with ``seq_len`` from a tensor size: one graph for S = 0, 1, ..., with
    validation on (its messages name ``seq_len`` without formatting the symbolic size)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    unpack = UnpackSequences(0)
    compiled = torch.compile(lambda p, l, c, like: unpack(p, l, c, seq_len=like.shape[1]), fullgraph=True,
                             backend=counter)
    gen = torch.Generator().manual_seed(2)
    for seq_len in (6, 0, 1, 3, 9, 2, 12, 4, 5, 7, 8, 10, 1, 0):
        lengths = torch.randint(0, seq_len + 1, (R,), generator=gen)
        x = coded_batch(lengths.tolist(), seq_len)
        r = PackSequences(M, pad_full_seq_to=T)(x, lengths)
        like = with_dynamic_row_length(x)
        got = compiled(r.packed, lengths, r.cu_seqlens_padded, like)
        assert torch.equal(got, unpack(r.packed, lengths, r.cu_seqlens_padded, seq_len=seq_len))
        assert torch.equal(got, torch.where(torch.arange(seq_len) < lengths[:, None], x, 0))
    assert counter.frame_count == 1
    torch._dynamo.reset()
