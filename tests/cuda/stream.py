"""The GPU tier's workload: a stream of microbatches that vary in lengths, row counts and (where
asked) row length S, the sizes per run kind, and the data path the tests compile.

Shape legend
    B   real rows of a microbatch (varies, 0..R); R the row capacity every graph sees
    S   padded row length; T packed tokens (``pad_full_seq_to``); C context-parallel size
    H   features per token of the model stand-in's output

Run kinds: on a CUDA GPU the ``FULL`` sizes; with ``NN_DATA_CUDA_DRY_RUN=1`` (set by
``scripts/gpu_check.sh --dry-run``; tests/conftest.py then keeps the ``cuda`` tests) the same
tests on the CPU with the ``TINY`` sizes, where the CUDA-only assertions (CUDA-graph counts)
skip with a reason starting "dry run:".
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch
from torch import nn

from nn_data import PackSequences, ShardForContextParallel, UnpackSequences, UnshardFromContextParallel
from nn_data.unpack import unpack_sequences

DRY_RUN = os.environ.get("NN_DATA_CUDA_DRY_RUN") == "1"
ON_CUDA = torch.cuda.is_available() and not DRY_RUN
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# Every GPU-tier module: ``pytestmark = TIER`` (tests/conftest.py skips ``cuda`` tests without
# CUDA, unless NN_DATA_CUDA_DRY_RUN=1).
TIER = [pytest.mark.cuda, pytest.mark.compile]
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]  # dry run: fewer compiles


class Sizes(NamedTuple):
    rows: int  # R, the row capacity
    seq_len: int  # S of the fixed-S streams
    multiple: int  # m = pad_individual_seqs_to_multiple_of (a multiple of 2C)
    cp: int  # C
    hidden: int  # H
    microbatches: int
    seq_lens: tuple  # the S values of the varying-S streams (cycled)

    @property
    def total(self) -> int:
        """T = pad_full_seq_to: room for R rows of the longest S (rounded up to m)."""
        longest = max(self.seq_len, *self.seq_lens)
        return self.rows * (-(-longest // self.multiple) * self.multiple)


FULL = Sizes(rows=64, seq_len=1024, multiple=8, cp=2, hidden=64, microbatches=32,
             seq_lens=(256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1536, 1792, 2048))
TINY = Sizes(rows=6, seq_len=24, multiple=4, cp=2, hidden=4, microbatches=32, seq_lens=(8, 16, 24))
SIZES = FULL if ON_CUDA else TINY

def cuda_only(what: str) -> None:
    """Skip the rest of a test in the CPU dry run: ``what`` needs a CUDA device."""
    if not ON_CUDA:
        pytest.skip(f"dry run: {what} needs CUDA")


class Microbatch(NamedTuple):
    x: torch.Tensor  # [B, S] int64: a unique code per valid token, 0 on padding
    lengths: torch.Tensor  # [B] int64


def make_stream(sizes: Sizes, *, vary_seq_len: bool, seed: int = 0, device=DEVICE, min_rows: int = 0) -> list:
    """``sizes.microbatches`` microbatches with ``min_rows``..R rows and lengths 0..S, built on ``device``
    before any timed or sync-checked pass. Token ``(b, t)`` holds ``S_max * b + t + 1``."""
    gen = torch.Generator().manual_seed(seed)
    code_row = max(sizes.seq_len, *sizes.seq_lens)
    stream = []
    for i in range(sizes.microbatches):
        seq_len = sizes.seq_lens[i % len(sizes.seq_lens)] if vary_seq_len else sizes.seq_len
        rows = int(torch.randint(min_rows, sizes.rows + 1, (1,), generator=gen))
        rows = sizes.rows if i == 1 else rows  # a full microbatch early in every stream
        lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen)
        t = torch.arange(seq_len)
        x = code_row * torch.arange(rows)[:, None] + t + 1  # [B, S]
        x = torch.where(t < lengths[:, None], x, 0)
        stream.append(Microbatch(x.to(device), lengths.to(device)))
    return stream


class Scale(nn.Module):
    """Model stand-in: ``ids [..] -> ids * w + pos [.., H]`` in ``dtype`` (elementwise, so any
    layout of the same tokens gives bitwise the same values)."""

    def __init__(self, hidden: int, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(hidden, generator=gen).to(dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor, positions=None) -> torch.Tensor:
        out = ids.unsqueeze(-1).to(self.w.dtype) * self.w
        if positions is not None:
            out = out + positions.unsqueeze(-1).to(self.w.dtype)
        return out


def expected_rows(model: Scale, mb: Microbatch, rows: int, positions: bool = False) -> torch.Tensor:
    """The oracle ``[R, S, H]``: the model applied to each valid token in place, 0 elsewhere,
    zero rows past the real ones."""
    seq_len = mb.x.shape[1]
    t = torch.arange(seq_len, device=mb.x.device)
    pos = t.expand_as(mb.x) if positions else None
    out = model(mb.x, pos) * (t < mb.lengths[:, None]).unsqueeze(-1)  # [B, S, H]
    full = out.new_zeros((rows, seq_len, out.shape[-1]))
    full[: out.shape[0]] = out
    return full


class DataPath(nn.Module):
    """The core ops as two compiled pieces around an eager model, on one process playing all
    ``C`` CP ranks: ``prepare`` = pack -> shard for every rank; ``finish`` = unshard of the
    ranks' stacked outputs (what an all-gather delivers) -> unpack. ``seq_len=None``: the row
    length is read from ``x.shape[1]`` in ``finish`` (the varying-S streams)."""

    def __init__(self, sizes: Sizes, seq_len=None):
        super().__init__()
        self.pack = PackSequences(sizes.multiple, pad_full_seq_to=sizes.total)
        self.shards = nn.ModuleList(ShardForContextParallel(sizes.cp, r) for r in range(sizes.cp))
        self.unshard = UnshardFromContextParallel(sizes.cp)
        self.unpack = UnpackSequences(seq_len) if seq_len is not None else None

    def prepare(self, x, lengths, num_rows):
        """``x [R, S]`` -> ``(packed [1, T], shards [C, T/C], cu_seqlens_padded [R+1])``."""
        r = self.pack(x, lengths, num_rows)
        shards = torch.cat([shard(r.packed, r.cu_seqlens_padded) for shard in self.shards])  # [C, T/C]
        return r.packed, shards, r.cu_seqlens_padded

    def finish(self, outs, lengths, cu_seqlens_padded, x):
        """Every rank's output ``[C, T/C, H]`` -> rows ``[R, S, H]`` (``S = x.shape[1]``)."""
        full = self.unshard(outs, cu_seqlens_padded)  # [1, T, H]
        if self.unpack is None:
            return unpack_sequences(full, lengths, cu_seqlens_padded, x.shape[1])
        return self.unpack(full, lengths, cu_seqlens_padded)
