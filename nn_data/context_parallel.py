"""Zigzag context-parallel sharding of the packed layout, and its exact inverse.

Shape legend
    B   sequences; ``cu_seqlens_padded`` has B+1 entries
    T   packed tokens
    C   context-parallel size; each rank holds ``T/C`` tokens
    *   trailing feature dims

Each padded segment is cut into ``2C`` equal chunks; rank ``r`` keeps chunks ``r`` and ``2C-1-r``, segment
after segment (``docs/design.md``, "Zigzag"). Both ops run on the layout: given ``layout=`` they read nothing,
given only ``cu_seqlens_padded`` they read it once eagerly (the validation)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import PackLayout
from nn_data.layout.internal import RankOp, op_layout


class ShardForContextParallel(RankOp):
    """This rank's zigzag shard of a packed tensor: ``[1, T, *] -> [1, T/C, *]``.

    ``ShardForContextParallel(cp_size, cp_rank, *, validate=True, host_reads=True)``;
    ``forward(packed [1, T, *], cu_seqlens_padded [B+1] int = None, *, layout=None) -> [1, T/C, *]``.
    With ``cp_size == 1`` it returns ``packed`` itself (no copy).

    Example (C=2, rank 0): two sequences padded to 16 and 24 (``cu_seqlens_padded
    [0, 16, 40]``) -> chunks of 4 and 6 -> packed positions ``0..3, 12..15, 16..21, 34..39``.

    Raises :class:`~nn_data.errors.PackingError`: ``cp_size < 1`` or ``cp_rank`` outside ``[0, cp_size)``
    (``__init__``); ``packed`` not ``[1, T, *]``, ``T`` not a multiple of ``2 * cp_size``, ``cu_seqlens_padded``
    not 1-D integer, another device (call); a segment not divisible by ``2 * cp_size`` or boundaries that do not
    rise from 0 to ``T`` (validation)."""

    def forward(self, packed: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor] = None, *,
                layout: Optional[PackLayout] = None) -> torch.Tensor:
        _checks.check_packed("packed", packed)
        layout = self.layout_for("packed", packed, packed.shape[1], cu_seqlens_padded, layout)
        return layout.shard(packed, self.cp_size, self.cp_rank)  # [1, T/C, *]


class UnshardFromContextParallel(nn.Module):
    """Reassemble the packed tensor from all ranks' shards: ``[C, T/C, *] -> [1, T, *]``, the exact inverse of
    :class:`ShardForContextParallel` over all ranks.

    ``UnshardFromContextParallel(cp_size, *, validate=True, host_reads=True)``; ``forward(shards [C, T/C, *],
    cu_seqlens_padded [B+1] int = None, *, layout=None) -> [1, T, *]``, ``shards[r]`` rank ``r``'s shard.

    Example (C=2): ``cu_seqlens_padded [0, 8]``, shards ``[[0,1,6,7], [2,3,4,5]]`` ->
    ``[[0,1,2,3,4,5,6,7]]``.

    Raises :class:`~nn_data.errors.PackingError` as :class:`ShardForContextParallel`, and when ``shards`` does not
    have ``cp_size`` rows."""

    def __init__(self, cp_size: int, *, validate: bool = True, host_reads: bool = True):
        super().__init__()
        _checks.check_cp(cp_size)
        self.cp_size, self.validate, self.host_reads = cp_size, bool(validate), bool(host_reads)

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, validate={self.validate}, host_reads={self.host_reads}"

    def forward(self, shards: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor] = None, *,
                layout: Optional[PackLayout] = None) -> torch.Tensor:
        _checks.check_min_dims("shards", shards, 2, "[C, T/C, *]")
        if shards.shape[0] != self.cp_size:
            raise _checks.PackingError(
                f"shards has shape {tuple(shards.shape)}; expected [C, T/C, *] with C = cp_size = {self.cp_size}"
            )
        total = self.cp_size * shards.shape[1]
        layout = op_layout("UnshardFromContextParallel", "shards", shards, total, self.cp_size, cu_seqlens_padded,
                           layout, validate=self.validate, host_reads=self.host_reads)
        return layout.unshard(shards, self.cp_size)  # [1, T, *]
