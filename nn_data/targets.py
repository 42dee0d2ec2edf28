"""Position ids and next-token targets on the packed layout, for the whole tensor or a CP shard.

Shape legend
    B   sequences; ``cu_seqlens`` and ``cu_seqlens_padded`` have B+1 entries
    T   packed tokens (``pad_full_seq_to`` under the static-shape contract)
    C   context-parallel size; the outputs hold rank ``r``'s ``T/C`` positions
        (``C = 1``: the whole packed tensor, ``T`` positions)
    L   ``L[b] = cu_seqlens[b+1] - cu_seqlens[b]``, the valid tokens of sequence ``b``

Both ops compute an index map on the device from the boundaries (segment ids via
scatter-add + cumsum, the zigzag map for ``C > 1``) and read the packed tensor
once: no host sync, every shape from ``T``, ``C`` and ``B``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data import _checks
from nn_data._index import ZigzagLocal, segment_ids, zigzag_local
from nn_data.context_parallel import RankOp, check_cp_boundaries


class Segments(NamedTuple):
    """``bounds [B'+1]`` (padded boundaries, int64) and ``lengths [B']`` (valid tokens, int64).

    ``B' = B``, except for a microbatch with no sequence (``B = 0``): then the whole
    packed tensor is one padding segment ``bounds [0, T]`` with ``lengths [0]``.
    """

    bounds: torch.Tensor
    lengths: torch.Tensor


def packed_segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, total: int) -> Segments:
    """The :class:`Segments` of a packed microbatch of ``total`` tokens."""
    if cu_seqlens_padded.shape[0] == 1:
        device = cu_seqlens_padded.device
        return Segments(torch.arange(2, dtype=torch.int64, device=device) * total,  # [0, T], built on the device
                        torch.zeros(1, dtype=torch.int64, device=device))
    cu = cu_seqlens.to(torch.int64)
    return Segments(cu_seqlens_padded.to(torch.int64), cu[1:] - cu[:-1])


def local_places(bounds: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> ZigzagLocal:
    """Packed position and segment of each position rank ``cp_rank`` holds: ``2 x [T/C]``.

    ``cp_size == 1``: every position, in order. Example: bounds ``[0, 4, 4, 12]``, C 1 ->
    source ``0..11``, segment ``[0,0,0,0,2,...,2]`` (segment 1 is empty).
    """
    if cp_size == 1:
        return ZigzagLocal(torch.arange(total, device=bounds.device), segment_ids(bounds, total))
    return zigzag_local(bounds, total // cp_size, cp_size, cp_rank)


def check_layout(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    total: int,
    cp_size: int,
    op: str,
    *,
    seq_len: Optional[int] = None,
    ids: Optional[torch.Tensor] = None,
    vocab: Optional[int] = None,
) -> None:
    """The validation step of the packed-layout ops: one host sync in eager mode, device asserts compiled.

    Checks: boundaries rise from 0 to ``total`` with segments divisible by ``2*cp_size``;
    ``0 <= L[b] <=`` its padded segment; with ``seq_len``, ``L[b] <= seq_len``; with ``ids [T]``
    and ``vocab``, every token that is some position's target is in ``[0, vocab)``.
    """
    bounds, lengths = packed_segments(cu_seqlens, cu_seqlens_padded, total)
    seg_len = bounds[1:] - bounds[:-1]  # [B']
    ok_edges = (bounds[0] == 0) & (bounds[-1] == total) & (seg_len >= 0).all()
    ok_div = (seg_len % (2 * cp_size) == 0).all()
    ok_len = ((lengths >= 0) & (lengths <= seg_len)).all()
    ok_seq = (lengths <= seq_len).all() if seq_len is not None else ok_len
    ok_ids = ok_len
    if ids is not None:
        places = local_places(bounds, total, 1, 0)
        is_target = places.source - bounds[places.segment] < lengths[places.segment]  # [T] valid tokens
        ok_ids = (~is_target | ((ids >= 0) & (ids < vocab))).all()
    if torch.compiler.is_compiling():
        _checks.device_assert(ok_edges & ok_div, f"nn_data.{op}: cu_seqlens_padded must rise from 0 to T "
                              f"in segments divisible by 2*cp_size={2 * cp_size}")
        _checks.device_assert(ok_len & ok_seq, f"nn_data.{op}: every length must fit its padded segment"
                              + (f" and seq_len={seq_len}" if seq_len is not None else ""))
        _checks.device_assert(ok_ids, f"nn_data.{op}: token ids must be in [0, vocab={vocab})")
        return
    flags = torch.stack([ok_edges & ok_div, ok_len, ok_seq, ok_ids]).tolist()  # sync: the one validation step
    if not flags[0]:
        check_cp_boundaries(cu_seqlens_padded, total, cp_size, op)  # raises with the precise message
    if not flags[1]:
        _checks.raise_first(~((lengths >= 0) & (lengths <= seg_len)), lengths,
                            "sequence {i} has length {v} (from cu_seqlens), which does not fit its padded segment "
                            "of cu_seqlens_padded; valid lengths are in [0, segment length]")
    if not flags[2]:
        _checks.raise_first(lengths > seq_len, lengths,
                            "sequence {i} has length {v} (from cu_seqlens), more than seq_len=" f"{seq_len}")
    if not flags[3]:
        bad = is_target & ((ids < 0) | (ids >= vocab))
        _checks.raise_first(bad, ids, "packed token id {v} at position {i} is outside the vocabulary "
                            f"[0, {vocab}) of the logits")


def _check_boundary_args(cu_seqlens_padded, data: torch.Tensor, cp_size: int, cu_seqlens=None) -> None:
    _checks.check_int_vector("cu_seqlens_padded", cu_seqlens_padded)
    if cu_seqlens is not None:
        _checks.check_int_vector("cu_seqlens", cu_seqlens, cu_seqlens_padded.shape[0])
    _checks.check_same_device(data=data, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    total = data.shape[1]
    if cp_size > 1 and total % (2 * cp_size):
        raise _checks.PackingError(
            f"the packed length T={total} is not a multiple of 2*cp_size={2 * cp_size}; "
            "choose pad_full_seq_to (or the padding multiples) so that T is one"
        )


class PositionIds(RankOp):
    """Position ids of the packed layout, restarting at 0 at every sequence start: ``[1, T/C]`` int64.

    ``PositionIds(cp_size=1, cp_rank=0, *, validate=True)``;
    ``forward(packed [1, T, *], cu_seqlens_padded [B+1] int) -> [1, T/C]``. ``packed`` (any
    tensor of the packed microbatch, e.g. the packed input ids) gives ``T`` and the device.
    With ``cp_size == 1`` the result covers the whole packed tensor; otherwise rank
    ``cp_rank``'s zigzag shard, in the order :class:`~nn_data.ShardForContextParallel`
    produces (so it lines up with the sharded input ids).

    Padding positions: the id is the offset inside the *padded* segment, so padding after
    a sequence continues counting (``L, L+1, ...``), and so does the tail that
    ``pad_full_seq_to`` adds to the last segment. With no sequence at all (``B = 0``) the
    ids are ``0..T-1``. Padding tokens are attention-isolated inside their segment and
    carry no target, so their ids never reach a loss.

    Example: cu_seqlens_padded ``[0, 4, 4, 12]`` (C 1) -> ``[[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]``;
    C 2, rank 1 -> positions ``1, 2, 2..5`` of the segments -> ``[[1, 2, 2, 3, 4, 5]]``.

    Raises :class:`~nn_data.errors.PackingError`: bad ``cp_size``/``cp_rank`` (``__init__``);
    ``packed`` not ``[1, T, *]``, ``T`` not a multiple of ``2*cp_size``, bad boundary tensor
    (call); boundaries not rising from 0 to ``T`` or segments not divisible by ``2*cp_size``
    (validation step).
    """

    def __init__(self, cp_size: int = 1, cp_rank: int = 0, *, validate: bool = True):
        super().__init__(cp_size, cp_rank, validate=validate)

    def forward(self, packed: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
        _checks.check_packed("packed", packed)
        _check_boundary_args(cu_seqlens_padded, packed, self.cp_size)
        total = packed.shape[1]
        if self.validate:
            check_cp_boundaries(cu_seqlens_padded, total, self.cp_size, "PositionIds")
        bounds = packed_segments(cu_seqlens_padded, cu_seqlens_padded, total).bounds
        source, seg = local_places(bounds, total, self.cp_size, self.cp_rank)  # [T/C] each
        return (source - bounds[seg]).unsqueeze(0)  # [1, T/C]


class Targets(NamedTuple):
    """``targets [1, T/C]`` int64 (the next token, or ``ignore_index``) and
    ``loss_mask [1, T/C]`` float32 (1 where a target exists, else 0)."""

    targets: torch.Tensor
    loss_mask: torch.Tensor


def next_token_at(packed_ids: torch.Tensor, segments: Segments, places: ZigzagLocal, total: int):
    """``(token [N] int64, has_target [N] bool)`` for the positions in ``places``.

    Position ``t`` at offset ``o`` in its segment ``b`` has a target iff ``o + 1 < L[b]``; the
    target is ``packed_ids[t + 1]``, which then lies in the same sequence. ``token`` holds
    ``packed_ids[t + 1]`` (clamped into range) everywhere: use it only where ``has_target``.

    Example: lengths ``[3, 5]``, bounds ``[0, 4, 12]``: positions ``0, 1`` and ``4..7`` have
    targets; ``2`` (last of sequence 0) does not, nor do ``3`` and ``8..11`` (padding).
    """
    bounds, lengths = segments
    offset = places.source - bounds[places.segment]  # [N]
    has_target = offset + 1 < lengths[places.segment]  # [N]
    nxt = (places.source + 1).clamp(max=max(total - 1, 0))  # [N]
    return packed_ids.index_select(0, nxt).to(torch.int64), has_target


class NextTokenTargets(RankOp):
    """Next-token targets shifted *within* each sequence: ``[1, T] -> Targets([1, T/C] x 2)``.

    ``NextTokenTargets(cp_size=1, cp_rank=0, *, ignore_index=-100, validate=True)``;
    ``forward(packed_ids [1, T] int, cu_seqlens [B+1] int, cu_seqlens_padded [B+1] int)``.
    The target of the token at offset ``o`` of sequence ``b`` is the token at ``o + 1`` of the
    same sequence. A sequence's last token has no target: it never gets the next
    sequence's first token (the label leak verl fixed in its PR 6564, from rolling the
    flat packed tensor). Positions without a target (each sequence's last token, every
    padding position, empty rows) get ``ignore_index`` and loss mask 0.

    ``packed_ids`` is the *full* packed microbatch on every rank (a shard's last token
    per chunk needs its neighbour from another chunk); the outputs hold rank ``cp_rank``'s
    zigzag positions, aligned with ``ShardForContextParallel(cp_size, cp_rank)`` of the
    packed ids and with the CP-local logits. ``cp_size == 1``: all ``T`` positions.

    Example (C 1): packed ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``, cu_seqlens ``[0, 3, 3, 8]``,
    cu_seqlens_padded ``[0, 4, 4, 12]`` -> targets ``[[2, 3, -100, -100, 5, 6, 7, 8, -100,
    -100, -100, -100]]``, loss mask ``[[1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]``.

    Raises :class:`~nn_data.errors.PackingError`: bad ``cp_size``/``cp_rank`` (``__init__``);
    ``packed_ids`` not ``[1, T]``, ``T`` not a multiple of ``2*cp_size``, boundary tensors
    not 1-D integer with equal lengths (call); bad boundaries or a length that does not
    fit its padded segment (validation step).
    """

    def __init__(self, cp_size: int = 1, cp_rank: int = 0, *, ignore_index: int = -100, validate: bool = True):
        super().__init__(cp_size, cp_rank, validate=validate)
        self.ignore_index = int(ignore_index)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ignore_index={self.ignore_index}"

    def forward(
        self, packed_ids: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor
    ) -> Targets:
        check_packed_ids("packed_ids", packed_ids)
        _check_boundary_args(cu_seqlens_padded, packed_ids, self.cp_size, cu_seqlens)
        total = packed_ids.shape[1]
        if self.validate:
            check_layout(cu_seqlens, cu_seqlens_padded, total, self.cp_size, "NextTokenTargets")
        segments = packed_segments(cu_seqlens, cu_seqlens_padded, total)
        places = local_places(segments.bounds, total, self.cp_size, self.cp_rank)
        token, has_target = next_token_at(packed_ids[0], segments, places, total)  # [T/C] each
        targets = torch.where(has_target, token, self.ignore_index)
        return Targets(targets.unsqueeze(0), has_target.to(torch.float32).unsqueeze(0))


def check_packed_ids(name: str, t) -> None:
    """Packed token ids are an integer ``[1, T]`` tensor."""
    _checks.check_packed(name, t)
    if t.dim() != 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise _checks.PackingError(f"{name} must be integer token ids [1, T], got shape {tuple(t.shape)} "
                                   f"and dtype {t.dtype}")
