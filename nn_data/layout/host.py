"""The host executor: a layout's Python ints (one host read) and a constant number of ops per tensor.

Shape legend
    B   rows of the batch; S its row length
    T   packed tokens; C context-parallel size, r this rank; the local shard is ``T/C`` tokens
    k   a segment's zigzag chunk, ``n / (2C)`` for a padded segment of ``n`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identities ``[3]``, logits ``V``)

Each of :class:`HostExecutor`'s four methods is one ``split`` of its input at the layout's ints and one
``cat``, whatever ``B`` is, or the device executor's in the cases it names; it never runs while
``torch.compile`` traces (docs/design.md, "Layouts and executors"). The crossover behind
:data:`SHARD_VIEWS_MAX_SEGMENTS`: ``profiling/results/ops.md``, "The executors' crossovers".

Example: lengths ``[3, 0, 5]``, S 5, m 4 -> cu_seqlens_padded ``[0, 4, 4, 12]``; the input
splits at ``[3, 2, 0, 5, 5, 0]`` (valid prefixes ``x[0,:3]``, ``x[1,:0]``, ``x[2,:5]``), the
padding at ``[1, 0, 3]``, and the packed tensor is ``x[0,:3], 0, x[2,:5], 0, 0, 0``."""

from __future__ import annotations

import array
from itertools import accumulate, compress
from typing import NamedTuple, Optional

import torch

from nn_data import _checks
from nn_data.layout.device import DeviceExecutor
from nn_data.layout.rules import Fill, chunk_owner, zigzag_pieces


#: Segments up to which shard and unshard are a split + cat of views; above, an index_select along a
#: map (the crossover: ``profiling/results/ops.md``).
SHARD_VIEWS_MAX_SEGMENTS = 32

#: The attribute by which a tensor a host executor packed or sharded names its layout's ``token``.
TOKEN_ATTR = "_nn_data_layout_token"


class HostBounds(NamedTuple):
    """One microbatch's layout as Python ints, from the one host read: ``lengths [B]`` (None when an op was given
    boundaries only), ``cu [B+1]`` (None when not known), ``cu_pad [B+1]`` the final boundaries (``[T]`` for ``B =
    0``), ``segments [B']`` the padded segment lengths, ``max_seqlen`` the longest, ``active``: the rows that may
    hold tokens (past it, a row capacity's empty rows, moved in bulk).

    Example: lengths ``[3, 0, 5]``, m 4, T 16 -> cu ``[0, 3, 3, 8]``, cu_pad ``[0, 4, 4, 16]``,
    segments ``[4, 0, 12]``, max_seqlen 12, active 3; with one padding row of a capacity of 4
    (num_rows 3): cu_pad ``[0, 4, 4, 16, 16]``, segments ``[4, 0, 12, 0]``, active 3."""

    lengths: Optional[list]
    cu: Optional[list]
    cu_pad: list
    segments: list
    max_seqlen: int
    active: int


def check_token(name: str, t, layout) -> None:
    """Refuse ``t`` when a host executor packed it on a layout other than ``layout`` (eager; free). A model's
    output carries no token, so it is never checked. Example: ``r1.layout.unpack(r2.packed, S)`` with two
    microbatches packed eagerly raises; ``r1.layout.unpack(model(r1.packed), S)`` does not."""
    if torch.compiler.is_compiling() or not isinstance(t, torch.Tensor):
        return
    token = getattr(t, TOKEN_ATTR, None)
    if token is not None and token is not layout.token:
        raise _checks.PackingError(
            f"{name} was packed on another microbatch's layout: pass the layout it was packed on "
            "(PackResult.layout of the same call); two microbatches of one packed length T look alike by shape")


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values: list, dtype: torch.dtype, device_) -> torch.Tensor:
    """A tensor of host ints on ``device_`` (through an ``array`` buffer); on an accelerator staged in pinned memory
    and copied asynchronously, so that the copy is no sync. Example: ``[0, 4, 4, 12]``, int32, cpu ->
    ``tensor([0, 4, 4, 12], dtype=torch.int32)``."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values or isinstance(values[0], list):
        t = torch.tensor(values, dtype=dtype)
    else:
        t = torch.frombuffer(array.array(code, values), dtype=dtype)
    if (device_ if isinstance(device_, torch.device) else torch.device(device_)).type == "cpu":
        return t
    return t.pin_memory().to(device_, non_blocking=True)


def pads_of(bounds) -> list:
    """Each active segment's padding after its valid tokens (``[T]`` when ``B = 0``). Example: lengths
    ``[3, 0, 5]``, segments ``[4, 0, 12]`` -> ``[1, 0, 7]``."""
    if not bounds.lengths:
        return list(bounds.segments)
    return [n - v for n, v in zip(bounds.segments[: bounds.active], bounds.lengths[: bounds.active])]


class HostExecutor(NamedTuple):
    """A layout built on the host: its Python ints, and the four moves in a few ``split``/``cat`` ops.

    ``bounds`` (:class:`HostBounds`), ``seq_lengths [B]`` the lengths tensor the layout was built from (None: from
    boundaries), ``token``: the fingerprint every tensor this executor packs or shards carries
    (:data:`TOKEN_ATTR`, :func:`check_token`), or None. Each method takes ``(layout, tensor, ...)``.

    Example: ``PackSequences(4)`` on lengths ``[3, 0, 5]``, S 5, eagerly -> ``HostExecutor(HostBounds([3, 0,
    5], [0, 3, 3, 8], [0, 4, 4, 12], [4, 0, 8], 8, 3), seq_lengths, token)``."""

    bounds: HostBounds
    seq_lengths: Optional[torch.Tensor] = None
    token: Optional[object] = None

    def pack(self, layout, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """``x [B, S, *] -> [1, T, *]``: valid prefixes and ``fill`` padding, one ``cat``; empty rows add no piece, so
        the pieces are about twice the non-empty rows whatever ``B`` is."""
        bounds = self.bounds
        trailing, row_len = x.shape[2:], x.shape[1]
        pads = pads_of(bounds)
        pad = _padding((sum(pads), *trailing), fill, x)  # [T - sum(L), *]
        lengths = bounds.lengths[: bounds.active]
        if not any(lengths):  # nothing valid: the packed tensor is all padding
            out = pad.contiguous().unsqueeze(0)  # (materialised: fill may be a view)
            # + the sum of an empty slice of x (exactly 0) keeps x in autograd's graph, as the device
            # executor does: a backward through an all-empty microbatch gives x a zero gradient
            return self._tag(out + x[:0].sum().to(out.dtype) if x.requires_grad else out)
        runs, skips = _runs(lengths, [row_len - n for n in lengths])  # the input: skipped, valid, ..., skipped
        skips[-1] += (x.shape[0] - bounds.active) * row_len  # the empty rows past the active ones
        valid = _run_views(x.reshape(x.shape[0] * row_len, *trailing), skips, runs)  # the valid runs
        _, gaps = _runs(lengths, pads)  # the output: padding before each valid run, and after the last
        return self._tag(torch.cat(_between(valid, gaps, pad)).unsqueeze(0))  # [1, T, *]

    def shard(self, layout, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        """This rank's zigzag shard ``[1, T, *] -> [1, T/C, *]``: its two pieces of every segment. Up to
        :data:`SHARD_VIEWS_MAX_SEGMENTS` segments one ``split`` and one ``cat``; more, one ``index_select`` along a map
        built from the same pieces by one scan. Example: cu_pad ``[0, 16, 40]``, C 2, rank 0 -> packed positions
        ``0..3, 12..21, 34..39``."""
        starts, lengths = _pieces(self.bounds, cp_size, cp_rank)
        flat = packed[0]  # [T, *]
        if len(lengths) <= 2 * SHARD_VIEWS_MAX_SEGMENTS:
            return self._tag(_shard_views(starts, lengths, flat).unsqueeze(0))
        source = _shard_source(starts, lengths, flat.shape[0] // cp_size, flat.device)  # [T/C]
        return self._tag(flat.index_select(0, source).unsqueeze(0))  # [1, T/C, *]

    def unshard(self, layout, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
        """``[C, T/C, *] -> [1, T, *]``: every rank's shard split at ``[k, k]`` per segment, one ``cat`` in packed order
        (chunk ``c`` from rank ``min(c, 2C-1-c)``); above :data:`SHARD_VIEWS_MAX_SEGMENTS` non-empty segments the
        device executor's one gather.

        Example: C 2, one segment of 8 (k 2): rank 0 holds chunks 0, 3, rank 1 chunks 1, 2 -> pieces
        ``r0[0:2], r1[0:2], r1[2:4], r0[2:4]``."""
        _, chunks = _chunks(self.bounds, cp_size)
        if len(chunks) > SHARD_VIEWS_MAX_SEGMENTS:
            return DeviceExecutor(self.seq_lengths).unshard(layout, shards, cp_size)
        halves = [k for k in chunks for _ in (0, 1)]  # each rank: [k, k] per segment
        parts = [shards[q].split(halves) for q in range(cp_size)]  # C x 2B views
        pieces, sizes = [], []
        for b, k in enumerate(chunks):
            for c in range(2 * cp_size):
                pieces.append(parts[chunk_owner(c, cp_size)][2 * b + (c >= cp_size)])
                sizes.append(k)
        return _cat(pieces, sizes, shards[0]).unsqueeze(0)  # [1, T, *]

    def unpack(self, layout, packed: torch.Tensor, seq_len: int, fill=0, shift: int = 0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]``: ``out[b, s] = packed[cu_pad[b] + s - shift]`` for ``shift <= s < L[b]``, ``fill``
        elsewhere; one ``split`` of the packed tensor, one of an expanded fill row, one ``cat``. With no row, or no
        token to move while autograd records, the device executor's gather (which keeps the output in the graph).

        Example: cu_pad ``[0, 4, 4, 12]``, lengths ``[3, 0, 5]``, S 5, shift 0: the packed tensor splits at
        ``[0, 3, 1, 5, 3]`` (gap, run, gap, run, gap); the output is ``p[0:3], fill x7, p[4:9]``."""
        bounds = self.bounds
        if not (layout.rows and (not packed.requires_grad or any(n > shift for n in bounds.lengths))):
            return DeviceExecutor(self.seq_lengths).unpack(layout, packed, seq_len, fill, shift)
        trailing, rows, lengths = packed.shape[2:], len(bounds.lengths), bounds.lengths[: bounds.active]
        lead = [shift if n else 0 for n in lengths]  # fill before each row's run (shift 1: column 0)
        row_runs = [n - a for n, a in zip(lengths, lead)]
        runs, src_gaps = _runs(row_runs, [seg - r for seg, r in zip(bounds.segments, row_runs)])
        src_gaps[-1] += packed.shape[1] - sum(bounds.segments)  # past the last boundary (unpadded offsets only)
        valid = _run_views(packed[0], src_gaps, runs)  # the non-empty runs [*]
        gaps, gap = [], 0
        for a, run, n in zip(lead, row_runs, lengths):  # the fill before each run, and after the last
            gap += a
            if run:
                gaps.append(gap)
                gap = 0
            gap += seq_len - n
        gaps.append(gap + (rows - bounds.active) * seq_len)  # the empty rows past the active ones: fill
        fills = packed.new_full((1, *trailing), fill).expand(sum(gaps), *trailing)  # one row, no copy
        pieces = _between(valid, gaps, fills)
        flat = torch.cat(pieces) if pieces else packed.new_empty((0, *trailing))  # [B*S, *] (empty when S = 0)
        return flat.view(rows, seq_len, *trailing)  # [B, S, *]

    def _tag(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, marked as packed (or sharded) on this executor's layout when it has a token."""
        if self.token is not None:
            setattr(t, TOKEN_ATTR, self.token)
        return t


def _runs(lengths: list, others: list) -> tuple[list, list]:
    """A row-by-row ``[L0, o0, L1, o1, ...]`` (each row's valid run, then its other stretch) as
    ``(runs, gaps)``: the non-empty runs, and the stretch before each of them plus the one after the
    last (``len(runs) + 1`` gaps), empty runs folded into the gaps around them.

    Example: lengths ``[3, 0, 0, 2]``, others ``[1, 5, 5, 0]`` -> runs ``[3, 2]``, gaps ``[0, 11, 0]``.
    """
    if all(lengths):  # no empty run (the usual batch): each gap is the previous row's other stretch
        return list(lengths), [0, *others]
    runs, gaps, gap = [], [], 0
    for n, o in zip(lengths, others):
        if n:
            gaps.append(gap)
            runs.append(n)
            gap = 0
        gap += o
    gaps.append(gap)
    return runs, gaps


def _chunks(bounds, cp_size: int) -> tuple[list, list]:
    """``(starts, chunks)`` of the non-empty segments: each one's packed start and zigzag chunk
    ``n / 2C`` (empty segments hold nothing on any rank). Example: cu_pad ``[0, 16, 16, 40]``, C 2 ->
    ``([0, 16], [4, 6])``."""
    two_c = 2 * cp_size
    starts = bounds.cu_pad if len(bounds.cu_pad) > 1 else [0]  # B = 0 ([T]): the pseudo-segment starts at 0
    kept = [(a, n // two_c) for a, n in zip(starts, bounds.segments[: bounds.active]) if n]
    return [a for a, _ in kept], [k for _, k in kept]


def _pieces(bounds, cp_size: int, cp_rank: int) -> tuple[list, list]:
    """This rank's pieces in local order, two per non-empty segment: ``(packed starts, lengths)``, from
    :func:`~nn_data.layout.rules.zigzag_pieces` asked once for a unit segment and scaled per segment (it is linear
    in the segment).

    Example: cu_pad ``[0, 16, 40]``, C 2, rank 0 -> unit offsets ``(0, 3)`` -> starts ``[0, 12, 16, 34]``,
    lengths ``[4, 4, 6, 6]``."""
    _, _, (first, second) = zigzag_pieces(0, 2 * cp_size, cp_size, cp_rank)  # the chunks' offsets, k = 1
    segment_starts, chunks = _chunks(bounds, cp_size)
    starts = [a + off * k for a, k in zip(segment_starts, chunks) for off in (first, second)]
    return starts, [k for k in chunks for _ in (0, 1)]


def _shard_views(starts: list, lengths: list, flat: torch.Tensor) -> torch.Tensor:
    """``flat [T, *]`` cut into the skipped stretches and this rank's pieces, adjacent pieces merged
    into one run (rank 0's last piece of a segment and its first of the next): one ``split``, one
    ``cat``. Example: pieces at ``0, 12, 16, 34`` of ``4, 4, 6, 6`` -> runs ``0..3, 12..21, 34..39``
    after gaps ``0, 8, 12`` (and 0 after the last)."""
    gaps, runs, end = [], [], 0  # end: the packed position after the last kept piece
    for start, k in zip(starts, lengths):
        if start == end and runs:
            runs[-1] += k
        else:
            gaps.append(start - end)
            runs.append(k)
        end = start + k
    gaps.append(flat.shape[0] - end)
    if not runs:  # no segment (T = 0)
        return flat[:0].clone()
    return torch.cat(_run_views(flat, gaps, runs))  # [T/C, *]


def _shard_source(starts: list, lengths: list, local: int, device_) -> torch.Tensor:
    """``[T/C]`` int64: the packed position of each local position, a scan of the jumps where a piece starts (its
    packed start minus where the previous piece ended). Example: pieces at ``0, 12, 16, 34`` of ``4, 4, 6, 6`` ->
    jumps 8 at local 4 and 12 at local 14 (and -1 at 0: the cumsum of ones counts from 1) -> ``0..3, 12..15,
    16..21, 34..39``."""
    at = list(accumulate(lengths[:-1], initial=0))  # each piece's local start
    jumps = [starts[0] - 1] + [s - (p + k) for s, p, k in zip(starts[1:], starts, lengths)]
    table = host_tensor([at, jumps], torch.int64, device_)  # [2, 2B]
    delta = torch.ones(local, dtype=torch.int64, device=device_)  # [T/C]
    delta.index_add_(0, table[0], table[1])
    return delta.cumsum(0)  # [T/C]


def _run_views(t: torch.Tensor, gaps: list, runs: list) -> list:
    """The views of ``t`` at the (non-empty) ``runs``, ``gaps[i]`` before run ``i`` and ``gaps[-1]`` after
    the last: one ``split``, no empty view made. Example: gaps
    ``[0, 2, 1]``, runs ``[3, 4]`` -> ``t[0:3], t[5:9]``."""
    sizes, keep = [], []
    for g, r in zip(gaps, runs):
        if g:
            sizes.append(g)
            keep.append(False)
        sizes.append(r)
        keep.append(True)
    if gaps[-1]:
        sizes.append(gaps[-1])
    return list(compress(t.split(sizes), keep))


def _between(runs: list, gaps: list, filler: torch.Tensor) -> list:
    """``[gap 0, run 0, gap 1, ..., gap R]`` with the non-zero gaps cut from ``filler`` by one ``split``
    (zero gaps dropped). Example: gaps ``[0, 2, 1]`` -> ``run 0, filler[0:2], run 1, filler[2:3]``."""
    gap_views = iter(filler.split([g for g in gaps if g]))
    out = []
    for g, r in zip(gaps, runs):
        if g:
            out.append(next(gap_views))
        out.append(r)
    if gaps[-1]:
        out.append(next(gap_views))
    return out


def _cat(pieces: list, sizes: list, like: torch.Tensor) -> torch.Tensor:
    """``cat`` of the non-empty ``pieces`` (``sizes`` their lengths): on the CPU an empty input moves
    ``cat`` off its fast memcpy kernel. Example: pieces of sizes ``[2, 0, 2]`` -> ``cat`` of the first
    and the last."""
    kept = list(compress(pieces, sizes))
    if not kept:
        return like.new_empty((0, *like.shape[1:]))
    return torch.cat(kept)


def _padding(shape, fill: Fill, like: torch.Tensor) -> torch.Tensor:
    """A padding buffer: zeros, or ``fill`` broadcast (a view, no copy) for a tensor fill."""
    if isinstance(fill, torch.Tensor):
        return fill.to(device=like.device, dtype=like.dtype).expand(shape)
    if fill == 0:
        return like.new_zeros(shape)
    return like.new_full(shape, fill)

