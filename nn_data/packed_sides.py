"""The two sides of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline, the plain kind of
microbatch, and the records a wrapped model receives (:class:`PackedInfo`).

Shape legend
    B   sequences (rows); R >= B with ``row_capacity``; N packed segments (B, or a tree's node slots)
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to`` when set)
    C   context-parallel size; the model sees ``T/C`` local tokens
    *   the model's trailing output dims (vocab ``V`` for logits)

The packing side (:class:`PackingSide`) is nn_data's one pack-and-shard runtime: every caller
(``PackedForward``, staging, dynamic CP's rounds, the pipeline step, the NeMo-RL drop-in) hands it a kind of
microbatch and gets the finished :class:`PackedInfo`: it builds the layout, packs the ids and the tensors that
ride them (companions), takes this rank's places and the position ids, segment ids and padding mask; the
caller adds only its own parts (:meth:`PackedInfo.finished`: the CP gather, ``PackedSeqParams``). The unpacking side (:class:`UnpackingSide`)
turns the gathered ``[1, T, *]`` output back into ``[R, S, *]`` rows in a compiled call. What differs
between kinds of microbatch is a strategy (:class:`MicrobatchKind`): :class:`PlainKind` here,
:class:`~nn_data.packed_tree.TreeKind` beside it (GRPO groups are its depth-1 tree, converted where they
enter: :func:`~nn_data.layout.shared_prefix_layout`).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Protocol

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import PackLayout, PackSpec, layout_from_lengths
from nn_data.layout.internal import ZigzagLocal, checks as layout_checks
from nn_data.unpack import unpack_sequences

class PackedBounds(NamedTuple):
    """The packed layout's boundaries, global (before the CP split): ``cu_seqlens_padded [N+1]`` int32
    (``N`` segments: B, or a tree microbatch's node slots), ``max_seqlen`` (0-d int32, the
    longest padded segment), ``cu_seqlens [N+1]`` the real (unpadded) boundaries, for a model that scores
    next tokens itself (each sequence's last token has none). Two Python-int bounds, known without a host
    read: ``max_length``, the longest padded segment (``max_seqlen``'s value when the layout was built on
    the host, else ``T``: what a variable-length attention kernel's ``max_seqlen`` needs), and ``row_len``,
    the batch's row length ``S``, which bounds every sequence's valid length.

    Example: lengths ``[3, 0, 5]``, m 4, T 16 -> cu_seqlens ``[0, 3, 3, 8]``, cu_seqlens_padded
    ``[0, 4, 4, 16]``, max_seqlen 12, max_length 12 (eager) or 16 (compiled).
    """

    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    max_length: Optional[int] = None
    row_len: Optional[int] = None


class CPShare(NamedTuple):
    """This rank's share of the context-parallel group: ``size`` C, ``rank``, and ``gather`` (None without
    CP), which turns a local ``[1, T/C, *]`` tensor into the packed ``[1, T, *]`` (one all-gather,
    autograd-aware: use it for keys and values)."""

    size: int = 1
    rank: int = 0
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


class PackedInfo(NamedTuple):
    """What a wrapped model receives besides its local tokens and position ids.

    ``bounds`` (:class:`PackedBounds`: the boundaries, global); ``segment_ids [T]`` the segment of every
    packed position; ``query_index [T/C]`` the packed position of each local token (``arange(T)``
    without CP); ``cp`` (:class:`CPShare`: size, rank and the keys' and values' ``gather``);
    ``padding_mask [1, T/C]`` bool, True at this rank's padding positions (each segment's slack and the
    extended last segment: :meth:`nn_data.layout.PackLayout.padding_mask`), in the local tokens' order:
    megatron-core's ``GPTModel.forward(padding_mask=)``; ``packed_seq_params`` a megatron-core
    ``PackedSeqParams`` when requested (``max_seqlen_q = T``: the only value known without a host sync;
    ``total_tokens = T/C``, ``cp_group`` the group given to :class:`~nn_data.packed_forward.PackedForward`;
    :func:`nn_data.megatron_parallel.make_packed_seq_params`); ``prefix`` (:class:`~nn_data.packed_tree.TreeInfo`)
    for a tree microbatch (whose node slots the boundaries are), None otherwise. The 0.1.x names
    ``cu_seqlens_padded``, ``max_seqlen`` (the bounds'), ``cp_size``, ``cp_rank`` and ``gather`` (the CP
    share's) read the same values.
    """

    bounds: PackedBounds
    segment_ids: torch.Tensor
    query_index: torch.Tensor
    cp: CPShare = CPShare()
    padding_mask: Optional[torch.Tensor] = None
    packed_seq_params: object = None
    prefix: Optional[tuple] = None  # the kind's record: TreeInfo

    def finished(self, *, gather=None, packed_seq_params=None, row_len=None, max_length=None) -> "PackedInfo":
        """This record with the caller's parts: the keys' and values' CP ``gather``, ``packed_seq_params``
        and, where given, the bounds' ``row_len`` and ``max_length``. Built by the class (torch 2.11's dynamo
        cannot return what ``_replace`` makes)."""
        b = self.bounds
        bounds = PackedBounds(b.cu_seqlens_padded, b.max_seqlen, b.cu_seqlens,
                              b.max_length if max_length is None else max_length,
                              b.row_len if row_len is None else row_len)
        return PackedInfo(bounds, self.segment_ids, self.query_index, CPShare(self.cp.size, self.cp.rank, gather),
                          self.padding_mask, packed_seq_params, self.prefix)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        return self.bounds.cu_seqlens_padded

    @property
    def max_seqlen(self) -> torch.Tensor:
        return self.bounds.max_seqlen

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def gather(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        return self.cp.gather


class Shard(NamedTuple):
    """One tensor of a batch packed and sharded: ``full [1, T, *]`` and this rank's ``local [1, T/C, *]``
    (``full`` itself when ``C = 1``)."""

    full: torch.Tensor
    local: torch.Tensor


class PackedSide(NamedTuple):
    """What the packing side returns (:class:`PackingSide`): this rank's ``input_ids`` and ``position_ids``
    ``[1, T/C]``, the :class:`PackedInfo` before the caller's parts (:meth:`PackedInfo.finished`), eagerly the
    ``layout`` (None out of a compiled graph), the packed ids ``packed_ids [1, T]``, the ``companions`` by
    name (each a :class:`Shard`) and this rank's ``places`` (:class:`~nn_data.layout.internal.ZigzagLocal`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed: PackedInfo
    layout: object = None
    packed_ids: Optional[torch.Tensor] = None
    companions: Optional[dict] = None
    places: Optional[ZigzagLocal] = None


class MicrobatchKind(Protocol):
    """What a kind of microbatch brings to :class:`~nn_data.packed_forward.PackedForward`'s one pipeline (the
    strategy); the pipeline itself (row padding, the packing side, the CP gathers, the unpack) is the same for
    every kind. :class:`PlainKind` (one segment per row) and
    :class:`~nn_data.packed_tree.TreeKind` (every shared prefix once, GRPO groups its depth-1 tree) are two; a new kind of microbatch is a new strategy listed in
    ``nn_data.packed_forward.KINDS``.

    ``name``: how messages name it. ``pad_rows(args, capacity)``: its own per-row arguments padded to the row
    capacity. ``layout(input_ids, seq_lengths, args, *, spec, num_rows, validate, host_reads)``: the
    microbatch's layout, with ``pack(x)``, ``segment_ids()`` and ``unpack(packed, seq_len)`` as
    :class:`~nn_data.layout.PackLayout` has them; ``slots(layout)``: the :class:`~nn_data.layout.PackLayout`
    its tokens are sharded, gathered and padded on; ``positions(layout, places)``: this rank's position ids
    ``[1, T/C]``; ``attention(layout)``: its record for ``PackedInfo.prefix`` (None for none);
    ``unpack(full, ...)``: the compiled unpacking side, from the lengths and boundaries.
    """

    name: str

    def pad_rows(self, args, capacity: int): ...

    def layout(self, input_ids, seq_lengths, args, *, spec, num_rows, validate=True, host_reads=True): ...

    def slots(self, layout) -> PackLayout: ...

    def positions(self, layout, places) -> torch.Tensor: ...

    def attention(self, layout) -> Optional[tuple]: ...

    def unpack(self, full, *, seq_lengths, cu_seqlens_padded, args, num_rows, like, spec) -> torch.Tensor: ...


class PlainKind:
    """The plain microbatch: one packed segment per row (no arguments of its own).

    Example: lengths ``[3, 0, 5]``, m 4 -> segments ``[0, 4, 4, 12]``; this rank's positions restart at
    each segment start: places ``0..3, 4..11`` -> positions ``0..3, 0..7``.
    """

    name = "plain"

    def pad_rows(self, args, capacity: int):
        return args

    def layout(self, input_ids, seq_lengths, args, *, spec, num_rows, validate=True, host_reads=True) -> PackLayout:
        return layout_from_lengths(seq_lengths, input_ids.shape[1], spec, num_rows=num_rows, validate=validate,
                                   host_reads=host_reads)

    def slots(self, layout: PackLayout) -> PackLayout:
        return layout

    def positions(self, layout: PackLayout, places) -> torch.Tensor:
        return local_positions(layout, places)  # [1, T/C]: 0 at each sequence start

    def attention(self, layout: PackLayout) -> None:
        return None

    def unpack(self, full, *, seq_lengths, cu_seqlens_padded, args, num_rows, like, spec) -> torch.Tensor:
        """The compiled unpacking side: on the boundaries the packing side computed (``T = full.shape[1]``,
        no rebuild from the lengths, which would need ``T``)."""
        return unpack_sequences(full, seq_lengths, cu_seqlens_padded, like.shape[1])


PLAIN = PlainKind()


class PackingSide(nn.Module):
    """The one pack-and-shard runtime, for one kind of microbatch (the region ``compile_packing=True``
    compiles): build the layout, pack the ids and the companions, take this CP rank's places, and the
    position ids, segment ids, padding mask and the kind's attention record of :class:`PackedInfo`.

    ``PackingSide(spec, cp_size=1, cp_rank=0, *, kind=PLAIN, routes=(), validate=True, host_reads=True)``;
    ``forward(input_ids [R, S], seq_lengths [R], num_rows=None, args=None, **companions) -> PackedSide``.
    Every companion (``[R, S, *]`` or None, skipped) is packed on the ids' layout with 0 padding, except those
    named in ``routes``, whose padding rows are ``arange(last dim)`` (a valid top-k route for routed experts).
    Eagerly with ``host_reads`` the layout is built on the host after one read; otherwise, and under
    ``torch.compile``, on the device (no read); ``validate=False`` skips the data checks.
    """

    def __init__(self, spec: PackSpec, cp_size: int = 1, cp_rank: int = 0, *, kind: MicrobatchKind = PLAIN,
                 routes=(), validate: bool = True, host_reads: bool = True):
        super().__init__()
        _checks.check_cp(cp_size, cp_rank)
        self.kind, self.spec, self.cp_size, self.cp_rank = kind, spec, cp_size, cp_rank
        self.routes, self.validate, self.host_reads = frozenset(routes), bool(validate), bool(host_reads)

    def extra_repr(self) -> str:
        return f"kind={self.kind.name}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, routes={sorted(self.routes)}"

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, num_rows: Optional[torch.Tensor] = None,
                args=None, **companions: Optional[torch.Tensor]) -> PackedSide:
        kind = self.kind
        layout = kind.layout(input_ids, seq_lengths, args, spec=self.spec, num_rows=num_rows, validate=self.validate,
                             host_reads=self.host_reads)
        slots = kind.slots(layout)
        if self.validate and self.cp_size > 1 and slots.host is not None:
            layout_checks.segments_host(slots.host.segments, self.cp_size)  # each splits into 2C zigzag chunks
        places = slots.local_places(self.cp_size, self.cp_rank)  # [T/C] each, once for every tensor
        packed = layout.pack(input_ids)  # [1, T]
        local = packed if self.cp_size == 1 else packed.index_select(1, places.source)  # [1, T] -> [1, T/C]
        full, shards = pack_shard(layout, companions, cp_size=self.cp_size, cp_rank=self.cp_rank, routes=self.routes,
                                  source=places.source)
        compiling = torch.compiler.is_compiling()
        longest = slots.host.max_seqlen if slots.host is not None and not compiling else slots.total
        bounds = PackedBounds(cu_seqlens_padded=slots.cu_seqlens_padded, max_seqlen=slots.max_seqlen,
                              cu_seqlens=slots.cu_seqlens, max_length=longest)
        # without CP this rank's places are every position in order: their segments are the segment ids (one scan)
        segment_ids = places.segment if self.cp_size == 1 and slots is layout else layout.segment_ids()  # [T]
        info = PackedInfo(bounds=bounds, segment_ids=segment_ids, query_index=places.source,
                          cp=CPShare(size=self.cp_size, rank=self.cp_rank),
                          padding_mask=slots.padding_mask(places=places), prefix=kind.attention(layout))
        return PackedSide(input_ids=local, position_ids=kind.positions(layout, places), packed=info,
                          layout=None if compiling else layout, packed_ids=packed,
                          companions={name: Shard(full[name], shards[name]) for name in full}, places=places)


def local_positions(layout: PackLayout, places: ZigzagLocal) -> torch.Tensor:
    """``[1, T/C]`` position ids of this rank's places: the offset of each in its segment (0 at each sequence
    start). Example: bounds ``[0, 16, 40]``, C 2, rank 0 -> source ``0..3, 12..15, 16..21, 34..39`` ->
    positions ``0..3, 12..15, 0..5, 18..23``."""
    bounds = layout.bounds()  # [B+1] ([0, T] if B = 0)
    return (places.source - bounds[places.segment]).unsqueeze(0)  # [T/C] -> [1, T/C]


def pack_shard(layout, tensors: Mapping[str, Optional[torch.Tensor]], *, cp_size: int, cp_rank: int,
               routes=frozenset(), source: Optional[torch.Tensor] = None) -> tuple[dict, dict]:
    """``(full, local)``: each tensor of ``tensors`` (``[B, S, *]``; None skipped) packed along ``layout``
    (``[1, T, *]``) and this rank's shard of it (``[1, T/C, *]``; the packed tensor itself when ``C = 1``).
    Padding is 0, except for the names in ``routes``, whose padding rows are ``arange(last dim)``.
    ``source`` (``[T/C]``, this rank's places) shards with one ``index_select``; without it ``layout.shard``
    picks the executor (on the host: cuts by Python ints)."""
    full, local = {}, {}
    for name, x in tensors.items():
        if x is None:
            continue
        fill = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype) if name in routes else 0  # [topk]
        full[name] = layout.pack(x, fill)  # [1, T, *]
        if cp_size == 1:
            local[name] = full[name]
        elif source is not None:
            local[name] = full[name].index_select(1, source)  # [1, T/C, *]
        else:
            local[name] = layout.shard(full[name], cp_size, cp_rank)  # [1, T/C, *]
    return full, local


class UnpackingSide(nn.Module):
    """:class:`~nn_data.packed_forward.PackedForward`'s compiled unpacking side for one kind of microbatch: ``full [1,
    T, *]`` back to ``[R, S, *]`` rows from the lengths and boundaries (the layout's index maps stayed in the
    packing graph). ``forward(full, seq_lengths, cu_seqlens_padded, like [R, S], num_rows=None, args=None)``."""

    def __init__(self, kind: MicrobatchKind, spec: PackSpec):
        super().__init__()
        self.kind, self.spec = kind, spec

    def forward(self, full: torch.Tensor, seq_lengths: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                like: torch.Tensor, num_rows: Optional[torch.Tensor] = None, args=None) -> torch.Tensor:
        return self.kind.unpack(full, seq_lengths=seq_lengths, cu_seqlens_padded=cu_seqlens_padded, args=args,
                                num_rows=num_rows, like=like, spec=self.spec)  # [R, S, *]
