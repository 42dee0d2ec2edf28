"""The shared-prefix microbatch, a kind of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline
(:class:`SharedPrefixKind`): each group's prompt packed once, then its responses
(:mod:`nn_data.layout.prefix_layout`), and the model's output back to one row per rollout as if each had
been packed alone.

Shape legend
    B   rollouts (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``); the row holds ``2B`` slots (prompt, response per rollout)
    C   context-parallel size; the model sees ``T/C`` local tokens

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B], prefix_lengths=P [B], group_ids=g [B])``
-> ``[B, S, *]``: the same model contract as the plain path, with ``packed.prefix`` (a
:class:`SharedPrefixInfo`: the attention's :class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors, and
``prefix_lengths`` / ``leader`` for layers that run one rollout per row), and position ids that continue from
the prompt into each response (``SharedPrefixLayout.positions``, this rank's places).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.layout import PackLayout, PackSpec, SharedPrefixLayout, shared_prefix_layout
from nn_data.masks import PrefixRule
from nn_data.rows import pad_rows


class RolloutGroups(NamedTuple):
    """A shared-prefix microbatch's own arguments: ``prefix_lengths [B]`` (each rollout's prompt) and
    ``group_ids [B]`` (rollouts of one group share one prompt)."""

    prefix_lengths: torch.Tensor
    group_ids: torch.Tensor


class SharedPrefixInfo(NamedTuple):
    """What a shared-prefix microbatch adds to :class:`~nn_data.packed_forward.PackedInfo` (``packed.prefix``): the
    attention's ``rule`` (a :class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors, never sharded), and for
    layers that run one rollout per row ``prefix_lengths [B]`` and ``leader [B]`` (the rollout whose prompt slot
    each rollout's response continues)."""

    rule: PrefixRule
    prefix_lengths: torch.Tensor
    leader: torch.Tensor


class SharedPrefixKind:
    """The shared-prefix microbatch, a kind of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline
    (:class:`~nn_data.packed_forward.MicrobatchKind`): each group's prompt packed once, then its responses,
    on a :class:`~nn_data.layout.SharedPrefixLayout` over ``2B`` slots; positions continue from the prompt
    into each response; :class:`~nn_data.packed_forward.PackedInfo` gets ``prefix`` (:class:`SharedPrefixInfo`).

    Example: groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1 -> packed ``[p0 p0 r0 r0 | r1 | p2 |
    r2 r2]``, positions ``[0, 1, 2, 3, 2, 0, 1, 2]``.
    """

    name = "shared-prefix"

    def args(self, input_ids: torch.Tensor, seq_lengths, *, prefix_lengths, group_ids) -> RolloutGroups:
        check_shared_args(input_ids, seq_lengths, prefix_lengths, group_ids)
        return RolloutGroups(prefix_lengths, group_ids)

    def pad_rows(self, args: RolloutGroups, capacity: int) -> RolloutGroups:
        return RolloutGroups(*pad_shared_rows(args.prefix_lengths, args.group_ids, capacity))

    def layout(self, input_ids, seq_lengths, args: RolloutGroups, *, spec: PackSpec, num_rows, validate=True,
               host_reads=True) -> SharedPrefixLayout:
        return shared_prefix_layout(seq_lengths, args.prefix_lengths, args.group_ids, row_len=input_ids.shape[1],
                                    spec=spec, input_ids=input_ids if validate else None, num_rows=num_rows,
                                    validate=validate, host_reads=host_reads)

    def slots(self, layout: SharedPrefixLayout) -> PackLayout:
        return layout.layout

    def positions(self, layout: SharedPrefixLayout, places) -> torch.Tensor:
        return layout.positions().index_select(0, places.source).unsqueeze(0)  # [T] -> [1, T/C]

    def attention(self, layout: SharedPrefixLayout):
        """``PackedInfo.prefix``: the attention's rule and, per rollout, its prompt length and leader."""
        return SharedPrefixInfo(rule=layout.prefix_rule(), prefix_lengths=layout.prefix_lengths, leader=layout.leader)

    def unpack(self, full, *, seq_lengths, cu_seqlens_padded, args: RolloutGroups, num_rows, like,
               spec: PackSpec) -> torch.Tensor:
        """The compiled unpacking side: the layout rebuilt on the device from the lengths (no check: the
        packing side checked them), then rollout b's row as if it had been packed alone."""
        shared = self.layout(like, seq_lengths, args, spec=spec, num_rows=num_rows, validate=False, host_reads=False)
        return shared.unpack(full, like.shape[1])  # [R, S, *]


SHARED_PREFIX = SharedPrefixKind()


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
