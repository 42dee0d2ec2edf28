"""The tree microbatch, a kind of :class:`~nn_data.packed_forward.PackedForward`'s one pipeline
(:class:`TreeKind`): every shared prefix packed once, at any depth (:mod:`nn_data.layout.tree`), and the
model's output back to one row per rollout as if each had been packed alone. GRPO groups enter as
:class:`RolloutGroups` and become the depth-1 tree where the layout is built.

Shape legend
    B   rollouts (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``); the row holds N node slots (``2B`` for GRPO groups, at most
        ``3B - 2`` for a tree)
    C   context-parallel size; the model sees ``T/C`` local tokens

The model contract is the plain path's, with ``packed.prefix`` (a :class:`TreeInfo`: the attention's
:class:`~nn_data.masks.PrefixRule`) and position ids that continue along each path (docs/models.md, "Rollout
trees and shared prompts")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.layout import PackLayout, PackSpec, TreeLayout, shared_prefix_layout, tree_layout
from nn_data.masks import PrefixRule
from nn_data.planning import RolloutTree
from nn_data.rows import pad_rows


class RolloutGroups(NamedTuple):
    """GRPO groups, the depth-1 tree's spelling of a tree microbatch's arguments: ``prefix_lengths [B]`` (each
    rollout's prompt) and ``group_ids [B]`` (rollouts of one group share one prompt)."""

    prefix_lengths: torch.Tensor
    group_ids: torch.Tensor


class TreeInfo(NamedTuple):
    """What a tree microbatch adds to :class:`~nn_data.packed_forward.PackedInfo` (``packed.prefix``): the
    attention's ``rule`` (a :class:`~nn_data.masks.PrefixRule`, global ``[T]`` tensors, never sharded)."""

    rule: PrefixRule


class TreeKind:
    """The tree microbatch as a :class:`~nn_data.packed_sides.MicrobatchKind`: a
    :class:`~nn_data.layout.TreeLayout` over node slots, positions along each path, ``PackedInfo.prefix``. Its
    arguments are a :class:`~nn_data.planning.RolloutTree` (``parent``, ``branch_at``) or :class:`RolloutGroups`.

    Example: L ``[5, 4]``, parent ``[-1, 0]``, branch_at ``[0, 3]``, m 1 -> packed ``[x0 x1 x2 | x3 x4 | y3]``,
    positions ``[0, 1, 2, 3, 4, 3]``; groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]`` -> packed ``[p0 p0
    r0 r0 | r1 | p2 | r2 r2]``, positions ``[0, 1, 2, 3, 2, 0, 1, 2]``."""

    name = "rollout-tree"

    def pad_rows(self, args, capacity: int):
        if isinstance(args, RolloutGroups):
            return RolloutGroups(*pad_group_rows(args.prefix_lengths, args.group_ids, capacity))
        return RolloutTree(*pad_tree_rows(args.parent, args.branch_at, capacity))

    def layout(self, input_ids, seq_lengths, args, *, spec: PackSpec, num_rows, validate=True,
               host_reads=True) -> TreeLayout:
        kwargs = dict(row_len=input_ids.shape[1], spec=spec, input_ids=input_ids if validate else None,
                      num_rows=num_rows, validate=validate, host_reads=host_reads)
        if isinstance(args, RolloutGroups):  # the depth-1 tree: each rollout's parent its group's first
            return shared_prefix_layout(seq_lengths, args.prefix_lengths, args.group_ids, **kwargs)
        return tree_layout(seq_lengths, args.parent, args.branch_at, **kwargs)

    def slots(self, layout: TreeLayout) -> PackLayout:
        return layout.layout

    def positions(self, layout: TreeLayout, places) -> torch.Tensor:
        return layout.positions().index_select(0, places.source).unsqueeze(0)  # [T] -> [1, T/C]

    def attention(self, layout: TreeLayout) -> TreeInfo:
        """``PackedInfo.prefix``: the attention's path rule."""
        return TreeInfo(rule=layout.prefix_rule())

    def unpack(self, full, *, seq_lengths, cu_seqlens_padded, args, num_rows, like, spec: PackSpec) -> torch.Tensor:
        """The compiled unpacking side: the layout rebuilt on the device from the lengths (no check: the
        packing side checked them), then rollout b's row as if it had been packed alone."""
        tree = self.layout(like, seq_lengths, args, spec=spec, num_rows=num_rows, validate=False, host_reads=False)
        return tree.unpack(full, like.shape[1])  # [R, S, *]


TREE = TreeKind()


#: The keywords that make a call a tree microbatch: a rollout tree's, then GRPO groups' (its depth-1 spelling).
TREE_KEYS = ("parent", "branch_at", "prefix_lengths", "group_ids")


def refuse_tree(where: str, given: dict, why: str) -> None:
    """:class:`~nn_data.errors.PackingError` naming ``where`` and the tree keywords of ``given`` (a caller that
    serves plain microbatches only, with ``why``); a keyword that is not a tree's is a ``TypeError``, as Python
    raises for an unknown keyword."""
    unknown = sorted(set(given) - set(TREE_KEYS))
    if unknown:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}")
    if given:
        raise _checks.PackingError(f"{where} serves plain microbatches; {sorted(given)} make this a tree microbatch "
                                   f"(a rollout tree, or GRPO groups: its depth-1 spelling), which it refuses: {why}")


def tree_args(input_ids: torch.Tensor, seq_lengths, prefix_lengths, group_ids, parent=None, branch_at=None):
    """A tree microbatch's arguments: :class:`RolloutGroups` from both of ``prefix_lengths`` and ``group_ids``,
    or a :class:`~nn_data.planning.RolloutTree` from both of ``parent`` and ``branch_at``, each a ``[B]`` integer
    tensor on the batch's device (the metadata checks, before any compiled region)."""
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
    return RolloutTree(first, second) if tree else RolloutGroups(first, second)


def pad_tree_rows(parent: torch.Tensor, branch_at: torch.Tensor, capacity: int):
    """``parent`` and ``branch_at`` padded to ``capacity`` rows: each padding row a root (-1, 0)."""
    padded = pad_rows(parent + 1, capacity, name="row_capacity") - 1  # [R]: -1 past the rows
    return padded, pad_rows(branch_at, capacity, name="row_capacity")


def pad_group_rows(prefix_lengths: torch.Tensor, group_ids: torch.Tensor, capacity: int):
    """``prefix_lengths`` and ``group_ids`` padded to ``capacity`` rows as ``pad_to_row_capacity`` pads the ids: each
    padding row has prefix length 0 and a group of its own (ids below every real one, computed on the device).

    Example: group_ids ``[7, 7, 9]``, capacity 5 -> ``[7, 7, 9, 6, 5]``; prefix_lengths ``[2, 2, 1]``
    -> ``[2, 2, 1, 0, 0]``."""
    rows = group_ids.shape[0]
    extra = max(capacity - rows, 0)  # (more rows than capacity: pad_rows names row_capacity)
    floor = group_ids.min() if rows else torch.zeros((), dtype=group_ids.dtype, device=group_ids.device)
    own = floor - 1 - torch.arange(extra, dtype=group_ids.dtype, device=group_ids.device)  # [R - B]
    return pad_rows(prefix_lengths, capacity, name="row_capacity"), torch.cat([group_ids, own])
