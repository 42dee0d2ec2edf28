"""Position ids and next-token targets on the packed layout, for the whole tensor or a CP shard.

Shape legend
    B   sequences; ``cu_seqlens`` and ``cu_seqlens_padded`` have B+1 entries
    T   packed tokens (``pad_full_seq_to`` under the static-shape contract)
    C   context-parallel size; the outputs hold rank ``r``'s ``T/C`` positions
        (``C = 1``: the whole packed tensor, ``T`` positions)
    L   ``L[b] = cu_seqlens[b+1] - cu_seqlens[b]``, the valid tokens of sequence ``b``

Both ops compute an index map on the device from the layout (:mod:`nn_data.layout`) and read the packed
tensor once; given the pack's ``layout=`` (or ``places=``) nothing is read on the host, given only the
boundaries they are read once eagerly (the validation)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data import _checks
from nn_data.layout import PackLayout
from nn_data.layout.internal import RankOp
from nn_data.layout.internal import Segments, ZigzagLocal, packed_segments


class PositionIds(RankOp):
    """Position ids of the packed layout, restarting at 0 at every sequence start: ``[1, T/C]`` int64.

    ``PositionIds(cp_size=1, cp_rank=0, *, validate=True, host_reads=True)``;
    ``forward(packed [1, T, *], cu_seqlens_padded [B+1] int = None, places=None, *, layout=None) -> [1, T/C]``.
    ``packed`` (any tensor of the packed microbatch) gives ``T`` and the device; with ``cp_size > 1`` the result is
    rank ``cp_rank``'s zigzag shard, aligned with :class:`~nn_data.ShardForContextParallel`. Padding continues
    counting inside its padded segment (its ids never reach a loss); with no sequence the ids are ``0..T-1``.

    Example: cu_seqlens_padded ``[0, 4, 4, 12]`` (C 1) -> ``[[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]``;
    C 2, rank 1 -> positions ``1, 2, 2..5`` of the segments -> ``[[1, 2, 2, 3, 4, 5]]``.

    Raises :class:`~nn_data.errors.PackingError`: bad ``cp_size``/``cp_rank`` (``__init__``); ``packed`` not
    ``[1, T, *]``, ``T`` not a multiple of ``2*cp_size``, bad boundary tensor (call); boundaries not rising from 0
    to ``T`` or segments not divisible by ``2*cp_size`` (validation)."""

    def __init__(self, cp_size: int = 1, cp_rank: int = 0, *, validate: bool = True, host_reads: bool = True):
        super().__init__(cp_size, cp_rank, validate=validate, host_reads=host_reads)

    def forward(self, packed: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor] = None,
                places: Optional[ZigzagLocal] = None, *, layout: Optional[PackLayout] = None) -> torch.Tensor:
        _checks.check_packed("packed", packed)
        layout = self.layout_for("packed", packed, packed.shape[1], cu_seqlens_padded, layout)
        bounds = layout.bounds()
        source, seg = places if places is not None else layout.local_places(self.cp_size, self.cp_rank)
        return (source - bounds[seg]).unsqueeze(0)  # [1, T/C]


class Targets(NamedTuple):
    """``targets [1, T/C]`` int64 (the next token, or ``ignore_index``) and
    ``loss_mask [1, T/C]`` float32 (1 where a target exists, else 0)."""

    targets: torch.Tensor
    loss_mask: torch.Tensor


def next_token_at(packed_ids: torch.Tensor, segments: Segments, places: ZigzagLocal, total: int):
    """``(token [N] int64, has_target [N] bool)`` for the positions in ``places``: position ``t`` at offset ``o`` of
    segment ``b`` has a target iff ``o + 1 < L[b]``, the token ``packed_ids[t + 1]`` (clamped into range
    everywhere: use it only where ``has_target``).

    Example: lengths ``[3, 5]``, bounds ``[0, 4, 12]``: positions ``0, 1`` and ``4..7`` have
    targets; ``2`` (last of sequence 0) does not, nor do ``3`` and ``8..11`` (padding)."""
    bounds, lengths = segments
    offset = places.source - bounds[places.segment]  # [N]
    has_target = offset + 1 < lengths[places.segment]  # [N]
    nxt = (places.source + 1).clamp(max=max(total - 1, 0))  # [N]
    return packed_ids.index_select(0, nxt).to(torch.int64), has_target


class NextTokenTargets(RankOp):
    """Next-token targets shifted *within* each sequence: ``[1, T] -> Targets([1, T/C] x 2)``.

    ``NextTokenTargets(cp_size=1, cp_rank=0, *, ignore_index=-100, validate=True, host_reads=True)``;
    ``forward(packed_ids [1, T] int, cu_seqlens [B+1] int = None, cu_seqlens_padded [B+1] int = None,
    places=None, *, layout=None)``. A sequence's last token has no target (never the next sequence's first);
    positions without a target (last tokens, padding, empty rows) get ``ignore_index`` and loss mask 0.
    ``packed_ids`` is the *full* packed microbatch on every rank; the outputs hold rank ``cp_rank``'s zigzag
    positions, aligned with ``ShardForContextParallel(cp_size, cp_rank)`` and the CP-local logits.

    Example (C 1): packed ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``, cu_seqlens ``[0, 3, 3, 8]``,
    cu_seqlens_padded ``[0, 4, 4, 12]`` -> targets ``[[2, 3, -100, -100, 5, 6, 7, 8, -100,
    -100, -100, -100]]``, loss mask ``[[1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]``.

    Raises :class:`~nn_data.errors.PackingError`: bad ``cp_size``/``cp_rank`` (``__init__``); ``packed_ids`` not
    ``[1, T]``, ``T`` not a multiple of ``2*cp_size``, boundary tensors not 1-D integer with equal lengths (call);
    bad boundaries or a length that does not fit its padded segment (validation)."""

    def __init__(self, cp_size: int = 1, cp_rank: int = 0, *, ignore_index: int = -100, validate: bool = True,
                 host_reads: bool = True):
        super().__init__(cp_size, cp_rank, validate=validate, host_reads=host_reads)
        self.ignore_index = int(ignore_index)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ignore_index={self.ignore_index}"

    def forward(
        self, packed_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        cu_seqlens_padded: Optional[torch.Tensor] = None, places: Optional[ZigzagLocal] = None, *,
        layout: Optional[PackLayout] = None,
    ) -> Targets:
        _checks.check_packed_ids("packed_ids", packed_ids)
        total = packed_ids.shape[1]
        if layout is None and cu_seqlens is None:
            raise _checks.PackingError("NextTokenTargets needs cu_seqlens and cu_seqlens_padded, or layout=")
        layout = self.layout_for("packed_ids", packed_ids, total, cu_seqlens_padded, layout, cu_seqlens=cu_seqlens)
        segments = packed_segments(layout.cu_seqlens, layout.cu_seqlens_padded, total)
        if places is None:
            places = layout.local_places(self.cp_size, self.cp_rank)
        token, has_target = next_token_at(packed_ids[0], segments, places, total)  # [T/C] each
        targets = torch.where(has_target, token, self.ignore_index)
        return Targets(targets.unsqueeze(0), has_target.to(torch.float32).unsqueeze(0))
