"""The rollout-tree side of :class:`~nn_data.packed_forward.PackedForward`: every shared prefix packed
once (:mod:`nn_data.layout.prefix_layout`; a GRPO group's prompt is the depth-1 case), and the model's
output back to one row per rollout as if each had been packed alone.

Shape legend
    B   rollouts (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``); the row holds N node slots (``2B``: prompt, response per rollout)
    C   context-parallel size; the model sees ``T/C`` local tokens

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B], parent=[B], branch_at=[B])`` (a tree) or
``(..., prefix_lengths=P [B], group_ids=g [B])`` (the shared prompt) -> ``[B, S, *]``: the same model
contract as the plain path, with ``packed.prefix`` (a :class:`~nn_data.masks.PrefixRule`) for the
attention, position ids that continue along each path (``TreeLayout.positions``, this rank's places),
and for the shared prompt ``packed.prefix_lengths`` and ``packed.leader`` (None for a tree; layers that run
one rollout per row take the rule: :func:`nn_data.adapters.hf_mixers.path_rows`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import PackSpec, SharedPrefixLayout, shared_prefix_layout, tree_layout
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
                group_ids: torch.Tensor, num_rows: Optional[torch.Tensor] = None, tree: bool = False
                ) -> SharedPrefixShard:
        shared = rollout_layout(seq_lengths, prefix_lengths, group_ids, tree=tree, row_len=input_ids.shape[1],
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
                                 None if tree else shared.prefix_lengths, None if tree else shared.leader, keep)


def rollout_layout(seq_lengths, first, second, *, tree: bool, **kwargs) -> SharedPrefixLayout:
    """The tree layout of a call: ``(parent, branch_at)`` with ``tree``, else ``(prefix_lengths,
    group_ids)`` (the shared prompt, :func:`~nn_data.layout.shared_prefix_layout`)."""
    build = tree_layout if tree else shared_prefix_layout
    return build(seq_lengths, first, second, **kwargs)


def shared_finish(full: torch.Tensor, seq_lengths: torch.Tensor, prefix_lengths: torch.Tensor,
                  group_ids: torch.Tensor, like: torch.Tensor, spec: PackSpec,
                  num_rows: Optional[torch.Tensor] = None, tree: bool = False) -> torch.Tensor:
    """Unpack ``full [1, T, *]`` to ``[R, S, *]`` (``S = like.shape[1]``, symbolic under compile) on the
    tree layout rebuilt on the device from the lengths (no check: the packing side checked them): the
    compiled unpacking side of ``PackedForward``."""
    shared = rollout_layout(seq_lengths, prefix_lengths, group_ids, tree=tree, row_len=like.shape[1], spec=spec,
                            num_rows=num_rows, validate=False, host_reads=False)
    return shared.unpack(full, like.shape[1])


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
