"""Shared test helpers: batches whose every token carries a unique code."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(TransformerEngine|[Aa]pex).*")


def coded_batch(lengths, seq_len: int, trailing=(), dtype=torch.int64) -> torch.Tensor:
    """``[B, S, *trailing]`` with token ``(b, t)`` = ``1000*b + t + 1`` on valid tokens (times a
    distinct code per trailing element), and ``-7`` on padding, so a misplaced or
    dropped token shows in any comparison."""
    rows = len(lengths)
    b = torch.arange(rows).view(rows, 1)
    t = torch.arange(seq_len).view(1, seq_len)
    code = 1000 * b + t + 1  # [B, S]
    lens = torch.as_tensor(list(lengths), dtype=torch.int64).view(rows, 1)
    code = torch.where(t < lens, code, torch.full_like(code, -7))
    n_trailing = 1
    for d in trailing:
        n_trailing *= d
    extra = torch.arange(n_trailing).view(*trailing) if trailing else torch.tensor(0)
    out = code.view(rows, seq_len, *([1] * len(trailing))) * 100 + extra  # distinct per trailing element
    if dtype.is_floating_point:
        out = out.to(torch.float64) / 8.0  # exact in fp32 for the sizes the tests use
    return out.to(dtype)


def valid_mask(lengths, seq_len: int) -> torch.Tensor:
    """``[B, S]`` bool: True on each row's valid prefix."""
    lens = torch.as_tensor(list(lengths), dtype=torch.int64).view(-1, 1)
    return torch.arange(seq_len).view(1, -1) < lens


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
