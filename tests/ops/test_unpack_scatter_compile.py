"""Tier: pure CPU, single process (one inductor compile).

UnpackSequences' scatter form (an output that is mostly fill, B*S >= 4T) compiled: equal to the
loop reference and to eager on a stream with row padding, one graph for the whole stream.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nn_data.layout.device
from nn_data import PackSequences, UnpackSequences, pad_to_row_capacity
from nn_data.testing.reference import reference_unpack

pytestmark = pytest.mark.compile

R, S, M, T = 8, 24, 4, 40  # R*S = 192 >= 4T: the scatter form


def test_compiled_scatter_unpack_matches_reference_and_compiles_once():
    assert R * S >= nn_data.layout.device.UNPACK_SCATTER_MIN_RATIO * T
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    unpack = UnpackSequences(S)
    compiled = torch.compile(unpack, fullgraph=True, backend=counter)
    pack = PackSequences(M, pad_full_seq_to=T)
    gen = torch.Generator().manual_seed(3)
    for rows in (5, 1, 8, 0, 3):
        lengths = torch.randint(0, 9, (rows,), generator=gen)
        while int((-(-lengths // M) * M).sum()) > T:  # halve until the rows fit T (host-side set-up)
            lengths = lengths // 2
        padded = pad_to_row_capacity(torch.zeros(rows, S, dtype=torch.int64), lengths, R)
        cu_pad = pack(padded.x, padded.seq_lengths, padded.num_rows).cu_seqlens_padded
        out = torch.randn(1, T, 3, generator=gen)  # [1, T, 3] model output
        got = compiled(out, padded.seq_lengths, cu_pad)
        want = reference_unpack(out, padded.seq_lengths.tolist(), cu_pad.tolist(), S)
        assert torch.equal(got, want)
        assert torch.equal(unpack(out, padded.seq_lengths, cu_pad), want)  # eager: the host executor
        assert torch.equal(UnpackSequences(S, host_reads=False)(out, padded.seq_lengths, cu_pad), want)  # scatter
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_unpacking_the_packs_own_layout_reads_its_gather_map_back():
    """A pack in the gather form (B*S > 16T) hands its map to the unpack of its own layout: the same rows come back,
    eagerly on the device path and compiled in one graph, with one segment scan fewer than from boundaries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows, seq_len, total = 8, 96, 40
    assert rows * seq_len > nn_data.layout.device.SCATTER_MAX_RATIO * total
    pack, unpack = PackSequences(M, pad_full_seq_to=total, host_reads=False), UnpackSequences(seq_len)

    def round_trip(x, lengths, num_rows):
        r = pack(x, lengths, num_rows)
        return unpack(r.packed.unsqueeze(-1) * 2, layout=r.layout), r.cu_seqlens_padded  # [B, S, 1]

    class Scans(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Scans.count += func is torch.ops.aten.cumsum.default
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(round_trip, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(5)
    for real in (5, 8, 0, 2):
        lengths = torch.randint(0, 5, (real,), generator=gen)  # round_up(L, 4) <= 4: 8 rows fit T
        x = torch.randint(1, 100, (real, seq_len), generator=gen)
        padded = pad_to_row_capacity(x, lengths, rows)
        want = torch.where(torch.arange(seq_len) < padded.seq_lengths[:, None], padded.x * 2, 0).unsqueeze(-1)
        with Scans():
            got, cu_pad = round_trip(padded.x, padded.seq_lengths, padded.num_rows)
        assert torch.equal(got, want)
        assert torch.equal(unpack(padded.x.new_zeros(1, total, 1), padded.seq_lengths, cu_pad), want * 0)
        assert torch.equal(compiled(padded.x, padded.seq_lengths, padded.num_rows)[0], want)
    assert Scans.count == 4 * 3  # per round trip: two boundary sums and the pack's segment scan, none in the unpack
    assert counter.frame_count == 1
    torch._dynamo.reset()
