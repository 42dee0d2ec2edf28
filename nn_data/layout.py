"""The packed layout of one batch, and packing any tensor of that batch along it.

Shape legend
    B   sequences (rows) of the input batch
    S   padded row length of the input batch
    T   packed tokens
    *   trailing feature dims (none for ids and masks, ``[layers, topk]`` for routed experts)

A layout is computed once per batch from ``seq_lengths`` (by :class:`~nn_data.PackSequences`)
and reused for every tensor of the batch: one scatter or one gather each. Which of the two is
decided from the static shapes when the layout is built:

* **scatter** (``B*S <= 16*T`` on static sizes): ``dest [B, S]``, the packed position of every input token.
  It reads per-row tables only (``cu_seqlens_padded[b]``, ``L[b]``), which inductor hoists
  out of the inner loop, but it touches all ``B*S`` input positions;
* **gather** (otherwise: ``B*S > 16*T``, a padded batch that is mostly padding, the usual RL case with
  long-tailed lengths): ``source [T]`` and ``valid [T]``, touching only the ``T`` packed
  positions but looking up each position's segment. Symbolic sizes (a data-dependent ``T``
  under compile, a dynamic ``S``) also take the gather form: no guard on the comparison.

Measured compiled on this project's 2-core CPU (1 thread): with ``B*S = T`` the scatter packed
262,144 tokens about 5x faster than the gather (which looks up a segment per position); on the
profiling stream (``R*S`` about 20x ``T``) the two tied, hence the threshold 16. Pack + CP
shard (C = 4, m = 8, ``B*S = T = 262,144``, ``python -m profiling.bench_ops --ops pack+shard
--layout scatter|gather``): scatter 744 / 718 / 770 us against gather 1716 / 1882 / 2142 us at
B = 8 / 64 / 256, so the scatter form wins at every B of that table. Either form is about 4x a
``clone()`` of the bytes written there: every token costs an indexed (scalar) store or load,
which inductor's CPU code does not vectorise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from einops import rearrange
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from nn_data import _checks
from nn_data._index import ZigzagLocal, local_places, segment_bounds, segment_ids

Fill = Union[int, float, bool, torch.Tensor]

#: ``B*S / T`` up to which a layout uses the scatter form (see the module docstring).
SCATTER_MAX_RATIO = 16


class PackLayout(NamedTuple):
    """Where every token of a ``[B, S, *]`` batch goes in the packed ``[1, T, *]`` tensor.

    Scatter form: ``dest [B, S]`` int64, the packed position of token ``(b, s)``, or ``T``
    (one past the end, a discarded slot) for ``s >= L[b]``; ``source``/``valid`` are None.
    Gather form: ``source [T]`` int64, the flat input position ``b*S + s`` each packed
    position reads (clamped into range), and ``valid [T]`` bool (False on padding); ``dest``
    is None. Both: ``cu_seqlens_padded [B+1]`` int64 (the final boundaries), ``total`` (T),
    ``rows`` (B), ``row_len`` (S).

    Example: lengths ``[3, 0, 5]``, S 5, m 4 -> cu_seqlens_padded ``[0, 4, 4, 12]``; scatter
    form dest ``[[0, 1, 2, 12, 12], [12]*5, [4, 5, 6, 7, 8]]``; gather form source
    ``[0, 1, 2, 3, 10, 11, 12, 13, 14, 14, 14, 14]``, valid ``[T,T,T,F,T,T,T,T,T,F,F,F]``.
    """

    dest: Optional[torch.Tensor]
    source: Optional[torch.Tensor]
    valid: Optional[torch.Tensor]
    cu_seqlens_padded: torch.Tensor
    total: int
    rows: int
    row_len: int

    def pack(self, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """Pack another ``[B, S, *]`` tensor of the same batch: see :func:`pack_with_layout`."""
        return pack_with_layout(self, x, fill)

    def segment_ids(self) -> torch.Tensor:
        """``[T]`` int64: the sequence (row) every packed position belongs to (padding included).

        Example: cu_seqlens_padded ``[0, 4, 4, 12]`` -> ``[0,0,0,0,2,2,2,2,2,2,2,2]``.
        With no row (``B = 0``) every position is in segment 0 of ``[0, T]``.
        """
        return segment_ids(self.cu_seqlens_padded, self.total)

    def local_places(self, cp_size: int = 1, cp_rank: int = 0) -> ZigzagLocal:
        """This CP rank's places, computed once and applied to every tensor of the batch:
        ``source [T/C]`` (packed position of each local token) and ``segment [T/C]``.
        ``packed.index_select(1, places.source)`` is ``ShardForContextParallel`` without its
        checks. Example: cu_seqlens_padded ``[0, 16, 40]``, C 2, rank 0 -> source
        ``0..3, 12..15, 16..21, 34..39``."""
        return local_places(segment_bounds(self.cu_seqlens_padded, self.total), self.total, cp_size, cp_rank)

    def positions(self) -> torch.Tensor:
        """``[T]`` int64: offset of every packed position inside its padded segment (0 at each
        sequence start; padding keeps counting). Example: ``[0, 4, 4, 12]`` -> ``[0,1,2,3,0,1,...,7]``."""
        t = torch.arange(self.total, device=self.cu_seqlens_padded.device)
        if self.rows == 0:
            return t
        return t - self.cu_seqlens_padded[self.segment_ids()]


def build_layout(lengths: torch.Tensor, cu_pad: torch.Tensor, row_len: int, total: int) -> PackLayout:
    """The layout of one batch from ``lengths [B]`` and the final ``cu_pad [B+1]`` (int64).

    Scatter form, example: lengths ``[3, 0, 5]``, S 5, cu_pad ``[0, 4, 4, 12]``: row ``b`` goes
    to ``cu_pad[b] + s`` while ``s < L[b]``, else to the discard slot 12.
    Gather form, same example: segment of each position ``[0,0,0,0,2,...,2]``, offset in it
    ``[0,1,2,3,0,...,7]``, valid where offset < L[segment], source = segment*S + offset.
    """
    rows = lengths.shape[0]
    if _use_scatter(rows, row_len, total):
        s = torch.arange(row_len, device=lengths.device)  # [S]
        dest = torch.where(s < lengths[:, None], cu_pad[:-1, None] + s, total)  # [B, S]
        return PackLayout(dest, None, None, cu_pad, total, rows, row_len)
    seg = segment_ids(cu_pad, total)  # [T]
    offset = torch.arange(total, device=lengths.device) - cu_pad[seg]  # [T]
    valid = offset < lengths[seg]  # [T]
    # Clamped into [0, B*S-1], and to 0 when B*S = 0: two clamps rather than a Python max(), which
    # size-oblivious reasoning on a symbolic S would simplify to B*S-1 (assuming S >= 2).
    source = (seg * row_len + offset).clamp(max=rows * row_len - 1).clamp(min=0)  # [T] into [B*S]
    return PackLayout(None, source, valid, cu_pad, total, rows, row_len)


def _use_scatter(rows, row_len, total) -> bool:
    """Scatter when ``B*S <= 16*T`` on static sizes. With a symbolic size (a data-dependent ``T``
    under compile, or a dynamic ``S``) the comparison would need a guard: take the gather form,
    which only touches ``T`` positions."""
    return statically_known_true(rows * row_len <= SCATTER_MAX_RATIO * total)


def pack_with_layout(layout: PackLayout, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
    """Pack ``x [B, S, *]`` into ``[1, T, *]`` along ``layout`` (one scatter or one gather);
    padding gets ``fill``.

    ``fill`` is a scalar, or a tensor broadcastable to ``x.shape[2:]``: for routed
    experts ``[B, S, layers, topk]`` pass ``torch.arange(topk)`` so that every pad
    row is a valid top-k route.

    Raises :class:`~nn_data.errors.PackingError` if ``x`` is not ``[B, S, *]`` for the
    layout's ``B`` and ``S``, or lives on another device.
    """
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    rows, row_len, total = layout.rows, layout.row_len, layout.total
    if x.shape[0] != rows or guard_or_false(x.shape[1] != row_len):
        rows, row_len = int(rows), int(row_len)  # error path: plain ints for the message
        raise _checks.PackingError(
            f"x has shape {_checks.dims(x)}; the layout was built for [B, S] = "
            f"[{rows}, {row_len}], so x must be [{rows}, {row_len}, *]"
        )
    _checks.check_same_device(x=x, layout=layout.cu_seqlens_padded)
    if not statically_known_true(x.shape[1] == row_len):
        # Two unbacked row lengths (nn_data.rows.with_dynamic_row_length) cannot be compared while
        # tracing: compare them on the device. (The gather form below needs no relation between them.)
        _checks.device_assert(torch.full((), x.shape[1], device=x.device) == row_len,
                              "nn_data.PackLayout.pack: x must be [B, S, *] with the layout's S")
    trailing = x.shape[2:]
    flat = rearrange(x, "b s ... -> (b s) ...")  # [B*S, *]
    if layout.dest is not None:
        out = _fill_tensor(fill, (total + 1, *trailing), x)  # [T+1, *]; row T is the discard slot
        if rows * row_len:
            out.index_put_((layout.dest.reshape(-1),), flat)
        return out[:total].unsqueeze(0)  # [1, T, *]
    keep = layout.valid.view(total, *([1] * len(trailing)))  # [T, 1...] broadcast over *
    if torch.compiler.is_compiling():
        # Under compile S (or B) may be a symbolic size that is 0 at run time (size-oblivious
        # reasoning cannot tell): one more row keeps the gather's source non-empty (the source
        # index is clamped to 0 there). Inductor folds the pad into the gather's load. Eager
        # never needs it: the gather form implies B*S > 16*T >= 0.
        flat = torch.nn.functional.pad(flat, (0, 0) * len(trailing) + (0, 1))  # [B*S+1, *]
    gathered = flat.index_select(0, layout.source)  # [T, *]
    if isinstance(fill, torch.Tensor):
        gathered = torch.where(keep, gathered, fill.to(device=x.device, dtype=x.dtype))
    else:
        gathered = gathered.masked_fill(~keep, fill)
    return gathered.unsqueeze(0)  # [1, T, *]


def _fill_tensor(fill: Fill, shape, like: torch.Tensor) -> torch.Tensor:
    if isinstance(fill, torch.Tensor):
        return fill.to(device=like.device, dtype=like.dtype).expand(shape).clone()
    return torch.full(shape, fill, dtype=like.dtype, device=like.device)
