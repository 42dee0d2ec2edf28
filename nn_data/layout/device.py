"""The device executor: a layout's index maps on the device, then one gather or scatter per tensor, no host sync.

Shape legend
    B   rows of the batch; S its row length (a symbolic size under compile)
    T   packed tokens; C context-parallel size, a rank holds ``T/C``
    *   trailing feature dims

A :class:`DeviceExecutor` is what ``torch.compile`` and CUDA graphs capture: every map is tensor arithmetic on
the boundaries (:mod:`nn_data.layout.index`), every shape a Python int or a symbolic size (``docs/design.md``,
"Layouts and executors"). Pack is a **scatter** along ``dest [B, S]`` (``B*S <= 16*T`` on static sizes) or a
**gather** along :class:`GatherMaps`; unpack a **gather** over ``[B, S]`` or, for a mostly-fill output (``B*S
>= 4T``), a fill and a **scatter**. The thresholds' timings: ``profiling/results/ops.md``, "The executors'
crossovers".

Example: lengths ``[3, 0, 5]``, S 5, m 4 -> cu_seqlens_padded ``[0, 4, 4, 12]``; scatter form dest
``[[0, 1, 2, 12, 12], [12]*5, [4, 5, 6, 7, 8]]`` (12: the discard slot); gather form source
``[0, 1, 2, 3, 10, 11, 12, 13, 14, 14, 14, 14]``, valid ``[T,T,T,F,T,T,T,T,T,F,F,F]``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from einops import rearrange
from torch.fx.experimental.symbolic_shapes import statically_known_true

from nn_data import _checks
from nn_data.layout import index
from nn_data.layout.rules import Fill


#: ``B*S / T`` up to which the pack uses the scatter form in the ``"auto"`` form.
SCATTER_MAX_RATIO = 16
#: ``B*S / T`` from which the unpack output is built in the scatter form.
UNPACK_SCATTER_MIN_RATIO = 4

#: The device pack's forms (:class:`~nn_data.layout.PackSpec`'s ``pack_form``): ``"auto"`` by the static
#: sizes, ``"scatter"`` / ``"gather"`` always that one (a benchmark's switch).
PACK_FORMS = ("auto", "scatter", "gather")


class GatherMaps(NamedTuple):
    """The gather form of a pack, ``[T]`` each: ``source`` the flat input position ``b*S + s`` each packed position
    reads (clamped into ``[0, B*S)``), ``valid`` whether it is a token (else ``fill``); a device executor's gather
    form and a tree layout's rollout maps are both this record. Example: the module's."""

    source: torch.Tensor
    valid: torch.Tensor


def pack_maps(lengths: torch.Tensor, cu_pad: torch.Tensor, row_len, total,
              form: str = "auto") -> tuple[Optional[torch.Tensor], Optional[GatherMaps]]:
    """``(dest, gather)`` of one batch from ``lengths [B]`` and the final ``cu_pad [B+1]`` (int64): the scatter form's
    ``dest [B, S]`` or the gather form's :class:`GatherMaps`, the other None; ``form``: ``"auto"`` (scatter when
    ``B*S <= 16*T`` is statically known), ``"scatter"`` or ``"gather"``.

    Example: lengths ``[3, 0, 5]``, S 5, cu_pad ``[0, 4, 4, 12]``: row ``b`` goes to ``cu_pad[b] + s`` while ``s <
    L[b]``, else to the discard slot 12; gathered, segment of each position ``[0,0,0,0,2,...,2]``, offset in it
    ``[0,1,2,3,0,...,7]``, valid where offset < L[segment], source = segment*S + offset."""
    rows = lengths.shape[0]
    ratio = {"auto": SCATTER_MAX_RATIO, "scatter": None, "gather": 0}[form]
    if ratio is None or statically_known_true(rows * row_len <= ratio * total):
        s = torch.arange(row_len, device=lengths.device)  # [S]
        dest = torch.where(s < lengths[:, None], cu_pad[:-1, None] + s, total)  # [B, S]
        return dest, None
    source, valid = index.token_source(cu_pad, lengths, row_len, total)  # [T], [T]
    # Clamped into [0, B*S-1], and to 0 when B*S = 0: two clamps rather than a Python max(), which
    # size-oblivious reasoning on a symbolic S would simplify to B*S-1 (assuming S >= 2).
    return None, GatherMaps(source.clamp(max=rows * row_len - 1).clamp(min=0), valid)


def gather_pack(x: torch.Tensor, maps: GatherMaps, fill: Fill = 0) -> torch.Tensor:
    """``x [B, S, *] -> [1, T, *]`` along ``maps``: one ``index_select``, then ``fill`` where ``maps.valid`` is False.
    Example: x ``[[1, 2, 3, 0, 0], [0]*5, [4, 5, 6, 7, 8]]`` with the maps of :class:`GatherMaps`' example ->
    ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``."""
    trailing, total = x.shape[2:], maps.source.shape[0]
    flat = rearrange(x, "b s ... -> (b s) ...")  # [B*S, *]
    keep = maps.valid.view(total, *([1] * len(trailing)))  # [T, 1...] broadcast over *
    if torch.compiler.is_compiling():
        # Under compile S (or B) may be a symbolic size that is 0 at run time (size-oblivious
        # reasoning cannot tell): one more row keeps the gather's source non-empty (the source
        # index is clamped to 0 there). Inductor folds the pad into the gather's load. Eager
        # never needs it: an eager caller has at least one input position.
        flat = torch.nn.functional.pad(flat, (0, 0) * len(trailing) + (0, 1))  # [B*S+1, *]
    gathered = flat.index_select(0, maps.source)  # [T, *]
    if isinstance(fill, torch.Tensor):
        gathered = torch.where(keep, gathered, fill.to(device=x.device, dtype=x.dtype))
    else:
        gathered = gathered.masked_fill(~keep, fill)
    return gathered.unsqueeze(0)  # [1, T, *]


class DeviceExecutor(NamedTuple):
    """A layout built on the device (or traced by ``torch.compile``): its pack maps, and the four moves.

    ``seq_lengths [B]`` the lengths the layout was built from (None: from boundaries); ``dest [B, S]`` (scatter
    form) or ``gather`` (:class:`GatherMaps`), or neither (built on demand); ``multiple``: every segment is known
    to be a multiple of it (1: nothing known), so a shard needs no data check of the ``2C`` chunks.

    Example: ``PackSequences(4, host_reads=False)`` on lengths ``[3, 0, 5]``, S 5 -> ``DeviceExecutor(
    seq_lengths, dest=[[0, 1, 2, 12, 12], [12]*5, [4, 5, 6, 7, 8]], gather=None)``."""

    seq_lengths: Optional[torch.Tensor] = None
    dest: Optional[torch.Tensor] = None
    gather: Optional[GatherMaps] = None
    multiple: int = 1

    def pack(self, layout, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """``x [B, S, *] -> [1, T, *]`` along the maps: one scatter (``dest``) or one gather; padding gets
        ``fill``."""
        rows, row_len, total = layout.rows, layout.row_len, layout.total
        dest, gather = self.dest, self.gather
        if dest is None and gather is None:
            dest, gather = pack_maps(layout.lengths(), layout.cu_seqlens_padded.to(torch.int64), row_len, total)
        if not statically_known_true(x.shape[1] == row_len):
            # Two unbacked row lengths (nn_data.rows.with_dynamic_row_length) cannot be compared while
            # tracing: compare them on the device. (The gather form needs no relation between them.)
            _checks.device_assert(torch.full((), x.shape[1], device=x.device) == row_len,
                                  "nn_data.PackLayout.pack: x must be [B, S, *] with the layout's S")
        if gather is not None:
            return gather_pack(x, gather, fill)
        trailing = x.shape[2:]
        out = _fill_tensor(fill, (total + 1, *trailing), x)  # [T+1, *]; row T is the discard slot
        if rows * row_len:
            out.index_put_((dest.reshape(-1),), rearrange(x, "b s ... -> (b s) ..."))  # [B*S, *] scattered
        return out[:total].unsqueeze(0)  # [1, T, *]

    def shard(self, layout, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        """This rank's zigzag shard ``[1, T, *] -> [1, T/C, *]``: one ``index_select`` along
        :func:`~nn_data.layout.index.zigzag_source`. Example (C 2, rank 0): cu_seqlens_padded
        ``[0, 16, 40]`` -> packed positions ``0..3, 12..15, 16..21, 34..39``."""
        total = layout.total
        source = index.zigzag_source(layout.bounds(), total // cp_size, cp_size, cp_rank)
        return packed.index_select(1, source.clamp(0, max(total - 1, 0)))  # [1, T/C, *]

    def unshard(self, layout, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
        """``[C, T/C, *] -> [1, T, *]``: one ``index_select`` of the rank-major stack along
        :func:`~nn_data.layout.index.zigzag_inverse`. Example: C 2, one segment of 8 (k 2): the stack
        ``r0[0:4], r1[0:4]`` is read at ``0, 1, 4, 5, 6, 7, 2, 3``."""
        total = layout.total
        inverse = index.zigzag_inverse(layout.bounds(), total, cp_size).clamp(0, max(total - 1, 0))  # [T]
        stacked = rearrange(shards, "c t ... -> (c t) ...")  # [C*T/C, *]
        return stacked.index_select(0, inverse).unsqueeze(0)  # [1, T, *]

    def unpack(self, layout, packed: torch.Tensor, seq_len, fill=0, shift: int = 0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]``: ``out[b, s] = packed[bounds[b] + s - shift]`` for ``shift <= s < L[b]``, ``fill``
        elsewhere (``shift=1``: the log-prob layout), ``bounds`` the layout's ``cu_seqlens_padded``. Gather form,
        example: lengths ``[3, 0, 5]``, starts ``[0, 4, 4]``, S 5 -> index rows ``[0..4], [4..8], [4..8]``, valid
        ``[T,T,T,F,F], [F]*5, [T]*5``."""
        lengths, bounds = layout.lengths(), layout.cu_seqlens_padded.to(torch.int64)  # [B], [B+1]
        rows, total, trailing = lengths.shape[0], packed.shape[1], packed.shape[2:]
        if rows and statically_known_true(rows * seq_len >= UNPACK_SCATTER_MIN_RATIO * total):
            if self.gather is not None and shift == 0 and statically_known_true(seq_len == layout.row_len) and \
                    statically_known_true(total == layout.total):
                # the pack's own gather map read backwards: each token goes back where it came from, the rest
                # to the discard slot B*S (no second segment scan)
                dest = torch.where(self.gather.valid, self.gather.source, rows * seq_len)  # [T]
                return _scatter_rows(packed, dest, rows, seq_len, fill)
            return _unpack_scatter(packed, lengths, bounds, seq_len, fill, shift)
        s = torch.arange(seq_len, device=packed.device)  # [S]
        index_ = (bounds[:-1, None] + s - shift).clamp(0, total - 1)  # [B, S]
        valid = (s >= shift) & (s < lengths[:, None])  # [B, S]
        out = packed[0].index_select(0, index_.reshape(-1))  # [B*S, *]
        out = out.view(rows, seq_len, *trailing)  # [B, S, *]
        keep = valid.view(rows, seq_len, *([1] * len(trailing)))  # [B, S, 1...]
        return out.masked_fill_(~keep, fill)


def _fill_tensor(fill: Fill, shape, like: torch.Tensor) -> torch.Tensor:
    if isinstance(fill, torch.Tensor):
        return fill.to(device=like.device, dtype=like.dtype).expand(shape).clone()
    return torch.full(shape, fill, dtype=like.dtype, device=like.device)


def _unpack_scatter(packed, lengths, bounds, seq_len, fill, shift: int) -> torch.Tensor:
    """The scatter form: fill ``[B*S + 1, *]`` once, then write each packed position to its place. Example: bounds
    ``[0, 4, 4, 12]``, lengths ``[3, 0, 5]``, S 5, shift 0: :func:`~nn_data.layout.index.token_source` gives
    sources ``[0,1,2,3,10,...,17]``, valid ``[T,T,T,F,T,T,T,T,T,F,F,F]`` -> destinations ``[0, 1, 2, 15, 10, 11, 12,
    13, 14, 15, 15, 15]`` (15 = B*S, the discard slot): the pack's gather form read backwards, which
    :meth:`DeviceExecutor.unpack` uses when it has it."""
    rows, total = lengths.shape[0], packed.shape[1]
    source, valid = index.token_source(bounds, lengths, seq_len, total, shift)  # [T], [T]
    dest = torch.where(valid, source.clamp(0, rows * seq_len), rows * seq_len)  # [T] into [B*S + 1]
    return _scatter_rows(packed, dest, rows, seq_len, fill)


def _scatter_rows(packed, dest, rows: int, seq_len, fill) -> torch.Tensor:
    """``packed [1, T, *]`` written to ``dest [T]`` of a ``fill``ed ``[B*S + 1, *]`` (``B*S``: the discard slot),
    returned as ``[B, S, *]``."""
    trailing = packed.shape[2:]
    out = packed.new_full((rows * seq_len + 1, *trailing), fill)  # row B*S: the discard slot
    out.index_put_((dest,), packed[0])
    return out[: rows * seq_len].view(rows, seq_len, *trailing)  # [B, S, *]

