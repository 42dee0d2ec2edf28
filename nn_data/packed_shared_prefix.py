"""The rollout-tree microbatch, a kind of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline
(:class:`RolloutTreeKind`): every shared prefix packed once, at any depth
(:mod:`nn_data.layout.prefix_layout`), and the model's output back to one row per rollout as if each had
been packed alone. The GRPO shared prompt is its depth-1 spelling (:class:`SharedPrefixKind`: the same
strategy, its own arguments).

Shape legend
    B   rollouts (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``); the row holds N node slots (``2B`` for the shared prompt, at most
        ``3B - 2`` for a tree)
    C   context-parallel size; the model sees ``T/C`` local tokens

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B], parent=[B], branch_at=[B])`` (a tree) or
``(..., prefix_lengths=P [B], group_ids=g [B])`` (the shared prompt) -> ``[B, S, *]``: the same model
contract as the plain path, with ``packed.prefix`` (a :class:`SharedPrefixInfo`: the attention's
:class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors; for the shared prompt also ``prefix_lengths`` /
``leader``; recurrent and convolution layers take the rule: :mod:`nn_data.adapters.tree_state`),
and position ids that continue along each path (``TreeLayout.positions``, this rank's places).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.layout import PackLayout, PackSpec, SharedPrefixLayout, shared_prefix_layout, tree_layout
from nn_data.masks import PrefixRule
from nn_data.planning import RolloutTree
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
    each rollout's response continues; None for a rollout tree, whose layers take the rule)."""

    rule: PrefixRule
    prefix_lengths: torch.Tensor
    leader: torch.Tensor


class RolloutTreeKind:
    """The rollout-tree microbatch, a kind of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline
    (:class:`~nn_data.packed_sides.MicrobatchKind`): every shared prefix packed once, ancestors before
    descendants, on a :class:`~nn_data.layout.TreeLayout` over node slots; positions continue along each
    path; :class:`~nn_data.packed_forward.PackedInfo` gets ``prefix`` (:class:`SharedPrefixInfo`, its
    ``prefix_lengths`` and ``leader`` None). :class:`SharedPrefixKind` is its depth-1 spelling.

    Example: L ``[5, 4]``, parent ``[-1, 0]``, branch_at ``[0, 3]``, m 1 -> packed ``[x0 x1 x2 | x3 x4 | y3]``,
    positions ``[0, 1, 2, 3, 4, 3]``.
    """

    name = "rollout-tree"
    fields = ("parent", "branch_at")

    def args(self, input_ids: torch.Tensor, seq_lengths, first, second) -> RolloutTree:
        """The call's two per-row tensors (checked by :func:`check_shared_args`) as this kind's record
        (:class:`~nn_data.planning.RolloutTree`, here of ``[B]`` tensors)."""
        return RolloutTree(first, second)

    def pad_rows(self, args: RolloutTree, capacity: int) -> RolloutTree:
        return RolloutTree(*pad_tree_rows(args.parent, args.branch_at, capacity))

    def build(self, seq_lengths, args: RolloutTree, **kwargs) -> SharedPrefixLayout:
        """The layout builder of this spelling (:func:`~nn_data.layout.tree_layout`)."""
        return tree_layout(seq_lengths, args.parent, args.branch_at, **kwargs)

    def layout(self, input_ids, seq_lengths, args, *, spec: PackSpec, num_rows, validate=True,
               host_reads=True) -> SharedPrefixLayout:
        return self.build(seq_lengths, args, row_len=input_ids.shape[1], spec=spec,
                          input_ids=input_ids if validate else None, num_rows=num_rows, validate=validate,
                          host_reads=host_reads)

    def slots(self, layout: SharedPrefixLayout) -> PackLayout:
        return layout.layout

    def positions(self, layout: SharedPrefixLayout, places) -> torch.Tensor:
        return layout.positions().index_select(0, places.source).unsqueeze(0)  # [T] -> [1, T/C]

    def attention(self, layout: SharedPrefixLayout):
        """``PackedInfo.prefix``: the attention's path rule."""
        return SharedPrefixInfo(rule=layout.prefix_rule(), prefix_lengths=None, leader=None)

    def unpack(self, full, *, seq_lengths, cu_seqlens_padded, args, num_rows, like, spec: PackSpec) -> torch.Tensor:
        """The compiled unpacking side: the layout rebuilt on the device from the lengths (no check: the
        packing side checked them), then rollout b's row as if it had been packed alone."""
        shared = self.layout(like, seq_lengths, args, spec=spec, num_rows=num_rows, validate=False, host_reads=False)
        return shared.unpack(full, like.shape[1])  # [R, S, *]


class SharedPrefixKind(RolloutTreeKind):
    """The shared-prefix microbatch: the depth-1 spelling of :class:`RolloutTreeKind` (each group's prompt
    packed once, then its responses, on a :class:`~nn_data.layout.SharedPrefixLayout` over ``2B`` slots);
    ``PackedInfo.prefix`` also carries each rollout's ``prefix_lengths`` and ``leader``.

    Example: groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1 -> packed ``[p0 p0 r0 r0 | r1 | p2 |
    r2 r2]``, positions ``[0, 1, 2, 3, 2, 0, 1, 2]``.
    """

    name = "shared-prefix"
    fields = ("prefix_lengths", "group_ids")

    def args(self, input_ids: torch.Tensor, seq_lengths, first, second) -> RolloutGroups:
        return RolloutGroups(first, second)

    def pad_rows(self, args: RolloutGroups, capacity: int) -> RolloutGroups:
        return RolloutGroups(*pad_shared_rows(args.prefix_lengths, args.group_ids, capacity))

    def build(self, seq_lengths, args: RolloutGroups, **kwargs) -> SharedPrefixLayout:
        return shared_prefix_layout(seq_lengths, args.prefix_lengths, args.group_ids, **kwargs)

    def attention(self, layout: SharedPrefixLayout):
        """``PackedInfo.prefix``: the attention's rule and, per rollout, its prompt length and leader."""
        return SharedPrefixInfo(rule=layout.prefix_rule(), prefix_lengths=layout.prefix_lengths, leader=layout.leader)


ROLLOUT_TREE = RolloutTreeKind()
SHARED_PREFIX = SharedPrefixKind()


def check_shared_args(input_ids: torch.Tensor, seq_lengths, prefix_lengths, group_ids, parent=None,
                      branch_at=None) -> tuple:
    """``(first, second, tree)``: both of ``prefix_lengths`` and ``group_ids``, or both of ``parent`` and
    ``branch_at`` (a tree), each a ``[B]`` integer tensor on the batch's device (the metadata checks,
    before any compiled region)."""
    tree = parent is not None or branch_at is not None
    if tree and (prefix_lengths is not None or group_ids is not None):
        raise _checks.PackingError("parent/branch_at (a rollout tree) and prefix_lengths/group_ids (a shared prompt) "
                                   "were both given: pass one spelling (a shared prompt is the tree with parent = the "
                                   "group's first rollout, branch_at = the prompt length)")
    pair = ("parent", "branch_at") if tree else ("prefix_lengths", "group_ids")
    first, second = (parent, branch_at) if tree else (prefix_lengths, group_ids)
    if (first is None) != (second is None):
        given, missing = (pair[0], pair[1]) if second is None else (pair[1], pair[0])
        what = ("the rollout each shares its beginning with and how many tokens" if tree else
                "the prompt length each rollout shares and the group it shares it with")
        raise _checks.PackingError(f"{given} was given without {missing}: a {'tree' if tree else 'shared-prefix'} "
                                   f"call needs both ({what})")
    rows = input_ids.shape[0]
    _checks.check_int_vector(pair[0], first, rows)
    _checks.check_int_vector(pair[1], second, rows)
    _checks.check_same_device(input_ids=input_ids, seq_lengths=seq_lengths, **{pair[0]: first, pair[1]: second})
    return first, second, tree


def pad_tree_rows(parent: torch.Tensor, branch_at: torch.Tensor, capacity: int):
    """``parent`` and ``branch_at`` padded to ``capacity`` rows: each padding row a root (-1, 0)."""
    padded = pad_rows(parent + 1, capacity, name="row_capacity") - 1  # [R]: -1 past the rows
    return padded, pad_rows(branch_at, capacity, name="row_capacity")


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
