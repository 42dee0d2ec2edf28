"""The device executor's building blocks: integer index maps computed from the boundaries.

Shape legend
    B   sequences (rows); the boundary tensors have B+1 entries
    T   packed tokens (positions of the packed tensor)
    C   context-parallel size; a rank holds T/C positions
    n   a segment's padded length, cu_seqlens_padded[b+1] - cu_seqlens_padded[b]
    k   a zigzag chunk's length, n / (2C)

Pure tensor arithmetic on the device: no host read, no boolean-mask indexing, no data-dependent branch, every
shape from a Python int the caller passes. The rules the maps encode are :mod:`nn_data.layout.rules`'."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data.layout.rules import chunk_owner, segment_bounds, zigzag_pieces


def exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lengths)]`` as int64, ``[B] -> [B+1]``, written into ``zeros[1:]`` (inductor has mis-compiled
    the ``F.pad`` form in some fused graphs).

    Example: ``[3, 0, 5] -> [0, 3, 3, 8]``."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    out[1:] = torch.cumsum(lengths.to(torch.int64), dim=0)
    return out


def segment_ids(bounds: torch.Tensor, total: int) -> torch.Tensor:
    """Segment id of every position ``t`` in ``[0, total)``: ``[B+1] -> [total]`` int64, the number of interior
    boundaries ``bounds[1:B]`` that are ``<= t`` (a scatter-add of ones and one cumsum; boundaries clamped into
    ``[0, total]`` so the ids stay in range even for invalid input).

    Example: ``bounds [0, 4, 4, 12], total 12``: interior boundaries ``4, 4`` mark position 4 twice -> ``marks
    [0,0,0,0,2,0,...]`` -> cumsum -> ids ``[0,0,0,0,2,2,2,2,2,2,2,2]`` (segment 1 is empty)."""
    num_segments = bounds.shape[0] - 1
    marks = torch.zeros(total + 1, dtype=torch.int64, device=bounds.device)
    interior = bounds[1:num_segments].to(torch.int64).clamp(0, total)  # [B-1]
    marks.scatter_add_(0, interior, torch.ones_like(interior))
    return torch.cumsum(marks[:total], dim=0)


def piece_source(out_starts: torch.Tensor, src_starts: torch.Tensor, total: int, ends: Optional[torch.Tensor] = None):
    """Source index of every output position when the output is a run of contiguous pieces: piece ``g`` covers output
    ``[out_starts[g], out_starts[g+1])`` (the last to ``total``) and reads source ``src_starts[g], src_starts[g]+1,
    ...``; ``[G], [G] -> [total]`` int64. One scan of ``A = src_starts[g] - out_starts[g]`` of the piece each
    position falls in (its jump from the previous piece's ``A`` scattered at the piece's start, so empty pieces
    telescope), then ``source = t + A``. With ``ends [G]`` (``out_starts[g] <= ends[g] <=`` the next start: where
    each piece's tokens end) it returns ``(source, valid)``: the scan then carries ``2*A + inside``, each piece adding
    one at its start and taking it back at its end, and ``valid = scan & 1``.

    Example: out_starts ``[0, 2, 2, 5]``, src_starts ``[10, 0, 7, 3]``, total 6 -> A ``[10, -2, 5, -2]``, jumps
    ``[10, -12, 7, -7]`` at positions ``0, 2, 2, 5`` -> scan ``[10, 10, 5, 5, 5, -2]`` -> ``[10, 11, 7, 8, 9, 3]``
    (piece 1 is empty); with ends ``[1, 2, 4, 6]``, valid ``[T, F, T, T, F, T]``."""
    out_starts = out_starts.to(torch.int64)
    jump = src_starts.to(torch.int64) - out_starts  # [G]: A of each piece
    prev = torch.zeros_like(jump)
    prev[1:] = jump[:-1]
    marks = torch.zeros(total + 1, dtype=torch.int64, device=out_starts.device)  # [T+1]; T: past the end
    at = out_starts.clamp(0, total)  # [G]
    t = torch.arange(total, device=out_starts.device)  # [T]
    if ends is None:
        marks.scatter_add_(0, at, jump - prev)
        return t + torch.cumsum(marks[:total], dim=0)
    marks.scatter_add_(0, torch.cat([at, ends.clamp(0, total)]),  # [2G]
                       torch.cat([2 * (jump - prev) + 1, torch.full_like(ends, -1)]))
    scan = torch.cumsum(marks[:total], dim=0)  # [T]: 2*A + inside
    return t + (scan >> 1), (scan & 1) == 1


def token_source(bounds: torch.Tensor, lengths: torch.Tensor, row_len, total: int,
                 shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed position, the flat row position ``b*S + s`` it belongs to and whether it holds a token: ``[B+1],
    [B] -> 2 x [T]`` (int64, bool). Row ``b``'s tokens are the packed positions ``[bounds[b], bounds[b] + min(L[b], S)
    - shift)`` (cut at ``bounds[b+1]``), and position ``bounds[b] + s`` belongs to ``s + shift`` of the row
    (``shift=1``: the log-prob layout). Callers clamp ``source`` where ``valid`` is False. A :func:`piece_source`
    scan, one piece per row: every use of the maps is arithmetic on one scanned buffer, never a lookup of a
    segment's start or length.

    Example: lengths ``[3, 0, 5]``, S 5, bounds ``[0, 4, 4, 12]`` -> pieces from ``0, 4, 4`` reading ``0, 5, 10``,
    tokens ending at ``3, 4, 9`` -> source ``[0,1,2,3,10,11,12,13,14,15,16,17]``, valid
    ``[T,T,T,F,T,T,T,T,T,F,F,F]``."""
    b64 = bounds.to(torch.int64)
    starts = b64[:-1]  # [B]
    tokens = (lengths.to(torch.int64).clamp(max=row_len) - shift).clamp(min=0)  # [B]
    ends = torch.maximum(torch.minimum(starts + tokens, b64[1:]), starts)  # [B]: where each row's tokens end
    rows_src = torch.arange(starts.shape[0], device=b64.device) * row_len + shift  # [B]: b*S + shift
    return piece_source(starts, rows_src, total, ends)


class ZigzagLocal(NamedTuple):
    """Rank ``r``'s local positions: ``source [T/C]`` (the packed position each holds)
    and ``segment [T/C]`` (the sequence it belongs to), both int64."""

    source: torch.Tensor
    segment: torch.Tensor


class Segments(NamedTuple):
    """``bounds [B'+1]`` (padded boundaries, int64) and ``lengths [B']`` (valid tokens, int64); ``B' = B``, except for
    no sequence (``cu_seqlens_padded = [T]``): one padding segment, ``bounds [0, T]``, ``lengths [0]``."""

    bounds: torch.Tensor
    lengths: torch.Tensor


def packed_segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, total: int) -> Segments:
    """The :class:`Segments` of a packed microbatch of ``total`` tokens.

    Example: cu_seqlens ``[0, 3, 3, 8]``, cu_seqlens_padded ``[0, 4, 4, 12]`` -> bounds
    ``[0, 4, 4, 12]``, lengths ``[3, 0, 5]``; ``B = 0`` (``[T]``, ``[0]``) -> ``[0, T]``, ``[0]``.
    """
    bounds = segment_bounds(cu_seqlens_padded, total)
    if cu_seqlens_padded.shape[0] == 1:
        return Segments(bounds, torch.zeros(1, dtype=torch.int64, device=bounds.device))
    cu = cu_seqlens.to(torch.int64)
    return Segments(bounds, cu[1:] - cu[:-1])


def padding_at(segments: Segments, places: ZigzagLocal) -> torch.Tensor:
    """``[N]`` bool: True where a position of ``places`` holds padding (its offset in its segment is
    ``>= L[segment]``: a segment's slack, the extended last segment's tail, every position of an empty
    row's or of the ``B = 0`` pseudo-segment). One gather of the per-segment end of the valid tokens.

    Example: bounds ``[0, 4, 4, 12]``, lengths ``[3, 0, 5]`` -> valid ends ``[3, 4, 9]``; C 1 ->
    ``[F,F,F,T, F,F,F,F,F,T,T,T]``; C 2, rank 0 (positions ``0, 3, 4, 5, 10, 11``) -> ``[F,T, F,F,T,T]``.
    """
    bounds, lengths = segments
    valid_end = bounds[:-1] + lengths  # [B'] packed position where each segment's padding starts
    return places.source >= valid_end[places.segment]  # [N]


def local_places(bounds: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> ZigzagLocal:
    """Packed position and segment of each position rank ``cp_rank`` holds: ``[B+1] -> 2 x [T/C]``. Example:
    ``cp_size == 1``, bounds ``[0, 4, 4, 12]`` -> source ``0..11``, segment ``[0,0,0,0,2,...,2]``."""
    if cp_size == 1:
        return ZigzagLocal(torch.arange(total, device=bounds.device), segment_ids(bounds, total))
    return zigzag_local(bounds, total // cp_size, cp_size, cp_rank)


def zigzag_source(bounds: torch.Tensor, local_total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """For each of rank ``r``'s local positions, the packed position it holds: ``[B+1] -> [T/C]``.

    Each segment (``n`` a multiple of ``2C``) is cut into ``2C`` chunks of ``k = n/(2C)``;
    rank ``r`` keeps chunks ``r`` and ``2C-1-r``: two pieces per segment on the rank.

    Example: C=2, bounds ``[0, 16, 40]`` (n = 16, 24; k = 4, 6), rank 0: pieces start
    on the rank at ``[0, 4, 8, 14]`` and read from ``[0, 12, 16, 34]`` -> packed positions
    ``0..3, 12..15, 16..21, 34..39`` (20 = 40/2 positions).
    """
    b64 = bounds.to(torch.int64)
    _, local, packed = zigzag_pieces(b64[:-1], b64[1:] - b64[:-1], cp_size, cp_rank)  # [B] each
    out_starts = torch.stack(local, dim=1)  # [B, 2]
    src_starts = torch.stack(packed, dim=1)  # [B, 2]
    return piece_source(out_starts.flatten(), src_starts.flatten(), local_total)  # [T/C]


def zigzag_local(bounds: torch.Tensor, local_total: int, cp_size: int, cp_rank: int) -> ZigzagLocal:
    """:func:`zigzag_source` plus the segment of each local position (``[B+1] -> 2 x [T/C]``): every segment puts
    ``n/C`` consecutive positions on each rank, so the local boundaries are ``bounds // C``. Example: C=2, bounds
    ``[0, 16, 40]``, rank 0 -> segments ``0 x8, 1 x12``."""
    source = zigzag_source(bounds, local_total, cp_size, cp_rank)
    return ZigzagLocal(source, segment_ids(bounds.to(torch.int64) // cp_size, local_total))


def zigzag_inverse(bounds: torch.Tensor, total: int, cp_size: int) -> torch.Tensor:
    """For each packed position, its place in the rank-major stack of shards: ``[B+1] -> [T]`` int64 indices into
    ``shards.reshape(C * T/C, *)``, the exact inverse of :func:`zigzag_source` over all ranks. Chunk ``c`` of a
    segment lives on rank ``c`` (``c < C``) or ``2C-1-c``, at the rank's segment start plus ``0`` or ``k``.

    Example: C=2, bounds ``[0, 8]`` (k = 2): chunks start at ``0, 2, 4, 6`` and live
    on ranks ``0, 1, 1, 0`` at local offsets ``0, 0, 2, 2`` -> stack indices
    ``0,1, 4,5, 6,7, 2,3``."""
    two_c = 2 * cp_size
    local_total = total // cp_size
    b64 = bounds.to(torch.int64)
    start, k = b64[:-1, None], (b64[1:] - b64[:-1])[:, None] // two_c  # [B, 1]
    chunk = torch.arange(two_c, device=bounds.device)  # [2C]
    second_half = chunk >= cp_size
    rank = chunk_owner(chunk, cp_size)  # [2C]
    out_starts = start + chunk * k  # [B, 2C]
    src_starts = rank * local_total + start // cp_size + second_half * k  # [B, 2C]
    return piece_source(out_starts.flatten(), src_starts.flatten(), total)  # [T]


class SegmentRows(NamedTuple):
    """Index maps between the packed tensor and one row per segment (``B'`` rows of ``W`` positions):
    ``row_source [B', W]`` (the packed position slot ``(b, w)`` reads, clamped into ``[0, T)``), ``row_valid [B',
    W]`` (``w < n_b``), ``packed_source [T]`` (the flat slot ``b * W + w`` each packed position reads back) and
    ``packed_valid [T]`` (its offset is below ``W``; past it is padding)."""

    row_source: torch.Tensor
    row_valid: torch.Tensor
    packed_source: torch.Tensor
    packed_valid: torch.Tensor


def segment_rows(bounds: torch.Tensor, total: int, width: int) -> SegmentRows:
    """The :class:`SegmentRows` of segments ``bounds [B'+1]`` (``[0, T]`` pseudo-segment included) over
    ``total`` packed positions, ``width`` (``W >= 1``, a Python int) slots per row.

    Example: bounds ``[0, 3, 3, 8]``, T 8, W 4 -> row_source ``[[0,1,2,3], [3,4,5,6], [3,4,5,6]]``,
    row_valid ``[[T,T,T,F], [F,F,F,F], [T,T,T,T]]``; packed_source ``[0,1,2, 8,9,10,11, 11]``
    (position 7 is offset 4 of segment 2: clamped) and packed_valid ``[T x7, F]``.
    """
    b64 = bounds.to(torch.int64)
    starts, lengths = b64[:-1], b64[1:] - b64[:-1]  # [B'], [B']
    offsets = torch.arange(width, device=bounds.device)  # [W]
    row_source = (starts[:, None] + offsets[None, :]).clamp(0, max(total - 1, 0))  # [B', W]
    row_valid = offsets[None, :] < lengths[:, None]  # [B', W]
    seg = segment_ids(b64, total)  # [T]
    offset = torch.arange(total, device=bounds.device) - starts[seg]  # [T]
    packed_source = seg * width + offset.clamp(max=width - 1)  # [T]
    return SegmentRows(row_source, row_valid, packed_source, offset < width)
