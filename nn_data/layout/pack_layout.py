"""The layout type: one microbatch's packed layout, as the builders make it and both executors run it.

Shape legend
    B   rows of the batch (R with row-capacity padding); ``B' = max(B, 1)`` segments
    S   the padded row length of the batch the layout packs
    T   packed tokens
    C   context-parallel size
    *   trailing feature dims of a packed tensor

A :class:`PackLayout` always holds the boundaries as tensors on the data's device
(``cu_seqlens_padded``, and ``cu_seqlens`` when known) and the static sizes as Python ints (``T``,
``B``, ``S``). A layout built on the host (:mod:`nn_data.layout.build`, the one read of the lengths or
of the boundaries) also holds them as Python ints (:class:`HostBounds`): the host executor moves data
with them. A layout built on the device holds the pack's index maps instead (``dest`` or
``source``/``valid``, :mod:`nn_data.layout.device`). Its methods run it, on the executor
:func:`executor` picks (on :func:`on_host`'s rule): the one place that decides (``docs/design.md``, "Layouts and executors"): a
layout built on the host runs on the host executor (:mod:`nn_data.layout.host`: Python-int sizes, no
further read) unless ``torch.compile`` is tracing; every other layout on the device executor
(:mod:`nn_data.layout.device`: index maps, zero syncs), which is what compiled graphs and CUDA graphs
capture. Whether a layout is built on the host is the builders' rule
(:func:`nn_data.layout.build.reads_host`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.layout import device, host, index
from nn_data.layout.rules import Fill
from nn_data.layout.rules import segment_bounds


#: The attribute by which a tensor the host executor packed or sharded names its layout's ``token``.
TOKEN_ATTR = "_nn_data_layout_token"


def tag(t: torch.Tensor, layout: "PackLayout") -> torch.Tensor:
    """``t``, marked as packed (or sharded) on ``layout`` when that is an eager host layout."""
    if layout.token is not None and not torch.compiler.is_compiling():
        setattr(t, TOKEN_ATTR, layout.token)
    return t


def check_token(name: str, t, layout: "PackLayout") -> None:
    """Refuse ``t`` when the host executor packed it on a layout other than ``layout`` (eager; free).

    Only tensors nn_data's host executor made carry a token: a model's output carries none, so it is
    never checked here (nothing can tell which microbatch a model output belongs to)."""
    if torch.compiler.is_compiling() or not isinstance(t, torch.Tensor):
        return
    token = getattr(t, TOKEN_ATTR, None)
    if token is not None and token is not layout.token:
        raise _checks.PackingError(
            f"{name} was packed on another microbatch's layout: pass the layout it was packed on "
            "(PackResult.layout of the same call); two microbatches of one packed length T look alike by shape")


def _check_own(name: str, t, layout: "PackLayout") -> None:
    """:func:`check_token` for a layout's own methods, where the layout has a token (one a pack made): a
    layout without one (built from boundaries, or on the device) may be another view of ``t``'s very
    microbatch (an op given boundaries builds one), so nothing can be told there."""
    if layout.token is not None:
        check_token(name, t, layout)


class HostBounds(NamedTuple):
    """One microbatch's layout as Python ints, from the one host read.

    ``lengths [B]`` valid tokens per row (None when an op was given boundaries only), ``cu [B+1]``
    (``cu_seqlens``; None when not known), ``cu_pad [B+1]`` the final boundaries (``[T]`` when
    ``B = 0``), ``segments [B']`` the padded segment lengths (``[T]`` for ``B = 0``: the padding
    pseudo-segment), ``max_seqlen`` the longest of them, and ``active``: the rows that may hold
    tokens or padding (rows past it are a row capacity's empty rows with empty segments, which the
    host executor moves in bulk instead of row by row).

    Example: lengths ``[3, 0, 5]``, m 4, T 16 -> cu ``[0, 3, 3, 8]``, cu_pad ``[0, 4, 4, 16]``,
    segments ``[4, 0, 12]``, max_seqlen 12, active 3; with one padding row of a capacity of 4
    (num_rows 3): cu_pad ``[0, 4, 4, 16, 16]``, segments ``[4, 0, 12, 0]``, active 3.
    """

    lengths: Optional[list]
    cu: Optional[list]
    cu_pad: list
    segments: list
    max_seqlen: int
    active: int


class PackLayout(NamedTuple):
    """Where every token of a ``[B, S, *]`` batch goes in the packed ``[1, T, *]`` tensor: the layout.

    ``cu_seqlens [B+1]`` and ``cu_seqlens_padded [B+1]`` (int32, on the data's device; the latter is
    the final boundaries, ``[T]`` when ``B = 0``), ``max_seqlen`` (0-d int32: the longest padded
    segment), ``total`` (T), ``rows`` (B), ``row_len`` (S; None for a layout built from boundaries
    alone, which can shard and unpack but not pack); ``host`` (:class:`HostBounds`, built on the
    host) or the device pack maps: scatter form ``dest [B, S]`` int64 (the packed position of token
    ``(b, s)``, or ``T`` for ``s >= L[b]``), gather form ``source [T]`` int64 (the flat input
    position ``b*S + s`` each packed position reads, clamped) and ``valid [T]`` bool;
    ``seq_lengths`` the lengths tensor the layout was built from; ``token``: an eager host layout's
    fingerprint, which the tensors its host executor packs and shards carry (:data:`TOKEN_ATTR`), so an
    op or a method (``shard``, ``unshard``, ``unpack``) given one of them with *another* microbatch's
    layout refuses (:func:`check_token`).

    Example: lengths ``[3, 0, 5]``, S 5, m 4 -> cu_seqlens_padded ``[0, 4, 4, 12]``; scatter form
    dest ``[[0, 1, 2, 12, 12], [12]*5, [4, 5, 6, 7, 8]]``; gather form source
    ``[0, 1, 2, 3, 10, 11, 12, 13, 14, 14, 14, 14]``, valid ``[T,T,T,F,T,T,T,T,T,F,F,F]``.
    """

    cu_seqlens: Optional[torch.Tensor]
    cu_seqlens_padded: torch.Tensor
    max_seqlen: Optional[torch.Tensor]
    total: int
    rows: int
    row_len: Optional[int]
    host: Optional[HostBounds] = None
    dest: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None
    seq_lengths: Optional[torch.Tensor] = None
    token: Optional[object] = None

    def pack(self, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """Pack another ``[B, S, *]`` tensor of the same batch into ``[1, T, *]``; padding gets ``fill``
        (a scalar, or a tensor broadcastable to ``x.shape[2:]``: ``torch.arange(topk)`` for routed
        experts, a valid route in every padding row)."""
        _check_packable(self, x)
        return tag(executor(self, "pack").pack(self, x, fill), self)

    @property
    def on_host(self) -> bool:
        """Whether this layout runs on the host executor: :func:`on_host`, the one rule."""
        return on_host(self)

    def shard(self, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        """This CP rank's zigzag shard ``[1, T, *] -> [1, T/C, *]`` (``packed`` itself when ``C = 1``)."""
        _check_own("packed", packed, self)
        if cp_size == 1:
            return packed
        return tag(executor(self, "shard").shard(self, packed, cp_size, cp_rank), self)

    def unshard(self, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
        """Every rank's shard, rank-major ``[C, T/C, *]``, back to the packed ``[1, T, *]``."""
        _check_own("shards", shards, self)
        if cp_size == 1:
            return shards
        return executor(self, "unshard").unshard(self, shards, cp_size)

    def unpack(self, packed: torch.Tensor, seq_len, fill=0, shift: int = 0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]`` with ``S = seq_len``: each row's valid tokens, ``fill`` elsewhere
        (``shift=1``: the log-prob layout, token ``s`` from packed position ``start + s - 1``)."""
        _check_own("packed", packed, self)
        rows, total, trailing = self.rows, packed.shape[1], packed.shape[2:]
        if guard_or_false(total == 0):  # nothing to read: all fill
            out = packed.new_full((rows, seq_len, *trailing), fill)
            # + the sum of the empty packed tensor (exactly 0) keeps a backward through an empty microbatch
            return out + packed.sum().to(out.dtype) if packed.requires_grad else out
        return executor(self, "unpack", packed, shift).unpack(self, packed, seq_len, fill, shift)

    def bounds(self) -> torch.Tensor:
        """``[B'+1]`` int64 boundaries to index segments by (``[0, T]`` when ``B = 0``)."""
        return segment_bounds(self.cu_seqlens_padded, self.total)

    def lengths(self) -> torch.Tensor:
        """``[B]`` int64 valid tokens per row, on the device: the lengths the layout was built from, else
        ``cu_seqlens``' differences (a compiled graph that never reads ``cu_seqlens`` then drops it)."""
        if self.seq_lengths is not None:
            return self.seq_lengths.to(torch.int64)
        cu = self.cu_seqlens.to(torch.int64)
        return cu[1:] - cu[:-1]

    def segment_ids(self) -> torch.Tensor:
        """``[T]`` int64: the sequence (row) every packed position belongs to (padding included).

        Example: cu_seqlens_padded ``[0, 4, 4, 12]`` -> ``[0,0,0,0,2,2,2,2,2,2,2,2]``.
        With no row (``B = 0``) every position is in segment 0 of ``[0, T]``.
        """
        return index.segment_ids(self.bounds(), self.total)

    def local_places(self, cp_size: int = 1, cp_rank: int = 0) -> index.ZigzagLocal:
        """This CP rank's places, computed once and applied to every tensor of the batch:
        ``source [T/C]`` (packed position of each local token) and ``segment [T/C]`` (index maps on
        the device, from the boundaries: no host read either way). Example: cu_seqlens_padded
        ``[0, 16, 40]``, C 2, rank 0 -> source ``0..3, 12..15, 16..21, 34..39``."""
        return index.local_places(self.bounds(), self.total, cp_size, cp_rank)

    def segments(self) -> index.Segments:
        """The padded segments and their valid lengths (``bounds [B'+1]``, ``lengths [B']``; the
        ``B = 0`` pseudo-segment ``[0, T]`` holds no valid token)."""
        bounds = self.bounds()
        if self.cu_seqlens_padded.shape[0] == 1:  # B = 0
            return index.Segments(bounds, torch.zeros(1, dtype=torch.int64, device=bounds.device))
        return index.Segments(bounds, self.lengths())

    def padding_mask(self, cp_size: int = 1, cp_rank: int = 0,
                     places: Optional[index.ZigzagLocal] = None) -> torch.Tensor:
        """``[1, T/C]`` bool, this CP rank's positions in the order of its shard, True at padding: each
        segment's slack and the extended last segment's tail (all True for ``B = 0``). What
        megatron-core's ``GPTModel.forward(padding_mask=)`` takes to keep padding out of MoE routing
        statistics. Index maps on the plan's boundary tensors, one gather, no host read on either
        executor; pass this rank's ``places`` when they are at hand.

        Example: lengths ``[3, 0, 5]``, m 4, T 12 -> cu_seqlens_padded ``[0, 4, 4, 12]`` ->
        ``[[F,F,F,T, F,F,F,F,F,T,T,T]]`` (C 1).
        """
        if places is None:
            places = self.local_places(cp_size, cp_rank)
        return index.padding_at(self.segments(), places).unsqueeze(0)  # [1, T/C]

    def positions(self) -> torch.Tensor:
        """``[T]`` int64: offset of every packed position inside its padded segment (0 at each
        sequence start; padding keeps counting). Example: ``[0, 4, 4, 12]`` -> ``[0,1,2,3,0,1,...,7]``."""
        bounds = self.bounds()
        return torch.arange(self.total, device=bounds.device) - bounds[self.segment_ids()]


def pack_with_layout(layout: PackLayout, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
    """Pack ``x [B, S, *]`` into ``[1, T, *]`` along ``layout``: :meth:`PackLayout.pack`.

    Raises :class:`~nn_data.errors.PackingError` if ``x`` is not ``[B, S, *]`` for the layout's
    ``B`` and ``S``, or lives on another device.
    """
    return layout.pack(x, fill)


def on_host(layout: PackLayout) -> bool:
    """Whether ``layout`` runs on the host executor: built on the host, and no compile tracing."""
    return layout.host is not None and not torch.compiler.is_compiling()


def executor(layout: PackLayout, op: str, packed: Optional[torch.Tensor] = None, shift: int = 0):
    """The executor (the module :mod:`~nn_data.layout.host` or :mod:`~nn_data.layout.device`) that runs
    ``op`` (``"pack"``, ``"shard"``, ``"unshard"``, ``"unpack"``) of ``layout``: the one place that decides.
    Each executor function takes ``(layout, tensor, ...)``.

    * a layout not :func:`on_host` (built on the device, or compile tracing): the device executor;
    * ``unshard`` above ``host.SHARD_VIEWS_MAX_SEGMENTS`` non-empty segments (:func:`host.views_fit`): the
      device map (no sync: the boundaries are on the device);
    * ``unpack`` of ``packed`` with no row (``B = 0``), or with no token to move while autograd records
      (every length ``<= shift``): the device's gather form, which keeps the output in autograd's graph
      (the host form would be fill only);
    * otherwise the host executor (Python-int sizes, no further read).
    """
    if not on_host(layout):
        return device
    if op == "unshard" and not host.views_fit(layout):
        return device
    if op == "unpack" and not (layout.rows and (not packed.requires_grad or
                                                any(n > shift for n in layout.host.lengths))):
        return device
    return host


def _check_packable(layout: PackLayout, x) -> None:
    """``x`` must be ``[B, S, *]`` for the layout's ``B`` and ``S``, on its device; a layout built from
    boundaries alone (no ``S``) cannot pack."""
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    rows, row_len = layout.rows, layout.row_len
    if row_len is None:
        raise _checks.PackingError("this layout was built from boundaries without a row length S; it can "
                                   "shard, unshard and unpack, not pack: build it from the lengths (PackSequences)")
    if x.shape[0] != rows or guard_or_false(x.shape[1] != row_len):
        rows, row_len = int(rows), int(row_len)  # error path: plain ints for the message
        raise _checks.PackingError(
            f"x has shape {_checks.dims(x)}; the layout was built for [B, S] = "
            f"[{rows}, {row_len}], so x must be [{rows}, {row_len}, *]"
        )
    if x.device != layout.cu_seqlens_padded.device:
        _checks.check_same_device(x=x, layout=layout.cu_seqlens_padded)  # raises, naming both
