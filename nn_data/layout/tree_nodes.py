"""The index tables of a rollout tree: its nodes (segments), each rollout's path, what each rollout sees.

Shape legend
    B   rollouts; S their row length
    N   node slots (``node_capacity``, a Python int; ``2B`` for a depth-1 tree, at most ``3B``)
    K   query points (any shape)

Rollout ``b`` shares its first ``branch_at[b]`` tokens with ``parent[b] < b`` (-1: none); its own tokens
``[branch_at[b], L[b])`` are split at every child's branch point and at ``extra[b]`` into **nodes**: ``c_b = 1
+ max(k_b, 1)`` consecutive slots (``k_b`` its distinct split points), a *head* ``[a_b, s_1)``, the middles, a
*tail* ``[s_k, L_b)`` (no split: an empty head). Rollouts take their slots in index order after ``N -
sum(c_b)`` leading empty slots, so the last slot is the last rollout's tail.

Example: L ``[6, 5, 4]``, parent ``[-1, 0, 0]``, branch_at ``[0, 2, 4]``, N 6 -> rollout 0 splits at 2
and 4 (``k = [2, 0, 0]``, ``c = [3, 2, 2]``, 7 slots > 6: refused); with N 7 -> owner
``[0,0,0, 1,1, 2,2]``, begin ``[0,2,4, 2,2, 4,4]``, length ``[2,2,2, 0,3, 0,0]`` (rollout 2 shares all
4 tokens it has: its tail is empty).

What a token sees (:func:`shared_table`): ``shared[q, r]``, the tokens of rollout ``r`` that rollout ``q``
shares; a key of ``r`` at position ``p`` is on ``q``'s path iff ``p < shared[q, r]``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data.layout.index import exclusive_cumsum

#: ``shared[b, b]``: a rollout sees every earlier token of its own (above any position).
EVERY = torch.iinfo(torch.int64).max


class NodeTables(NamedTuple):
    """The node slots, ``[N+1]`` each (one trailing empty entry that the ``B = 0`` pseudo-segment and the
    padding read): ``owner`` (the rollout whose tokens the node holds; ``B`` for an empty leading or
    trailing slot), ``begin`` (its first token's position in that rollout), ``length``; ``offsets
    [B+1]`` (rollout ``b``'s first slot; ``offsets[B] = N``), ``splits [B]`` (``k_b``), ``first_split
    [B]`` and ``split_keys [2B]`` (the distinct split points, ascending by ``b * (S+1) + s``, rollout
    ``b``'s from ``first_split[b]``; the unused tail holds :data:`EVERY`), ``used`` (0-d: the slots
    the tree needs)."""

    owner: torch.Tensor
    begin: torch.Tensor
    length: torch.Tensor
    offsets: torch.Tensor
    splits: torch.Tensor
    first_split: torch.Tensor
    split_keys: torch.Tensor
    used: torch.Tensor


def node_tables(lengths: torch.Tensor, parent: torch.Tensor, branch_at: torch.Tensor, extra: torch.Tensor,
                row_len, capacity: int) -> NodeTables:
    """The :class:`NodeTables` of a tree (int64 ``[B]`` inputs; ``extra[b]`` a split inside rollout ``b``
    or 0 for none; ``capacity`` N). No host read; a tree needing more than N slots is the caller's check
    (``used``). Example: the module docstring."""
    rows, device = lengths.shape[0], lengths.device
    rollout = torch.arange(rows, device=device)  # [B]
    wide = row_len + 1
    owner = torch.cat([parent, rollout])  # [2B]: each child's split of its parent, then each extra split
    pos = torch.cat([branch_at, extra])  # [2B]
    valid = (owner >= 0) & (pos > branch_at[owner.clamp(min=0)])  # [2B] (extra 0: none; a root's child at 0: none)
    keys, _ = torch.where(valid, owner.clamp(min=0) * wide + pos, EVERY).sort()  # [2B] ascending
    distinct = (keys != torch.cat([keys.new_full((1,), -1), keys[:-1]])) & (keys != EVERY)  # [2B] first of each
    key_owner = torch.div(keys.clamp(max=rows * wide), wide, rounding_mode="floor").clamp(max=max(rows - 1, 0))
    splits = torch.zeros(rows, dtype=torch.int64, device=device).index_add(0, key_owner, distinct.to(torch.int64))
    # keys [2, 4, 4, EVERY..] (the example, S+1 = 7) -> distinct [T, T, F, F..] -> split_keys [2, 4, EVERY..]
    place = torch.where(distinct, torch.cumsum(distinct, 0) - 1, 2 * rows)  # [2B]: compacted place, or the dump
    split_keys = keys.new_full((2 * rows + 1,), EVERY).scatter(0, place, keys)[: 2 * rows]  # [2B]
    first_split = exclusive_cumsum(splits)[:rows]  # [B]
    count = 1 + splits.clamp(min=1)  # [B] slots per rollout: head (+ middles) + tail
    ends = exclusive_cumsum(count)  # [B+1]
    used = ends[-1]
    offsets = ends + (capacity - used)  # [B+1]: leading empties first; offsets[B] = N
    slot = torch.arange(capacity + 1, device=device)  # [N+1]
    own = torch.searchsorted(offsets[1:], slot, right=True).clamp(max=max(rows - 1, 0))  # [N+1]
    i = slot - offsets[own]  # [N+1]: the node's index inside its rollout (< 0: a leading empty slot)
    real = (i >= 0) & (slot < capacity) & (rows > 0)

    def point(j):  # [N+1] -> [N+1]: the j-th boundary of the owner's nodes (a, s_1 .. s_k, L)
        k = splits[own]
        inner = split_keys[(first_split[own] + j - 1).clamp(0, max(2 * rows - 1, 0))] - own * wide
        inner = torch.where(k == 0, branch_at[own], inner) if rows else inner
        return torch.where(j <= 0, branch_at[own], torch.where(j >= count[own], lengths[own], inner))

    if rows == 0:
        zero = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        return NodeTables(zero, zero, zero, offsets, splits, first_split, split_keys, used)
    begin, end = point(i), point(i + 1)
    return NodeTables(torch.where(real, own, rows), torch.where(real, begin, 0), torch.where(real, end - begin, 0),
                      offsets, splits, first_split, split_keys, used)


class Paths(NamedTuple):
    """Each rollout's path, ``[B, B]`` each: ``ancestor[b, j]`` its ``j``-th ancestor (``j = 0``: itself;
    -1 past the root) and ``shared[b, j]``, the tokens of that ancestor ``b`` shares (the smallest
    ``branch_at`` of the ``j`` rollouts below it on the path; :data:`EVERY` for ``j = 0``)."""

    ancestor: torch.Tensor
    shared: torch.Tensor


def paths(parent: torch.Tensor, branch_at: torch.Tensor) -> Paths:
    """The :class:`Paths` of a tree by doubling: ``ceil(log2 B)`` steps of ``[B, B]`` gathers, no host read.

    Example: parent ``[-1, 0, 1]``, branch_at ``[0, 3, 5]`` -> ancestor ``[[0,-1,-1], [1,0,-1], [2,1,0]]``,
    shared ``[[E,.,.], [E,3,.], [E,5,3]]`` (E = EVERY; rollout 2 shares 5 tokens of rollout 1, 3 of 0).
    """
    rows, device = parent.shape[0], parent.device
    none = rows  # the sentinel row: every table's row B is "no rollout"
    up = torch.cat([torch.where(parent >= 0, parent, none), parent.new_full((1,), none)])  # [B+1]
    low = torch.cat([branch_at, branch_at.new_full((1,), EVERY)])  # [B+1]: min of branch_at over 2^k steps
    ancestor = torch.cat([torch.arange(rows, device=device), up.new_full((1,), none)])[:, None]  # [B+1, 1]
    shared = torch.full((rows + 1, 1), EVERY, dtype=torch.int64, device=device)  # [B+1, 1]
    while ancestor.shape[1] < rows:  # width 1, 2, 4, ...: the next width's entries start 2^k steps up
        ancestor = torch.cat([ancestor, ancestor[up]], 1)  # [B+1, 2w]
        shared = torch.cat([shared, torch.minimum(low[:, None], shared[up])], 1)  # [B+1, 2w]
        low, up = torch.minimum(low, low[up]), up[up]
    ancestor = torch.where(ancestor == none, -1, ancestor)[:rows, :rows]  # [B, B]
    return Paths(ancestor, shared[:rows, :rows])


def shared_table(path: Paths) -> torch.Tensor:
    """``[B+1, B+1]`` int64: ``shared[q, r]`` (module docstring); row and column ``B`` (a padding token's
    rollout) all 0. Example (:func:`paths`' tree): ``[[E,0,0,0], [3,E,0,0], [3,5,E,0], [0,0,0,0]]``."""
    rows = path.ancestor.shape[0]
    table = torch.zeros(rows + 1, rows + 2, dtype=torch.int64, device=path.ancestor.device)  # column B+1: dump
    column = torch.where(path.ancestor >= 0, path.ancestor, rows + 1)  # [B, B]
    table[:rows].scatter_(1, column, path.shared)
    return table[:, : rows + 1]


def owners(ancestor: torch.Tensor, branch_at: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``position [M, K]`` (token positions of ``M`` rollouts whose ``Paths.ancestor`` rows are ``ancestor [M, B]``)
    -> ``[M, K]``: the rollout on each path whose own tokens hold that position (the deepest ancestor-or-self ``r``
    with ``branch_at[r] <= s``). Example (:func:`paths`' tree): rollout 2, positions ``[0, 4, 6]`` -> ``[0, 1, 2]``."""
    starts = torch.where(ancestor >= 0, branch_at[ancestor.clamp(min=0)], -1)  # [M, B] descending
    at_or_below = torch.searchsorted(starts.flip(1).contiguous(), position.contiguous(), right=True)  # [M, K]
    depth = (ancestor.shape[1] - at_or_below).clamp(0, max(ancestor.shape[1] - 1, 0))  # [M, K]
    return ancestor.gather(1, depth).clamp(min=0)


def node_of(nodes: NodeTables, owner: torch.Tensor, position: torch.Tensor, row_len) -> torch.Tensor:
    """The slot holding token ``position`` of rollout ``owner`` (its own token), any matching shapes. Example
    (:func:`node_tables`' tree, N 7): owner 0 at ``[1, 2, 5]`` -> slots ``[0, 1, 2]``; owner 1 at 3 -> 4 (its tail)."""
    wide = row_len + 1
    rows = nodes.splits.shape[0]
    if rows == 0:
        return torch.zeros_like(owner)
    keys = nodes.split_keys.contiguous()
    before = torch.searchsorted(keys, (owner * wide + position).reshape(-1), right=True).view(owner.shape)
    inner = before - nodes.first_split[owner]  # splits of the owner at or before the position
    return nodes.offsets[owner] + torch.where(nodes.splits[owner] == 0, 1, inner)


def leaders(group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the first rollout of each rollout's group (a ``[B, B]`` comparison). Example: group_ids ``[7, 9,
    7, 9, 4]`` -> ``[0, 1, 0, 1, 4]``."""
    rows = group_ids.shape[0]
    rollout = torch.arange(rows, device=group_ids.device)  # [B]
    if rows == 0:
        return rollout
    same = group_ids[:, None] == group_ids[None, :]  # [B, B]
    return torch.where(same, rollout[None, :], rows).amin(dim=1)  # [B]


def prefix_mismatch(input_ids: torch.Tensor, shared: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rollout ``b``'s first ``shared[b]`` tokens differ from rollout ``other[b]``'s."""
    ids = input_ids.flatten(2) if input_ids.dim() > 2 else input_ids.unsqueeze(2)  # [B, S, F]
    s = torch.arange(ids.shape[1], device=ids.device)  # [S]
    differs = (ids != ids[other]).any(dim=2)  # [B, S]
    return (differs & (s[None, :] < shared[:, None])).any(dim=1)
