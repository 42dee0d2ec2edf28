"""The layout rules, each written once (``docs/design.md``, "Packed layout", "Zigzag", "Row capacity").

Shape legend
    B   rows of the batch (R with row-capacity padding); ``L[b]`` their lengths
    m   the per-sequence multiple; p the packed multiple (without a fixed packed length)
    T   the packed length
    C   context-parallel size; r a rank

Every rule takes Python ints (the host executor's) and integer tensors (the device executor's) alike, so the
two executors cannot disagree."""

from __future__ import annotations

from typing import Optional, Union

import torch


#: A padding value: a scalar, or a tensor broadcastable to a packed tensor's trailing dims.
Fill = Union[int, float, bool, torch.Tensor]

#: The largest packed length, and so the largest boundary, int32 ``cu_seqlens`` can hold (the dtype
#: megatron-core and TransformerEngine read the boundaries in).
INT32_MAX = 2**31 - 1


def round_up(x, multiple: int):
    """``x`` rounded up to a multiple of ``multiple`` (>= 1): an int, an integer tensor or a numpy array.

    Example: ``round_up(tensor([3, 0, 5]), 4) -> tensor([4, 0, 8])``; ``round_up(13, 8) -> 16``.
    """
    return (x + (multiple - 1)) // multiple * multiple


def round_up_all(values: list, multiple: int) -> list:
    """:func:`round_up` of every int of a list (a host layout's per-row lengths), in one loop (no nested
    frame). Example: ``round_up_all([3, 0, 5], 4) -> [4, 0, 8]``."""
    out = []
    for v in values:
        out.append((v + (multiple - 1)) // multiple * multiple)
    return out


def packed_total(natural, p: int, fixed_total: Optional[int] = None):
    """``T``: the fixed packed length when one is set, else the natural total ``sum(round_up(L, m))``
    rounded up to ``p``. Example: natural 20, p 8 -> 24; with ``fixed_total=40`` -> 40."""
    return fixed_total if fixed_total is not None else round_up(natural, p)


def first_final(rows: int, num_rows=None):
    """Index of the first boundary that becomes ``T`` under "extend last": the end of the last real row
    (``num_rows``: None, an int or a 0-d tensor; else all ``B`` rows), at least 1 when there is a row, so that
    padding rows collapse onto ``T``.

    Example: rows 4, num_rows 3 -> 3: ``[0, 4, 4, 12, 12] -> [0, 4, 4, T, T]``; num_rows 0 -> 1."""
    if num_rows is None:
        return rows
    if isinstance(num_rows, torch.Tensor):
        return num_rows.to(torch.int64).clamp(min(1, rows), rows)
    return max(min(1, rows), min(num_rows, rows))


def extend_last(cu_pad, total, first):
    """The slack rule: every boundary from index ``first`` (:func:`first_final`) on becomes ``T``.

    Example: ``[0, 4, 4, 12]``, T 16, first 3 -> ``[0, 4, 4, 16]`` (the last segment is 12 long);
    with a padding row, ``[0, 4, 4, 12, 12]``, first 3 -> ``[0, 4, 4, 16, 16]``.
    """
    if isinstance(cu_pad, list):
        return cu_pad[:first] + [total] * (len(cu_pad) - first)
    idx = torch.arange(cu_pad.shape[0], device=cu_pad.device)
    return torch.where(idx >= first, total, cu_pad)


def segment_bounds(cu_seqlens_padded, total):
    """The boundaries to index segments by: ``cu_seqlens_padded`` itself, except with no sequence
    (``B = 0``: ``[T]`` as NeMo-RL returns it), where the packed tensor is one padding pseudo-segment
    ``[0, T]``. A list of ints, or an int64 tensor built on the device (no host data).

    Example: ``[0, 4, 4, 12]`` -> the same; ``[16]`` -> ``[0, 16]``.
    """
    if isinstance(cu_seqlens_padded, list):
        return [0, total] if len(cu_seqlens_padded) == 1 else cu_seqlens_padded
    if cu_seqlens_padded.shape[0] == 1:
        return torch.arange(2, dtype=torch.int64, device=cu_seqlens_padded.device) * total  # [0, T]
    return cu_seqlens_padded.to(torch.int64)


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks of every segment rank ``r`` holds: ``(r, 2C-1-r)``, in that order; each segment
    (a multiple of ``2C`` long) is cut into ``2C`` chunks of ``n / (2C)``. Example: C 2 -> rank 0
    holds ``(0, 3)``, rank 1 ``(1, 2)``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_pieces(start, n, cp_size: int, cp_rank: int):
    """Where a padded segment ``[start, start + n)`` puts its tokens on rank ``r``: ``(k, local, packed)``, the chunk
    length ``k = n / (2C)`` and the starts of its two chunks ``r`` and ``2C-1-r`` on the rank (``local``, from
    ``start / C`` on) and in the packed tensor (``packed``). Ints or integer tensors alike: the one statement of
    the zigzag shard that the host views, the host scan and the device map all follow.

    Example: start 16, n 24, C 2, rank 0 -> k 6, local ``(8, 14)``, packed ``(16, 34)``: the rank's
    positions 8..13 hold packed 16..21 and 14..19 hold packed 34..39."""
    first, second = zigzag_chunks(cp_size, cp_rank)
    k = n // (2 * cp_size)
    local = start // cp_size
    return k, (local, local + k), (start + first * k, start + second * k)


def chunk_owner(chunk: Union[int, torch.Tensor], cp_size: int):
    """The rank that holds chunk ``c`` of a segment: ``min(c, 2C-1-c)`` (the inverse of
    :func:`zigzag_chunks`). Example: C 2, chunks ``0, 1, 2, 3`` -> ranks ``0, 1, 1, 0``."""
    if isinstance(chunk, torch.Tensor):
        return torch.minimum(chunk, 2 * cp_size - 1 - chunk)
    return min(chunk, 2 * cp_size - 1 - chunk)
