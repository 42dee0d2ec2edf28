"""Coded batches: every valid token carries a unique code, so a misplaced, dropped or duplicated
token shows up in any comparison with a reference.

Shape legend: ``B`` sequences, ``S`` row length, ``*`` trailing dims.
"""

from __future__ import annotations

import math

import torch

from nn_data.errors import PackingError

PAD = -7  # default content of input padding: negative, so a pad that leaks past an op (whose own fill is 0) shows


def coded_batch(lengths, seq_len: int, trailing=(), dtype=torch.int64, *, pad: int = PAD) -> torch.Tensor:
    """A ``[B, S, *trailing]`` batch in which token ``(b, t)`` is coded ``1000*b + t + 1``.

    ``lengths``: B ints (or a ``[B]`` tensor), each at most ``seq_len``; positions ``t >= lengths[b]``
    hold ``pad``. With trailing dims, element ``i`` (row-major index over ``trailing``, at most 100
    of them) of a valid token holds ``100 * code + i``. Floating dtypes hold the integer value / 8
    (exact in float32 while the value is below 2**24, and not an integer, so a rounding shows).

    Raises PackingError if ``trailing`` has more than 100 elements (codes would collide).

    >>> coded_batch([2, 0], 3).tolist()
    [[1, 2, -7], [-7, -7, -7]]
    >>> coded_batch([1], 2, (2,)).tolist()
    [[[100, 101], [-7, -7]]]
    """
    n_trailing = math.prod(trailing)
    if n_trailing > 100:
        raise PackingError(f"trailing={tuple(trailing)} has {n_trailing} elements per token; at most 100 keep "
                           "the codes 100*code + i unique")
    code = 1000 * torch.arange(len(lengths)).view(-1, 1) + torch.arange(seq_len) + 1  # [B, S]
    if trailing:
        code = code.view(*code.shape, *([1] * len(trailing))) * 100 + torch.arange(n_trailing).view(trailing)
    valid = valid_mask(lengths, seq_len).view(len(lengths), seq_len, *([1] * len(trailing)))  # [B, S, 1...]
    out = torch.where(valid, code, torch.full_like(code, pad))  # [B, S, *trailing]
    if dtype.is_floating_point:
        out = out.to(torch.float64) / 8.0
    return out.to(dtype)


def valid_mask(lengths, seq_len: int) -> torch.Tensor:
    """``[B, S]`` bool: True on each row's valid prefix ``t < lengths[b]``.

    >>> valid_mask([2, 0], 3).tolist()
    [[True, True, False], [False, False, False]]
    """
    lens = torch.as_tensor(list(lengths), dtype=torch.int64).view(-1, 1)  # [B, 1]
    return torch.arange(seq_len).view(1, -1) < lens
