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

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks, compile_cache
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.groups import given_group_info
from nn_data.pack import PackSequences, check_pack_args
from nn_data.layout import PackLayout
from nn_data.model_check import ModelGuard
from nn_data.packed_tree import TREE, TreeInfo, tree_args
from nn_data.packed_sides import (CPShare, MicrobatchKind, PackedBounds, PackedInfo, PackingSide, PLAIN,
                                  UnpackingSide)
from nn_data.planning.alignment import Parallelism
from nn_data.rows import pad_to_row_capacity, with_dynamic_row_length

# the records a wrapped model receives, at the door of the pipeline that makes them
__all__ = ["KINDS", "CPShare", "Microbatch", "PackedBounds", "PackedForward", "PackedInfo", "PackedInput",
           "TreeInfo", "microbatch_kind"]


class PackedInput(NamedTuple):
    """:meth:`PackedForward.prepare`'s result: the model's arguments ``input_ids [1, T/C]``,
    ``position_ids [1, T/C]``, ``packed``, and what :meth:`PackedForward.finish` needs: ``seq_lengths [R]``
    after row padding, the caller's ``rows`` B, ``row_ids [R, S]`` (the row-padded ids, whose dim 1 gives
    the row length S, a symbolic size under compile) and the ``microbatch`` (:class:`Microbatch`: its kind,
    its own arguments and, eagerly, its layout)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed: PackedInfo
    seq_lengths: torch.Tensor
    rows: int
    row_ids: torch.Tensor
    microbatch: "Microbatch"

    @property
    def layout(self):
        """The microbatch's layout built by the packing side: a :class:`~nn_data.layout.PackLayout`, or the
        kind's own (a :class:`~nn_data.layout.TreeLayout`); None from a compiled packing side (its
        index maps stay inside the graph: :meth:`PackedForward.layout_of` builds it again, with no read)."""
        return self.microbatch.layout


class Microbatch(NamedTuple):
    """One call's kind of microbatch (:class:`~nn_data.packed_sides.PlainKind`,
    :class:`~nn_data.packed_tree.TreeKind`), its own per-row arguments ``args`` (None for
    a plain microbatch; row-padded), ``num_rows`` (0-d, with ``row_capacity``; else None) and, eagerly, the
    ``layout`` the packing side built (None out of a compiled graph)."""

    kind: "MicrobatchKind"
    args: Optional[tuple]
    num_rows: Optional[torch.Tensor]
    layout: object = None


#: The kinds of microbatch :class:`PackedForward` serves (a new kind is a new strategy here).
KINDS = (PLAIN, TREE)


class PackedForward(nn.Module):
    """Run ``model`` on packed, context-parallel-sharded tokens; return ``[B, S, *]`` rows.

    ``forward(input_ids [B, S] int, seq_lengths [B] int, prefix_lengths=None, group_ids=None, parent=None,
    branch_at=None, **model_kwargs) -> [B, S, *]``, 0 past each row's length: pack, take this rank's places, position
    ids, ``model`` on the local tokens, gather across ``cp_group`` (None: no CP; ``pg_collection``,
    megatron-core's ``ProcessGroupCollection``, stands for it with its ``cp`` group), unpack.
    With ``prefix_lengths [B]`` and ``group_ids [B]`` (both or neither) each group's prompt is packed
    once and each rollout's row comes back as if it had been run alone; with ``parent [B]`` and
    ``branch_at [B]`` instead, every shared prefix of a rollout tree, at any depth, once
    (:mod:`nn_data.packed_tree`; the model must honour ``packed.prefix``: both adapters do).
    One pipeline serves all three: what differs is the kind of microbatch (:class:`MicrobatchKind`).

    The model contract: ``model(input_ids [1, T/C], position_ids [1, T/C], packed: PackedInfo,
    **model_kwargs) -> [1, T/C, *]`` for the same local tokens in the same order. Position ids
    restart at 0 at each sequence start; attention must stay inside a segment
    (``packed.segment_ids``) and be causal in packed positions (``packed.query_index``); under CP
    gather keys and values with ``packed.gather``. :class:`nn_data.models.TinyCausalLM` follows it.

    Under CP, ``pad_individual_seqs_to_multiple_of`` and ``pad_full_seq_to`` (or
    ``pad_packed_seq_to_multiple_of`` without it) must be multiples of ``2C`` (checked here, so no
    data check is needed per call). ``compile_packing=True`` compiles the packing and unpacking
    sides with ``fullgraph=True`` (``compile_kwargs`` go to ``torch.compile``), each kind of microbatch's
    on its first call (announced on stderr: a first compile takes seconds to minutes); with
    ``pad_full_seq_to`` and ``row_capacity`` set they compile once (two graphs) for a stream of any
    lengths, row counts and row lengths ``S`` (``S`` is a symbolic size:
    :func:`nn_data.rows.with_dynamic_row_length`). The model and the
    collectives run eagerly unless you compile the model yourself (docs/compile-contract.md).

    ``verify`` (:class:`~nn_data.model_check.ModelGuard`): ``True``/``"first"`` (default) proves the model
    keeps packed sequences apart on its first call (a small microbatch of its own, docs/models.md) and
    again when the model changes; ``N`` also checks every Nth microbatch itself (a different sequence changed and
    one alone each time: both directions); ``False`` skips both.

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
        verify=True,
    ):
        super().__init__()
        self.model = model
        self.guard = ModelGuard(verify)  # the packing check (nn_data.model_check): first call, and on a change
        self.pack = PackSequences(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, pad_full_seq_to)
        self.cp_rank, self.cp_size, self._cp_group = given_group_info(cp_group, pg_collection=pg_collection,
                                                                      field="cp")
        _check_cp_config(self.cp_size, self.pack)
        self.row_capacity = None if row_capacity is None else _checks.positive_int("row_capacity", row_capacity)
        self.make_packed_seq_params = bool(make_packed_seq_params)
        if self.cp_size > 1:  # outputs: the loss is replicated over the group ("own"); keys/values: "sum"
            self.gather_output = GatherFromContextParallel(self._cp_group, grad_mode="own", validate=False,
                                                           host_reads=False)
            self.gather_kv = GatherFromContextParallel(self._cp_group, grad_mode="sum", validate=False,
                                                        host_reads=False)
        self.compile_packing = bool(compile_packing)
        kwargs = {"fullgraph": True, **(compile_kwargs or {})}
        spec = self.pack.spec
        self._sides = {}  # (kind name, "pack" | "unpack") -> the side; torch.compile compiles on the first call
        for kind in KINDS:
            for which, side in (("pack", PackingSide(spec, self.cp_size, self.cp_rank, kind=kind)),
                                ("unpack", UnpackingSide(kind, spec))):
                # the bound forward, not the module: no module call machinery (nor its hook guards) per call
                self._sides[kind.name, which] = torch.compile(side.forward, **kwargs) if self.compile_packing else side
        self._compiled: set = set()  # the sides whose first call was announced

    @property
    def cp_group(self):
        """The context-parallel ``ProcessGroup`` the tokens are sharded over (None: no CP)."""
        return self._cp_group

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths=None, group_ids=None,
                parent=None, branch_at=None, **model_kwargs) -> torch.Tensor:
        taken = [k for k in ("position_ids", "packed") if k in model_kwargs]
        if taken:  # the adapter's own arguments, made from the layout
            raise _checks.PackingError(f"{taken[0]}= is made by PackedForward from the packed layout and passed to the adapter "
                               f"itself; leave out {', '.join(taken)} (model keywords pass through to the model)")
        verify = self.guard.before(self, input_ids) and all(
            t is None for t in (prefix_lengths, group_ids, parent, branch_at))
        inp = self.prepare(input_ids, seq_lengths, prefix_lengths=prefix_lengths, group_ids=group_ids, parent=parent,
                           branch_at=branch_at)
        local_out = self.model(inp.input_ids, inp.position_ids, inp.packed, **model_kwargs)  # [1, T/C, *]
        out = self.finish(local_out, inp)
        if verify:  # verify=N: this microbatch run again, with a sequence changed and one alone
            self.guard.after(self, input_ids, seq_lengths, **model_kwargs)
        return out

    def prepare(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths=None,
                group_ids=None, parent=None, branch_at=None) -> PackedInput:
        """The first half of :meth:`forward`: pack, shard, position ids and :class:`PackedInfo`
        for ``input_ids [B, S]``, ``seq_lengths [B]`` (and ``prefix_lengths``/``group_ids``, a
        shared-prefix call, or ``parent``/``branch_at``, a rollout tree), without calling the model. For a caller
        that drives the model itself (a pipeline schedule: only the last stage outputs
        ``[1, T/C, *]``); :meth:`finish` turns that output into rows."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise _checks.PackingError(f"input_ids must be a [B, S] tensor, got {shape}")
        if not isinstance(seq_lengths, torch.Tensor):  # a list, tuple or numpy array of ints: one copy
            seq_lengths = _checks.as_int_vector("seq_lengths", seq_lengths, input_ids.shape[0]).to(input_ids.device)
        # the per-rollout arguments likewise (find_rollout_tree gives numpy): each one copy to the ids' device
        given = {"prefix_lengths": prefix_lengths, "group_ids": group_ids, "parent": parent, "branch_at": branch_at}
        given = {k: v if v is None or isinstance(v, torch.Tensor)
                 else _checks.as_int_vector(k, v, input_ids.shape[0]).to(input_ids.device) for k, v in given.items()}
        prefix_lengths, group_ids, parent, branch_at = given.values()
        kind, args = microbatch_kind(input_ids, seq_lengths, prefix_lengths=prefix_lengths, group_ids=group_ids,
                                     parent=parent, branch_at=branch_at)
        rows, num_rows = input_ids.shape[0], None
        if self.row_capacity is not None:
            input_ids, seq_lengths, num_rows = pad_to_row_capacity(input_ids, seq_lengths, self.row_capacity,
                                                                   name="row_capacity")
            args = kind.pad_rows(args, self.row_capacity)
        check_pack_args(input_ids, seq_lengths, num_rows)  # metadata errors before any compiled region
        if self.compile_packing:
            input_ids = with_dynamic_row_length(input_ids)  # one graph for every S, 0 and 1 included
        side = self._side(kind, "pack")(input_ids, seq_lengths, num_rows, args)
        info = side.packed
        gather_kv = self._kv_gather(None if side.layout is None else kind.slots(side.layout), info.cu_seqlens_padded)
        total = info.segment_ids.shape[0]
        info = info.finished(gather=gather_kv, packed_seq_params=self._packed_seq_params(info.cu_seqlens_padded, total),
                             row_len=_row_len(input_ids))
        return PackedInput(input_ids=side.input_ids, position_ids=side.position_ids, packed=info,
                           seq_lengths=seq_lengths, rows=rows, row_ids=input_ids,
                           microbatch=Microbatch(kind=kind, args=args, num_rows=num_rows, layout=side.layout))

    def finish(self, local_out: torch.Tensor, inp: PackedInput) -> torch.Tensor:
        """The second half of :meth:`forward`: the model's ``[1, T/C, *]`` output for ``inp``
        (from :meth:`prepare`) -> gathered over the CP group -> rows ``[B, S, *]``."""
        _check_model_output(local_out, inp.input_ids)
        mb = inp.microbatch
        if mb.layout is not None:  # eager: the packing side's layout, no read of the boundaries
            full = local_out if self.cp_size == 1 else self.gather_output(local_out, layout=mb.kind.slots(mb.layout))
            return mb.layout.unpack(full, inp.row_ids.shape[1])[: inp.rows]  # [1, T, *] -> [B, S, *]
        cu_pad = inp.packed.cu_seqlens_padded
        full = local_out if self.cp_size == 1 else self.gather_output(local_out, cu_pad)  # [1, T, *]
        out = self._side(mb.kind, "unpack")(full, inp.seq_lengths, cu_pad, inp.row_ids, mb.num_rows, mb.args)
        return out[: inp.rows]  # [R, S, *] -> [B, S, *]

    def layout_of(self, inp: PackedInput):
        """The layout of ``inp``'s microbatch: the packing side's (eager), else built again from the lengths on
        the device (``compile_packing=True``, where the packing graph keeps its index maps), with no host read
        when ``pad_full_seq_to`` is set (else one, for ``T``). For what needs the layout beside the model's
        output, e.g. a shared-prefix microbatch's
        log-probs without ``[B, S, V]`` logits::

            inp = wrapped.prepare(ids, lengths, prefix_lengths=P, group_ids=g)
            logits = model(inp.input_ids, inp.position_ids, inp.packed)          # [1, T/C, V]
            shared = wrapped.layout_of(inp)                                      # a TreeLayout
            logprobs = TreeLogProbs()(logits, shared.pack(inp.row_ids), shared)[: inp.rows]
        """
        mb = inp.microbatch
        if mb.layout is not None:
            return mb.layout
        return mb.kind.layout(inp.row_ids, inp.seq_lengths, mb.args, spec=self.pack.spec, num_rows=mb.num_rows,
                              validate=False, host_reads=False)

    def _side(self, kind: MicrobatchKind, which: str):
        """The packing (``"pack"``) or compiled unpacking (``"unpack"``) side of ``kind``; with
        ``compile_packing=True`` its first call compiles it, announced on stderr."""
        key = (kind.name, which)
        if self.compile_packing and key not in self._compiled:
            compile_cache.announce(f"PackedForward's {which}ing side of a {kind.name} microbatch")
            self._compiled.add(key)
        return self._sides[key]

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

    def _packed_seq_params(self, cu_seqlens_padded: torch.Tensor, total: int):
        if not self.make_packed_seq_params:
            return None
        from nn_data.megatron_parallel import make_packed_seq_params

        # max_seqlen = T: the only bound known without a host sync
        return make_packed_seq_params(cu_seqlens_padded, total, total // self.cp_size, total=total,
                                      cp_group=self._cp_group)


def microbatch_kind(input_ids: torch.Tensor, seq_lengths: torch.Tensor, *, prefix_lengths=None,
                    group_ids=None, parent=None, branch_at=None) -> tuple:
    """``(kind, args)``: the kind of microbatch a call is (:class:`MicrobatchKind`) and its own arguments,
    checked (metadata only): plain with none of them, a rollout tree with ``parent`` and ``branch_at``, its
    depth-1 spelling (the shared prompt) with ``prefix_lengths`` and ``group_ids``
    (:func:`~nn_data.packed_tree.tree_args`)."""
    if all(t is None for t in (prefix_lengths, group_ids, parent, branch_at)):
        return PLAIN, None
    return TREE, tree_args(input_ids, seq_lengths, prefix_lengths, group_ids, parent, branch_at)


def _row_len(row_ids: torch.Tensor):
    """``S``, a Python int eagerly (a symbolic size while a caller's compile traces the whole wrapper)."""
    row_len = row_ids.shape[1]
    return row_len if isinstance(row_len, torch.SymInt) else int(row_len)


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
    parallelism = Parallelism(dp=1, cp=cp_size)  # the one alignment rule: 2C per sequence and per total
    two_c = parallelism.sequence_multiple
    total_unit = pack.pad_full_seq_to if pack.pad_full_seq_to is not None else pack.p
    if pack.m % two_c or total_unit % parallelism.total_multiple:
        what = "pad_full_seq_to" if pack.pad_full_seq_to is not None else "pad_packed_seq_to_multiple_of"
        raise _checks.PackingError(
            f"with cp_size={cp_size}, pad_individual_seqs_to_multiple_of={pack.m} and {what}={total_unit} "
            f"must be multiples of 2*cp_size={two_c} so that every segment splits into {two_c} chunks"
        )
