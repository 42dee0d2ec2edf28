"""Rollout trees for the tests: random trees with a unique code per token, and a small loop reference of
the tree layout (nodes, packed row, places), written from the definition rollout by rollout."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch


class Tree(NamedTuple):
    lengths: list
    parent: list
    branch_at: list


def random_tree(rng: random.Random, rows: int, seq_len: int, depth: int = 4) -> Tree:
    """``rows`` rollouts of at most ``seq_len`` tokens, each a root or branching from an earlier rollout
    (paths at most ``depth`` rollouts deep)."""
    lengths, parent, branch_at, level = [], [], [], []
    for b in range(rows):
        n = rng.randint(0, seq_len)
        options = [p for p in range(b) if level[p] < depth and branch_at[p] < min(lengths[p], n)]
        if options and rng.random() < 0.8:
            p = rng.choice(options)
            parent.append(p)
            branch_at.append(rng.randint(branch_at[p] + 1, min(lengths[p], n)))
            level.append(level[p] + 1)
        else:
            parent.append(-1)
            branch_at.append(0)
            level.append(1)
        lengths.append(n)
    return Tree(lengths, parent, branch_at)


def token_ids(tree: Tree, seq_len: int, trailing=()) -> torch.Tensor:
    """``[B, S, *]`` int64: rollout ``b``'s own token ``s`` is ``1000 * (b + 1) + s`` (its shared ones its
    parent's), -1 past its length; a trailing dim repeats the code times ``1 + k``."""
    rows = len(tree.lengths)
    ids = torch.full((rows, seq_len), -1, dtype=torch.int64)
    for b in range(rows):
        for s in range(tree.lengths[b]):
            ids[b, s] = ids[tree.parent[b], s] if s < tree.branch_at[b] else 1000 * (b + 1) + s
    if trailing:
        scale = torch.arange(1, 1 + trailing[0], dtype=torch.int64)
        return ids[..., None] * scale
    return ids


def owner(tree: Tree, b: int, s: int) -> int:
    """The rollout whose own tokens hold token ``s`` of rollout ``b`` (walk up while ``s`` is shared)."""
    while s < tree.branch_at[b]:
        b = tree.parent[b]
    return b


def nodes(tree: Tree, capacity: int) -> list:
    """``[(rollout, begin, end)]`` of the ``capacity`` slots: leading empty slots (rollout None), then
    rollout by rollout its head, middles and tail (an empty head when it has no split point)."""
    rows, out = len(tree.lengths), []
    for b in range(rows):
        splits = sorted({tree.branch_at[c] for c in range(rows) if tree.parent[c] == b})
        points = [tree.branch_at[b]] + (splits or [tree.branch_at[b]]) + [tree.lengths[b]]
        out += [(b, lo, hi) for lo, hi in zip(points, points[1:])]
    assert len(out) <= capacity
    return [(None, 0, 0)] * (capacity - len(out)) + out


class Reference(NamedTuple):
    packed: list  # [T] (rollout, position) of each packed position, None on padding
    cu_seqlens_padded: list
    place: dict  # (rollout, position) -> packed position, for each rollout's own tokens


def reference(tree: Tree, capacity: int, multiple: int, total: int) -> Reference:
    """The packed row of a tree: every node rounded up to ``multiple``, the last one extended to ``total``."""
    slots = nodes(tree, capacity)
    cu, packed, place = [0], [], {}
    for b, lo, hi in slots:
        for s in range(lo, hi):
            place[(b, s)] = len(packed)
            packed.append((b, s))
        width = -(-(hi - lo) // multiple) * multiple
        packed += [None] * (width - (hi - lo))
        cu.append(len(packed))
    assert cu[-1] <= total
    packed += [None] * (total - cu[-1])
    cu[-1] = total
    return Reference(packed, cu, place)


def path_place(tree: Tree, ref: Reference, b: int, s: int) -> int:
    """The packed position of token ``s`` of rollout ``b``."""
    return ref.place[(owner(tree, b, s), s)]
