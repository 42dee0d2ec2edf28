"""The shared-prefix side of :class:`~nn_data.packed_forward.PackedForward`: each group's prompt packed
once, then its responses (:mod:`nn_data.layout.prefix_layout`), and the model's output back to one
row per rollout as if each had been packed alone.

Shape legend
    B   rollouts (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``); the row holds ``2B`` slots (prompt, response per rollout)
    C   context-parallel size; the model sees ``T/C`` local tokens

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B], prefix_lengths=P [B], group_ids=g [B])``
-> ``[B, S, *]``: the same model contract as the plain path, with ``packed.prefix`` (a
:class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors) for the attention, ``packed.prefix_lengths``
and ``packed.leader`` for layers that run one rollout per row, and position ids that continue from
the prompt into each response (``SharedPrefixLayout.positions``, this rank's places).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import PackSpec, SharedPrefixLayout, shared_prefix_layout
from nn_data.masks import PrefixRule
from nn_data.pack import pack_shard
from nn_data.rows import pad_rows


class SharedPrefixShard(NamedTuple):
    """:class:`SharedPrefixPackShard`'s result: this rank's ``input_ids [1, T/C]``, ``positions [1, T/C]``,
    ``padding_mask [1, T/C]``, ``query_index [T/C]`` (packed positions of the local tokens), the slots'
    ``segment_ids [T]``, ``cu_seqlens [2B+1]`` / ``cu_seqlens_padded [2B+1]`` (over the 2B slots),
    ``max_seqlen`` (0-d), the ``prefix`` rule, ``prefix_lengths [R]`` and ``leader [R]``; ``shared``, the
    layout itself, None out of a compiled graph (its index maps stay inside it)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    padding_mask: torch.Tensor
    query_index: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    prefix: PrefixRule
    prefix_lengths: torch.Tensor
    leader: torch.Tensor
    shared: Optional[SharedPrefixLayout] = None


class SharedPrefixPackShard(nn.Module):
    """Build the shared-prefix layout of a batch of rollouts, pack the ids, take this CP rank's places:
    the packing side ``PackedForward`` runs (and compiles, ``compile_packing=True``) for a call given
    ``prefix_lengths`` and ``group_ids``.

    ``forward(input_ids [R, S], seq_lengths [R], prefix_lengths [R], group_ids [R], num_rows=None) ->
    SharedPrefixShard``. Eagerly the layout is built on the host after the builder's one read; under
    ``torch.compile`` on the device with device-side asserts (:func:`nn_data.layout.shared_prefix_layout`).
    """

    def __init__(self, spec: PackSpec, cp_size: int = 1, cp_rank: int = 0):
        super().__init__()
        _checks.check_cp(cp_size, cp_rank)
        self.spec, self.cp_size, self.cp_rank = spec, cp_size, cp_rank

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths: torch.Tensor,
                group_ids: torch.Tensor, num_rows: Optional[torch.Tensor] = None) -> SharedPrefixShard:
        shared = shared_prefix_layout(seq_lengths, prefix_lengths, group_ids, row_len=input_ids.shape[1],
                                      spec=self.spec, input_ids=input_ids, num_rows=num_rows)
        layout = shared.layout
        places = layout.local_places(self.cp_size, self.cp_rank)  # [T/C] each, once for every tensor
        _, local = pack_shard(layout, {"x": shared.pack(input_ids)}, cp_size=self.cp_size, cp_rank=self.cp_rank,
                              source=places.source, packed=("x",))
        positions = shared.positions().index_select(0, places.source).unsqueeze(0)  # [T] -> [1, T/C]
        padding_mask = layout.padding_mask(places=places)  # [1, T/C] bool
        keep = None if torch.compiler.is_compiling() else shared
        return SharedPrefixShard(local["x"], positions, padding_mask, places.source, shared.segment_ids(),
                                 layout.cu_seqlens, layout.cu_seqlens_padded, layout.max_seqlen, shared.prefix_rule(),
                                 shared.prefix_lengths, shared.leader, keep)


def shared_finish(full: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths: torch.Tensor,
                  group_ids: torch.Tensor, like: torch.Tensor, spec: PackSpec,
                  num_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unpack ``full [1, T, *]`` to ``[R, S, *]`` (``S = like.shape[1]``, symbolic under compile) on the
    shared-prefix layout rebuilt on the device from the lengths (no check: the packing side checked
    them): the compiled unpacking side of ``PackedForward``."""
    shared = shared_prefix_layout(seq_lengths, prefix_lengths, group_ids, row_len=like.shape[1], spec=spec,
                                  num_rows=num_rows, validate=False, host_reads=False)
    return shared.unpack(full, like.shape[1])


def check_shared_args(input_ids: torch.Tensor, seq_lengths, prefix_lengths, group_ids) -> None:
    """Both of ``prefix_lengths`` and ``group_ids`` or neither; each a ``[B]`` integer tensor on the
    batch's device (the metadata checks, before any compiled region)."""
    if (prefix_lengths is None) != (group_ids is None):
        given, missing = ("prefix_lengths", "group_ids") if group_ids is None else ("group_ids", "prefix_lengths")
        raise _checks.PackingError(f"{given} was given without {missing}: a shared-prefix call needs both "
                                   "(the prompt length each rollout shares and the group it shares it with)")
    rows = input_ids.shape[0]
    _checks.check_int_vector("prefix_lengths", prefix_lengths, rows)
    _checks.check_int_vector("group_ids", group_ids, rows)
    _checks.check_same_device(input_ids=input_ids, seq_lengths=seq_lengths, prefix_lengths=prefix_lengths,
                              group_ids=group_ids)


def pad_shared_rows(prefix_lengths: torch.Tensor, group_ids: torch.Tensor, capacity: int):
    """``prefix_lengths`` and ``group_ids`` padded to ``capacity`` rows, as ``pad_to_row_capacity`` pads
    the ids and lengths: each padding row has prefix length 0 and a group of its own (ids below every
    real one, computed on the device).

    Example: group_ids ``[7, 7, 9]``, capacity 5 -> ``[7, 7, 9, 6, 5]``; prefix_lengths ``[2, 2, 1]``
    -> ``[2, 2, 1, 0, 0]``.
    """
    rows = group_ids.shape[0]
    extra = max(capacity - rows, 0)  # (more rows than capacity: pad_rows names row_capacity)
    floor = group_ids.min() if rows else torch.zeros((), dtype=group_ids.dtype, device=group_ids.device)
    own = floor - 1 - torch.arange(extra, dtype=group_ids.dtype, device=group_ids.device)  # [R - B]
    return pad_rows(prefix_lengths, capacity, name="row_capacity"), torch.cat([group_ids, own])
