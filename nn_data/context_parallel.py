"""Zigzag context-parallel sharding of the packed layout, and its exact inverse.

Shape legend
    B   sequences; ``cu_seqlens_padded`` has B+1 entries
    T   packed tokens
    C   context-parallel size; each rank holds ``T/C`` tokens
    *   trailing feature dims

Each padded segment (a multiple of ``2C`` long) is cut into ``2C`` equal chunks;
rank ``r`` keeps chunks ``r`` and ``2C-1-r`` in that order, segment after segment
(SPEC section 3; the same split as NeMo-RL's ``_get_tokens_on_this_cp_rank`` per
sequence and TransformerEngine's ``thd_get_partitioned_indices``). Both ops are one
gather over an index map built on the device from ``cu_seqlens_padded``.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from nn_data import _checks
from nn_data._index import zigzag_inverse, zigzag_source


def _bounds(cu_seqlens_padded: torch.Tensor, total: int) -> torch.Tensor:
    """Segment boundaries to shard by. With no sequence (``B = 0``, ``cu_seqlens_padded = [T]``)
    the whole packed tensor is one padding segment ``[0, T]``."""
    if cu_seqlens_padded.shape[0] == 1:  # built on the device: no host-to-device copy
        return torch.arange(2, dtype=torch.int64, device=cu_seqlens_padded.device) * total  # [0, T]
    return cu_seqlens_padded.to(torch.int64)


def check_cp_boundaries(cu_seqlens_padded: torch.Tensor, total: int, cp_size: int, op: str) -> None:
    """Validate ``cu_seqlens_padded`` for a zigzag split over ``cp_size`` ranks.

    Must start at 0, never decrease, end at ``total`` and (for ``cp_size > 1``) give
    every segment a length divisible by ``2 * cp_size`` (the extended last one too).
    Eager: one host sync and a message naming the first bad segment. Compiled:
    device-side asserts (no sync).
    """
    bounds = _bounds(cu_seqlens_padded, total)
    seg_len = bounds[1:] - bounds[:-1]  # [B]
    two_c = 2 * cp_size
    ok_edges = (bounds[0] == 0) & (bounds[-1] == total)
    ok_order = (seg_len >= 0).all()
    ok_div = (seg_len % two_c == 0).all() if cp_size > 1 else ok_order
    if torch.compiler.is_compiling():
        _checks.device_assert(ok_edges & ok_order,
                              f"nn_data.{op}: cu_seqlens_padded must rise from 0 to T (the packed length)")
        _checks.device_assert(ok_div, f"nn_data.{op}: every segment must be a multiple of 2*cp_size={two_c} long")
        return
    edges, order, div = torch.stack([ok_edges, ok_order, ok_div]).tolist()  # sync: the one validation step
    if not (edges and order):
        raise _checks.PackingError(
            f"cu_seqlens_padded={cu_seqlens_padded.tolist()} is invalid for a packed length T={total}; "  # sync: error path
            f"it must start at 0, never decrease and end at {total}"
        )
    if not div:
        _checks.raise_first(
            seg_len % two_c != 0, seg_len,
            "segment {i} of cu_seqlens_padded is {v} tokens long, not a multiple of "
            f"2*cp_size={two_c}; pad sequences to a multiple of {two_c} (pad_individual_seqs_to_multiple_of) "
            f"and choose pad_full_seq_to so the extended last segment is one too",
        )


class RankOp(nn.Module):
    """Base of the stateless ops configured with a CP size and rank (checked) and ``validate``."""

    def __init__(self, cp_size: int, cp_rank: int, *, validate: bool = True):
        super().__init__()
        _checks.check_cp(cp_size, cp_rank)
        self.cp_size, self.cp_rank, self.validate = cp_size, cp_rank, bool(validate)

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, validate={self.validate}"


class ShardForContextParallel(RankOp):
    """This rank's zigzag shard of a packed tensor: ``[1, T, *] -> [1, T/C, *]``.

    ``ShardForContextParallel(cp_size, cp_rank, *, validate=True)``;
    ``forward(packed [1, T, *], cu_seqlens_padded [B+1] int) -> [1, T/C, *]``.
    With ``cp_size == 1`` it returns ``packed`` itself (no copy).

    Example (C=2, rank 0): two sequences padded to 16 and 24 (``cu_seqlens_padded
    [0, 16, 40]``) -> chunks of 4 and 6 -> packed positions ``0..3, 12..15, 16..21, 34..39``.

    Raises :class:`~nn_data.errors.PackingError`: ``cp_size < 1`` or ``cp_rank``
    outside ``[0, cp_size)`` (``__init__``); ``packed`` not ``[1, T, *]``, ``T`` not a
    multiple of ``2 * cp_size``, ``cu_seqlens_padded`` not 1-D integer, another device
    (call); a segment not divisible by ``2 * cp_size`` or boundaries that do not rise
    from 0 to ``T`` (validation step; eager one sync, compiled device asserts).
    """

    def forward(self, packed: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
        _checks.check_packed("packed", packed)
        total = packed.shape[1]
        _check_common(cu_seqlens_padded, total, self.cp_size, packed)
        if self.validate:
            check_cp_boundaries(cu_seqlens_padded, total, self.cp_size, "ShardForContextParallel")
        if self.cp_size == 1:
            return packed
        local_total = total // self.cp_size
        bounds = _bounds(cu_seqlens_padded, total)
        source = zigzag_source(bounds, local_total, self.cp_size, self.cp_rank).clamp(0, max(total - 1, 0))
        return packed.index_select(1, source)  # [1, T/C, *]


class UnshardFromContextParallel(nn.Module):
    """Reassemble the packed tensor from all ranks' shards: ``[C, T/C, *] -> [1, T, *]``.

    ``UnshardFromContextParallel(cp_size, *, validate=True)``;
    ``forward(shards [C, T/C, *], cu_seqlens_padded [B+1] int) -> [1, T, *]``, where
    ``shards[r]`` is rank ``r``'s shard (the rank-major stack an all-gather gives).
    The exact inverse of :class:`ShardForContextParallel` over all ranks.

    Example (C=2): ``cu_seqlens_padded [0, 8]``, shards ``[[0,1,6,7], [2,3,4,5]]`` ->
    ``[[0,1,2,3,4,5,6,7]]``.

    Raises :class:`~nn_data.errors.PackingError` as :class:`ShardForContextParallel`,
    and when ``shards`` does not have ``cp_size`` rows.
    """

    def __init__(self, cp_size: int, *, validate: bool = True):
        super().__init__()
        _checks.check_cp(cp_size)
        self.cp_size, self.validate = cp_size, bool(validate)

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, validate={self.validate}"

    def forward(self, shards: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
        _checks.check_min_dims("shards", shards, 2, "[C, T/C, *]")
        if shards.shape[0] != self.cp_size:
            raise _checks.PackingError(
                f"shards has shape {tuple(shards.shape)}; expected [C, T/C, *] with C = cp_size = {self.cp_size}"
            )
        total = self.cp_size * shards.shape[1]
        _check_common(cu_seqlens_padded, total, self.cp_size, shards)
        if self.validate:
            check_cp_boundaries(cu_seqlens_padded, total, self.cp_size, "UnshardFromContextParallel")
        if self.cp_size == 1:
            return shards
        bounds = _bounds(cu_seqlens_padded, total)
        index = zigzag_inverse(bounds, total, self.cp_size).clamp(0, max(total - 1, 0))  # [T] into the stack
        stacked = rearrange(shards, "c t ... -> (c t) ...")  # [C*T/C, *]
        return stacked.index_select(0, index).unsqueeze(0)  # [1, T, *]


def _check_common(cu_seqlens_padded, total: int, cp_size: int, data: torch.Tensor) -> None:
    _checks.check_int_vector("cu_seqlens_padded", cu_seqlens_padded)
    _checks.check_same_device(data=data, cu_seqlens_padded=cu_seqlens_padded)
    if cp_size > 1 and total % (2 * cp_size):
        raise _checks.PackingError(
            f"the packed length T={int(total)} is not a multiple of 2*cp_size={2 * cp_size}; "
            f"choose pad_full_seq_to (or the padding multiples) so that T is one"
        )

