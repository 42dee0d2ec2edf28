"""Wrap a model's forward so it runs on packed, CP-sharded tokens and returns per-sequence rows.

Shape legend
    B   sequences (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to`` when set)
    C   context-parallel size; the model sees ``T/C`` local tokens
    *   the model's trailing output dims (vocab ``V`` for logits)

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B]) -> [B, S, *]``:
pack -> shard for this rank -> position ids + attention metadata -> ``model`` on the
local tokens -> gather across the CP group -> unpack.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.groups import given_group_info
from nn_data.pack import PackSequences, PackShard, check_pack_args
from nn_data.layout import PackLayout, SharedPrefixLayout
from nn_data.masks import PrefixRule
from nn_data import packed_shared_prefix as _shared
from nn_data.planning.alignment import Parallelism
from nn_data.rows import pad_to_row_capacity, with_dynamic_row_length
from nn_data.unpack import check_unpack_args, unpack_sequences


class PackedInfo(NamedTuple):
    """What a wrapped model receives besides its local tokens and position ids.

    ``cu_seqlens_padded [B+1]`` int32 and ``max_seqlen`` (0-d int32) describe the packed
    layout (global, before the CP split); ``segment_ids [T]`` is the sequence of every
    packed position; ``query_index [T/C]`` the packed position of each local token
    (``arange(T)`` without CP); ``cp_size``/``cp_rank`` the split; ``gather`` (None
    without CP) turns a local ``[1, T/C, *]`` tensor into the packed ``[1, T, *]`` (one
    all-gather, autograd-aware: use it for keys and values); ``packed_seq_params`` a
    megatron-core ``PackedSeqParams`` when requested (``max_seqlen_q = T``: the only
    value known without a host sync; ``total_tokens = T/C``, ``cp_group`` the group given to
    :class:`PackedForward`; :func:`nn_data.megatron_parallel.make_packed_seq_params`);
    ``padding_mask [1, T/C]`` bool, True at this rank's padding positions (each segment's slack
    and the extended last segment: :meth:`nn_data.layout.PackLayout.padding_mask`), in the local
    tokens' order: megatron-core's ``GPTModel.forward(padding_mask=)``.
    Two Python-int bounds, known without a host read: ``max_length``, the longest padded segment
    (``max_seqlen``'s value when the layout was built on the host, else ``T``: what a variable-length
    attention kernel's ``max_seqlen`` needs), and ``row_len``, the batch's row length ``S``, which
    bounds every sequence's valid length. ``cu_seqlens [B+1]`` the real (unpadded) boundaries, for a
    model that scores next tokens itself (each sequence's last token has none).
    A shared-prefix call (``prefix_lengths``/``group_ids``, :mod:`nn_data.packed_shared_prefix`) packs
    ``2B`` slots (the boundaries above are theirs) and sets ``prefix`` (the attention's
    :class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors, never sharded), ``prefix_lengths [B]``
    and ``leader [B]`` (the rollout whose prompt slot each rollout's response continues); None otherwise.
    """

    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    segment_ids: torch.Tensor
    query_index: torch.Tensor
    cp_size: int
    cp_rank: int
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]]
    packed_seq_params: object = None
    padding_mask: Optional[torch.Tensor] = None
    max_length: Optional[int] = None
    row_len: Optional[int] = None
    cu_seqlens: Optional[torch.Tensor] = None
    prefix: Optional[PrefixRule] = None
    prefix_lengths: Optional[torch.Tensor] = None
    leader: Optional[torch.Tensor] = None


class PackedInput(NamedTuple):
    """:meth:`PackedForward.prepare`'s result: the model's arguments ``input_ids [1, T/C]``,
    ``position_ids [1, T/C]``, ``packed``, and what :meth:`PackedForward.finish` needs
    (``seq_lengths [R]`` after row padding, the caller's ``rows`` B, ``row_ids [R, S]``, the
    row-padded ids whose dim 1 gives the row length S, a symbolic size under compile, and, eagerly,
    the pack's ``layout``: the output gather and the unpack run on it without reading the
    boundaries again; None from the compiled packing side). A shared-prefix call also keeps its
    ``shared`` layout (eagerly) and ``shared_args`` (``prefix_lengths``, ``group_ids``, ``num_rows``, for
    the compiled unpacking side)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed: PackedInfo
    seq_lengths: torch.Tensor
    rows: int
    row_ids: torch.Tensor
    layout: Optional[PackLayout] = None
    shared: Optional[SharedPrefixLayout] = None
    shared_args: Optional[tuple] = None


class PackedForward(nn.Module):
    """Run ``model`` on packed, context-parallel-sharded tokens; return ``[B, S, *]`` rows.

    ``forward(input_ids [B, S] int, seq_lengths [B] int, prefix_lengths=None, group_ids=None,
    **model_kwargs) -> [B, S, *]``, 0 past each row's length: pack, take this rank's places, position
    ids, ``model`` on the local tokens, gather across ``cp_group`` (None: no CP; ``pg_collection``,
    megatron-core's ``ProcessGroupCollection``, stands for it with its ``cp`` group), unpack.
    With ``prefix_lengths [B]`` and ``group_ids [B]`` (both or neither) each group's prompt is packed
    once and each rollout's row comes back as if it had been run alone; with ``parent [B]`` and
    ``branch_at [B]`` instead, every shared prefix of a rollout tree, at any depth, once
    (:mod:`nn_data.packed_shared_prefix`; the model must honour ``packed.prefix``: both adapters do).

    The model contract: ``model(input_ids [1, T/C], position_ids [1, T/C], packed: PackedInfo,
    **model_kwargs) -> [1, T/C, *]`` for the same local tokens in the same order. Position ids
    restart at 0 at each sequence start; attention must stay inside a segment
    (``packed.segment_ids``) and be causal in packed positions (``packed.query_index``); under CP
    gather keys and values with ``packed.gather``. :class:`nn_data.models.TinyCausalLM` follows it.

    Under CP, ``pad_individual_seqs_to_multiple_of`` and ``pad_full_seq_to`` (or
    ``pad_packed_seq_to_multiple_of`` without it) must be multiples of ``2C`` (checked here, so no
    data check is needed per call). ``compile_packing=True`` compiles the packing and unpacking
    sides with ``fullgraph=True`` (``compile_kwargs`` go to ``torch.compile``); with
    ``pad_full_seq_to`` and ``row_capacity`` set they compile once (two graphs) for a stream of any
    lengths, row counts and row lengths ``S`` (``S`` is a symbolic size:
    :func:`nn_data.rows.with_dynamic_row_length`). The model and the
    collectives run eagerly unless you compile the model yourself.

    Raises :class:`~nn_data.errors.PackingError` for a bad configuration (as the ops, plus the CP
    multiples above), when ``input_ids`` is not ``[B, S]`` or ``seq_lengths`` not a ``[B]`` integer
    tensor on its device (before any compiled region), and when the model does not return
    ``[1, T/C, *]``. Data errors are device-side asserts in the compiled region.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_individual_seqs_to_multiple_of: int = 1,
        pad_full_seq_to: Optional[int] = None,
        pad_packed_seq_to_multiple_of: int = 1,
        cp_group=None,
        pg_collection=None,
        row_capacity: Optional[int] = None,
        compile_packing: bool = False,
        compile_kwargs: Optional[dict] = None,
        make_packed_seq_params: bool = False,
    ):
        super().__init__()
        self.model = model
        pack = PackSequences(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, pad_full_seq_to)
        self.cp_rank, self.cp_size, self._cp_group = given_group_info(cp_group, pg_collection=pg_collection,
                                                                      field="cp")
        _check_cp_config(self.cp_size, pack)
        self.pack_shard = PackShard(pack, self.cp_size, self.cp_rank, positions=True, padding=True)
        self.row_capacity = None if row_capacity is None else _checks.positive_int("row_capacity", row_capacity)
        self.make_packed_seq_params = bool(make_packed_seq_params)
        if self.cp_size > 1:  # outputs: the loss is replicated over the group ("own"); keys/values: "sum"
            self.gather_output = GatherFromContextParallel(self._cp_group, grad_mode="own", validate=False)
            self.gather_kv = GatherFromContextParallel(self._cp_group, grad_mode="sum", validate=False)
        self.compile_packing = bool(compile_packing)
        self.shared_pack_shard = _shared.SharedPrefixPackShard(pack.spec, self.cp_size, self.cp_rank)
        if self.compile_packing:
            kwargs = {"fullgraph": True, **(compile_kwargs or {})}
            self._prepare_fn = torch.compile(self.pack_shard, **kwargs)
            self._finish_fn = torch.compile(_finish, **kwargs)
            self._shared_prepare_fn = torch.compile(self.shared_pack_shard, **kwargs)
            self._shared_finish_fn = torch.compile(_shared.shared_finish, **kwargs)
        else:
            self._prepare_fn, self._finish_fn = self.pack_shard, _finish
            self._shared_prepare_fn, self._shared_finish_fn = self.shared_pack_shard, _shared.shared_finish

    @property
    def pack(self) -> PackSequences:
        return self.pack_shard.pack

    @property
    def cp_group(self):
        """The context-parallel ``ProcessGroup`` the tokens are sharded over (None: no CP)."""
        return self._cp_group

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths=None, group_ids=None,
                parent=None, branch_at=None, **model_kwargs) -> torch.Tensor:
        inp = self.prepare(input_ids, seq_lengths, prefix_lengths=prefix_lengths, group_ids=group_ids, parent=parent,
                           branch_at=branch_at)
        local_out = self.model(inp.input_ids, inp.position_ids, inp.packed, **model_kwargs)  # [1, T/C, *]
        return self.finish(local_out, inp)

    def prepare(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths=None,
                group_ids=None, parent=None, branch_at=None) -> "PackedInput":
        """The first half of :meth:`forward`: pack, shard, position ids and :class:`PackedInfo`
        for ``input_ids [B, S]``, ``seq_lengths [B]`` (and ``prefix_lengths``/``group_ids``, a
        shared-prefix call), without calling the model. For a caller
        that drives the model itself (a pipeline schedule: only the last stage outputs
        ``[1, T/C, *]``); :meth:`finish` turns that output into rows."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise _checks.PackingError(f"input_ids must be a [B, S] tensor, got {shape}")
        shared = any(t is not None for t in (prefix_lengths, group_ids, parent, branch_at))
        if shared:  # a rollout tree (parent, branch_at) or its depth-1 spelling (prefix_lengths, group_ids)
            prefix_lengths, group_ids, tree = _shared.check_shared_args(input_ids, seq_lengths, prefix_lengths,
                                                                        group_ids, parent, branch_at)
        rows = input_ids.shape[0]
        num_rows = None
        if self.row_capacity is not None:
            padded = pad_to_row_capacity(input_ids, seq_lengths, self.row_capacity, name="row_capacity")
            input_ids, seq_lengths, num_rows = padded
            if shared:
                pad = _shared.pad_tree_rows if tree else _shared.pad_shared_rows
                prefix_lengths, group_ids = pad(prefix_lengths, group_ids, self.row_capacity)
        if shared:
            return self._prepare_shared(input_ids, seq_lengths, prefix_lengths, group_ids, num_rows, rows, tree)
        if self.compile_packing:  # metadata errors raise PackingError here, before the compiled region
            check_pack_args(input_ids, seq_lengths, num_rows)
            input_ids = with_dynamic_row_length(input_ids)  # one graph for every S, 0 and 1 included
        prep = self._prepare_fn(input_ids, seq_lengths, num_rows)  # PackShardResult
        cu_pad, layout = prep.pack.cu_seqlens_padded, prep.pack.layout
        gather_kv = self._kv_gather(layout, cu_pad)
        total = prep.segment_ids.shape[0]
        longest = layout.host.max_seqlen if layout is not None and layout.host is not None else total
        info = PackedInfo(
            cu_pad, prep.pack.max_seqlen, prep.segment_ids, prep.places.source,
            self.cp_size, self.cp_rank, gather_kv, self._packed_seq_params(cu_pad, total), prep.padding_mask,
            max_length=longest, row_len=int(input_ids.shape[1]), cu_seqlens=prep.pack.cu_seqlens,
        )
        return PackedInput(prep.local["x"], prep.positions, info, seq_lengths, rows, input_ids, layout)

    def _kv_gather(self, layout: Optional[PackLayout], cu_pad: torch.Tensor):
        """``PackedInfo.gather`` (None without CP): on the layout when there is one (no read of the
        boundaries), else on the boundaries."""
        if self.cp_size == 1:
            return None

        def gather_kv(local: torch.Tensor) -> torch.Tensor:
            if layout is not None:
                return self.gather_kv(local, layout=layout)  # [1, T/C, *] -> [1, T, *]
            return self.gather_kv(local, cu_pad)  # [1, T/C, *] -> [1, T, *]
        return gather_kv

    def _prepare_shared(self, input_ids, seq_lengths, prefix_lengths, group_ids, num_rows, rows,
                        tree=False) -> "PackedInput":
        """:meth:`prepare` for a shared-prefix call (:class:`~nn_data.packed_shared_prefix.SharedPrefixPackShard`)."""
        if self.compile_packing:  # metadata errors raise PackingError here, before the compiled region
            check_pack_args(input_ids, seq_lengths, num_rows)
            input_ids = with_dynamic_row_length(input_ids)  # one graph for every S
        prep = self._shared_prepare_fn(input_ids, seq_lengths, prefix_lengths, group_ids, num_rows, tree)
        layout = None if prep.shared is None else prep.shared.layout
        gather_kv = self._kv_gather(layout, prep.cu_seqlens_padded)
        total = prep.segment_ids.shape[0]
        longest = layout.host.max_seqlen if layout is not None and layout.host is not None else total
        info = PackedInfo(
            prep.cu_seqlens_padded, prep.max_seqlen, prep.segment_ids, prep.query_index, self.cp_size, self.cp_rank,
            gather_kv, self._packed_seq_params(prep.cu_seqlens_padded, total), prep.padding_mask,
            max_length=longest, row_len=int(input_ids.shape[1]), cu_seqlens=prep.cu_seqlens, prefix=prep.prefix,
            prefix_lengths=prep.prefix_lengths, leader=prep.leader,
        )
        return PackedInput(prep.input_ids, prep.positions, info, seq_lengths, rows, input_ids, layout, prep.shared,
                           (prefix_lengths, group_ids, num_rows, tree))

    def finish(self, local_out: torch.Tensor, inp: "PackedInput") -> torch.Tensor:
        """The second half of :meth:`forward`: the model's ``[1, T/C, *]`` output for ``inp``
        (from :meth:`prepare`) -> gathered over the CP group -> rows ``[B, S, *]``."""
        _check_model_output(local_out, inp.input_ids)
        if inp.shared_args is not None:
            return self._finish_shared(local_out, inp)
        cu_pad = inp.packed.cu_seqlens_padded
        if inp.layout is not None:  # eager: the pack's layout, no read of the boundaries
            full = local_out if self.cp_size == 1 else self.gather_output(local_out, layout=inp.layout)  # [1, T, *]
            return unpack_sequences(full, None, None, inp.row_ids.shape[1], layout=inp.layout)[: inp.rows]
        full = local_out if self.cp_size == 1 else self.gather_output(local_out, cu_pad)  # [1, T, *]
        if self.compile_packing:  # metadata errors before the compiled region
            check_unpack_args(full, inp.seq_lengths, cu_pad)
        out = self._finish_fn(full, inp.seq_lengths, cu_pad, inp.row_ids)  # [R, S, *]
        return out[: inp.rows]

    def _finish_shared(self, local_out: torch.Tensor, inp: "PackedInput") -> torch.Tensor:
        """:meth:`finish` for a shared-prefix call: rollout b's row as if it had been packed alone."""
        if inp.shared is not None:  # eager: the layout, no read of the boundaries
            full = local_out if self.cp_size == 1 else self.gather_output(local_out, layout=inp.shared.layout)
            return inp.shared.unpack(full, inp.row_ids.shape[1])[: inp.rows]  # [1, T, *] -> [B, S, *]
        full = local_out if self.cp_size == 1 else self.gather_output(local_out, inp.packed.cu_seqlens_padded)
        prefix_lengths, group_ids, num_rows, tree = inp.shared_args
        out = self._shared_finish_fn(full, inp.seq_lengths, prefix_lengths, group_ids, inp.row_ids, self.pack.spec,
                                     num_rows, tree)  # [R, S, *]
        return out[: inp.rows]

    def _packed_seq_params(self, cu_seqlens_padded: torch.Tensor, total: int):
        if not self.make_packed_seq_params:
            return None
        from nn_data.megatron_parallel import make_packed_seq_params

        # max_seqlen = T: the only bound known without a host sync
        return make_packed_seq_params(cu_seqlens_padded, total, total // self.cp_size, total=total,
                                      cp_group=self._cp_group)


def _finish(full: torch.Tensor, seq_lengths: torch.Tensor, cu_pad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Unpack ``full [1, T, *]`` to ``[R, S, *]`` with ``S = like.shape[1]`` (the packed batch's
    ``[R, S]`` ids): ``S`` arrives as a tensor size, symbolic under compile, not as an int argument
    (which the compiler would specialise, 0 and 1 always)."""
    return unpack_sequences(full, seq_lengths, cu_pad, like.shape[1])


def _check_model_output(out, local_ids: torch.Tensor) -> None:
    """The model must return ``[1, T/C, *]`` for the ``[1, T/C]`` local tokens it was given."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or tuple(out.shape[:2]) != tuple(local_ids.shape):
        shape = _checks.dims(out) if isinstance(out, torch.Tensor) else type(out).__name__
        raise _checks.PackingError(
            f"the model returned {shape}; it must return [1, T/C, *] = [1, {local_ids.shape[1]}, *] for the "
            f"local tokens it was given (see PackedForward's model contract)"
        )


def _check_cp_config(cp_size: int, pack: PackSequences) -> None:
    """Under CP every segment, the extended last one too, must split into ``2C`` chunks:
    guaranteed by configuration so that no data check (and no sync) is needed per call."""
    if cp_size == 1:
        return
    layout = Parallelism(dp=1, cp=cp_size)  # the one alignment rule: 2C per sequence and per total
    two_c = layout.sequence_multiple
    total_unit = pack.pad_full_seq_to if pack.pad_full_seq_to is not None else pack.p
    if pack.m % two_c or total_unit % layout.total_multiple:
        what = "pad_full_seq_to" if pack.pad_full_seq_to is not None else "pad_packed_seq_to_multiple_of"
        raise _checks.PackingError(
            f"with cp_size={cp_size}, pad_individual_seqs_to_multiple_of={pack.m} and {what}={total_unit} "
            f"must be multiples of 2*cp_size={two_c} so that every segment splits into {two_c} chunks"
        )
