"""The layout type: one microbatch's boundaries and the executor that moves data along them.

Shape legend
    B   rows of the batch (R with row-capacity padding); ``B' = max(B, 1)`` segments
    S   the padded row length of the batch the layout packs
    T   packed tokens
    C   context-parallel size
    *   trailing feature dims of a packed tensor

A :class:`PackLayout` holds the boundaries as tensors on the data's device (``cu_seqlens_padded``, and
``cu_seqlens`` when known), the static sizes as Python ints (``T``, ``B``, ``S``) and one of two executors
(``docs/design.md``, "Layouts and executors"): a :class:`~nn_data.layout.host.HostExecutor` (built on the
host after the one read of the lengths or boundaries: Python ints, a few ``split``/``cat`` ops per
tensor) or a :class:`~nn_data.layout.device.DeviceExecutor` (built on the device: index maps, zero syncs,
what compiled graphs and CUDA graphs capture). Both executors have the same four methods, ``pack``,
``shard``, ``unshard`` and ``unpack``, each taking ``(layout, tensor, ...)``; the layout's own methods
check their arguments and call the executor's. Which executor a layout holds is its builder's choice
(:func:`nn_data.layout.build.reads_host`: ``host_reads`` and the compile state). A host layout that
travels into a region ``torch.compile`` traces becomes a device layout once, at the door by which it enters
an op (:func:`entered`: an op given ``layout=``, or a method of the layout), so no executor asks whether it is
being traced. Example: :class:`PackLayout`'s.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.layout import index
from nn_data.layout.device import DeviceExecutor
from nn_data.layout.host import HostBounds, HostExecutor, check_token
from nn_data.layout.rules import Fill
from nn_data.layout.rules import segment_bounds

__all__ = ["HostBounds", "PackLayout", "entered", "pack_with_layout"]


class PackLayout(NamedTuple):
    """Where every token of a ``[B, S, *]`` batch goes in the packed ``[1, T, *]`` tensor: the layout.

    ``cu_seqlens [B+1]`` and ``cu_seqlens_padded [B+1]`` (int32, on the data's device; the latter is
    the final boundaries, ``[T]`` when ``B = 0``), ``max_seqlen`` (0-d int32: the longest padded
    segment), ``total`` (T), ``rows`` (B), ``row_len`` (S; None for a layout built from boundaries
    alone, which can shard and unpack but not pack), and ``executor``: a
    :class:`~nn_data.layout.host.HostExecutor` or a :class:`~nn_data.layout.device.DeviceExecutor`, which
    moves the data (``pack``, ``shard``, ``unshard``, ``unpack``).

    A tensor a host executor packed or sharded carries its layout's ``token``, so a method (``shard``,
    ``unshard``, ``unpack``) or an op given it with *another* microbatch's layout refuses
    (:func:`~nn_data.layout.host.check_token`).

    Example::

        >>> r = PackSequences(4)(torch.tensor([[1, 2, 3, 0, 0], [0] * 5, [4, 5, 6, 7, 8]]), torch.tensor([3, 0, 5]))
        >>> r.layout.total, r.layout.cu_seqlens_padded.tolist(), type(r.layout.executor).__name__
        (12, [0, 4, 4, 12], 'HostExecutor')
        >>> r.layout.pack(torch.ones(3, 5, 2)).shape
        torch.Size([1, 12, 2])
    """

    cu_seqlens: Optional[torch.Tensor]
    cu_seqlens_padded: torch.Tensor
    max_seqlen: Optional[torch.Tensor]
    total: int
    rows: int
    row_len: Optional[int]
    executor: Union[HostExecutor, DeviceExecutor]

    @property
    def host(self) -> Optional[HostBounds]:
        """The host executor's ints (:class:`~nn_data.layout.host.HostBounds`), None for a device executor."""
        return self.executor.bounds if isinstance(self.executor, HostExecutor) else None

    @property
    def on_host(self) -> bool:
        """Whether this layout's moves run on its host executor (an op's layout, past :func:`entered`: never
        while ``torch.compile`` traces)."""
        return isinstance(self.executor, HostExecutor)

    @property
    def seq_lengths(self) -> Optional[torch.Tensor]:
        """The ``[B]`` lengths tensor the layout was built from (None: built from boundaries)."""
        return self.executor.seq_lengths

    @property
    def token(self) -> Optional[object]:
        """The fingerprint the tensors this layout's host executor packs carry, or None."""
        return self.executor.token if isinstance(self.executor, HostExecutor) else None

    def pack(self, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """Pack another ``[B, S, *]`` tensor of the same batch into ``[1, T, *]``; padding gets ``fill``
        (a scalar, or a tensor broadcastable to ``x.shape[2:]``: ``torch.arange(topk)`` for routed
        experts, a valid route in every padding row)."""
        _check_packable(self, x)
        layout = entered(self)
        return layout.executor.pack(layout, x, fill)

    def shard(self, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        """This CP rank's zigzag shard ``[1, T, *] -> [1, T/C, *]`` (``packed`` itself when ``C = 1``)."""
        _check_own("packed", packed, self)
        if cp_size == 1:
            return packed
        layout = entered(self)
        return layout.executor.shard(layout, packed, cp_size, cp_rank)

    def unshard(self, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
        """Every rank's shard, rank-major ``[C, T/C, *]``, back to the packed ``[1, T, *]``."""
        _check_own("shards", shards, self)
        if cp_size == 1:
            return shards
        layout = entered(self)
        return layout.executor.unshard(layout, shards, cp_size)

    def unpack(self, packed: torch.Tensor, seq_len, fill=0, shift: int = 0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]`` with ``S = seq_len``: each row's valid tokens, ``fill`` elsewhere
        (``shift=1``: the log-prob layout, token ``s`` from packed position ``start + s - 1``)."""
        _check_own("packed", packed, self)
        if guard_or_false(packed.shape[1] == 0):  # nothing to read: all fill
            out = packed.new_full((self.rows, seq_len, *packed.shape[2:]), fill)
            # + the sum of the empty packed tensor (exactly 0) keeps a backward through an empty microbatch
            return out + packed.sum().to(out.dtype) if packed.requires_grad else out
        layout = entered(self)
        return layout.executor.unpack(layout, packed, seq_len, fill, shift)

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
        statistics. Index maps on the layout's boundary tensors, one gather, no host read on either
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


def entered(layout: PackLayout) -> PackLayout:
    """``layout`` as an op runs it: a host layout entering a region ``torch.compile`` traces becomes a device
    layout on the same boundary tensors (its Python ints would otherwise be baked into the graph); any other
    layout is returned as it is. The one place the executor is chosen for a travelling layout: an op's door
    (:func:`~nn_data.layout.build.take_layout`) and the layout's own methods call it once.

    Example: a host layout of lengths ``[3, 0, 5]`` passed into a compiled function -> a layout with a
    ``DeviceExecutor(seq_lengths)`` and the same ``cu_seqlens_padded``; eagerly, the host layout itself.
    """
    if isinstance(layout.executor, HostExecutor) and torch.compiler.is_compiling():
        return PackLayout(layout.cu_seqlens, layout.cu_seqlens_padded, layout.max_seqlen, layout.total, layout.rows,
                          layout.row_len, DeviceExecutor(layout.executor.seq_lengths))
    return layout


def _check_own(name: str, t, layout: PackLayout) -> None:
    """:func:`~nn_data.layout.host.check_token` where the layout has a token (one a pack made): one without
    (from boundaries, or on the device) may be another view of ``t``'s very microbatch."""
    if layout.token is not None:
        check_token(name, t, layout)


def pack_with_layout(layout: PackLayout, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
    """:meth:`PackLayout.pack`: ``x [B, S, *] -> [1, T, *]``, :class:`~nn_data.errors.PackingError` if ``x``
    is not ``[B, S, *]`` for the layout's ``B`` and ``S`` or lives on another device."""
    return layout.pack(x, fill)


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
