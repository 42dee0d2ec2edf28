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
