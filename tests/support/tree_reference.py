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


#: Trees of depth 1 to 4 (the most branchings on a path; the shared prompt is depth 1): a group with a child
#: that has no own token and an empty rollout, a chain of 2 beside a lone rollout, depth 3 with rollout 0 split
#: twice and a child sharing all of its parent's tokens, a chain of 4 branchings beside a sibling of its root.
BY_DEPTH = (
    Tree([8, 5, 11, 0], [-1, 0, 0, -1], [0, 5, 5, 0]),
    Tree([12, 14, 10, 7], [-1, 0, 1, -1], [0, 5, 8, 0]),
    Tree([9, 13, 15, 18, 6], [-1, 0, 1, 2, 0], [0, 4, 9, 15, 2]),
    Tree([10, 12, 13, 14, 15, 11], [-1, 0, 1, 2, 3, 0], [0, 3, 6, 9, 12, 3]),
)


def depth(tree: Tree) -> int:
    """The most branchings on a root-to-leaf path (a lone rollout: 0; the shared prompt: 1)."""
    def level(b: int) -> int:
        return 0 if tree.parent[b] < 0 else 1 + level(tree.parent[b])
    return max((level(b) for b in range(len(tree.lengths))), default=0)


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


def alone_outputs(tree: Tree, ref: Reference, ids: torch.Tensor, row, seq_len: int, k: int) -> dict:
    """The head's outputs of each rollout run alone, ``[B, S-1, *]``: for ``s < L[b] - 1`` from the
    log-softmax of ``row(p) -> [V]`` (the full logits at packed position ``p``) at its token ``s``'s place
    (``logprobs`` of token ``s + 1``, ``entropy``, ``topk_logprobs`` / ``topk_indices`` of ``k``,
    ``argmax``), 0 after."""
    width = max(seq_len - 1, 0)
    out = {"logprobs": [], "entropy": [], "topk_logprobs": [], "topk_indices": [], "argmax": []}
    for b, n in enumerate(tree.lengths):
        lp = [row(path_place(tree, ref, b, s)).log_softmax(-1) for s in range(n - 1)]  # [V] each
        pad = width - len(lp)
        zero, zeros = torch.zeros(pad, dtype=torch.float64), torch.zeros(pad, k, dtype=torch.float64)
        best = [torch.topk(x, k) for x in lp]
        rows = {"logprobs": [x[ids[b, s + 1]] for s, x in enumerate(lp)],
                "entropy": [-(x.exp() * x).sum() for x in lp], "topk_logprobs": [t.values for t in best],
                "topk_indices": [t.indices for t in best], "argmax": [x.argmax() for x in lp]}
        for name, values in rows.items():
            tail = zeros if name.startswith("topk") else zero
            tail = tail.long() if name in ("topk_indices", "argmax") else tail
            out[name].append(torch.cat([torch.stack(values), tail]) if values else tail)
    return {name: torch.stack(v) for name, v in out.items()}
