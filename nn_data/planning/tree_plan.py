"""The step plan over rollout trees: each tree in one microbatch where it fits, every shared node charged once
per microbatch it lands in. The one planner of both spellings: :func:`plan_step_rollout_tree` and the GRPO
groups' :func:`~nn_data.planning.shared_prefix_plan.plan_step_shared_prefix` (the depth-1 tree) call
:func:`plan_trees`.

Vocabulary
    n   rollouts of the step; ``L[b]`` their lengths; ``parent[b]`` (an earlier rollout, or -1) and
        ``branch_at[b]`` (the tokens ``b`` shares with it): the tree (``nn_data.layout.tree_layout``)
    m   ``parallelism.pad_multiple``; T ``pad_full_seq_to``; h ``hidden_size``
    item    what the planner places whole: a tree, or a part of a tree too large for one microbatch

A microbatch packs the tree of the rollouts it holds (:func:`subtree`: each rollout's parent the earlier one
present it shares the most tokens with by the tree), as ``tree_layout`` lays it out: each rollout's own
tokens split where its children branch, every node rounded up to ``m``. So a set of rollouts costs

    need = sum over its nodes of round_up(node, m)
    work = sum over its nodes starting at position d, n tokens long, of (d + n)^2 - d^2 + 6hn

(:func:`~nn_data.planning.step.sequence_work`'s model: a node's queries see its ``d`` ancestors' tokens
and causally their own). A rollout alone costs ``sequence_work(L)``; a GRPO group (the depth-1 tree) the
prompt once and each response, as :func:`~nn_data.planning.shared_prefix_plan.plan_step_shared_prefix`.

A tree whose need is above T is split by first-fit-decreasing of its rollouts' own tokens into parts of at
most T, each part packing again what its rollouts share (a part's first rollout re-rooted with all its tokens;
for a GRPO group: the prompt in each part); a step with fewer items than ranks has its widest items halved
rather than leave ranks idle (:func:`split_for_idle_ranks`). The items are
placed by :func:`~nn_data.planning.step.place`, :func:`~nn_data.planning.plan_step`'s rules; parts of
one tree that meet in a microbatch share their ancestors there, so a microbatch costs at most the sum of
its items' needs: ``plan_step``'s guarantees hold (every rollout once, every microbatch at most T, the
same microbatch count on every rank, the ranks' work balanced).

Example: lengths ``[10, 12, 9]``, parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, m 1: nodes ``[0,6)
[6,10)`` of rollout 0, ``[6,8) [8,12)`` of 1, ``[8,9)`` of 2: need ``6 + 4 + 2 + 4 + 1 = 17`` (31 end to
end); with T 16 the tree is split (own tokens 10, 6, 1): ``[0, 1]`` (``6 + 4 + 6 = 16``) and ``[2]`` (9,
re-rooted).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.planning.alignment import Parallelism
from nn_data.planning.step import StepPlan, check_args, host_lengths, imbalance_bound, place


def subtree(parent, branch_at, rows) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, branch_at)`` of the rollouts ``rows`` (ascending indices) alone, indices into ``rows``: each
    one's parent the earlier rollout of ``rows`` it shares the most tokens with by the tree (the smallest index
    among equals), with that count, or -1 and 0. Two rollouts share the fewest ``branch_at`` on the tree path
    between them (their own tokens stop where the path leaves them); choosing the smallest index among the
    longest makes every branch point exceed its parent's, as ``tree_layout`` takes it.

    Example: parent ``[-1, 0, 1, 0]``, branch_at ``[0, 6, 8, 4]``, rows ``[0, 2]`` -> ``[-1, 0]``, ``[0, 6]``
    (rollout 2 shares 6 tokens of rollout 0 through rollout 1); rows ``[2, 3]`` -> ``[-1, 0]``, ``[0, 4]``
    (siblings through their absent parent); a GRPO group without its first rollout: its next one leads.
    """
    rows = list(rows)
    chains = [_chain(parent, branch_at, int(r)) for r in rows]
    out_parent, out_at = np.full(len(rows), -1, dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
    by_root: dict = {}  # root -> the positions in rows of its tree's rollouts so far
    for i, chain in enumerate(chains):  # host ints: a pass over each pair of one tree's rollouts
        root = next(reversed(chain))
        best, at = -1, 0
        for j in by_root.setdefault(root, []):
            other = chains[j]
            shared = max(min(v, other[a]) for a, v in chain.items() if a in other)
            if shared > at:
                best, at = j, shared
        out_parent[i], out_at[i] = best, at
        by_root[root].append(i)
    return out_parent, out_at


def _chain(parent, branch_at, r: int) -> dict:
    """``{ancestor: tokens it shares with r}`` from ``r`` (every token, an unbounded count) up to its root, in
    that order. Example: parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, r 2 -> ``{2: inf, 1: 8, 0: 6}``."""
    chain, shared = {r: float("inf")}, float("inf")
    while int(parent[r]) >= 0:
        check_parent(r, int(parent[r]))  # each step goes to an earlier rollout: the walk ends
        shared, r = min(shared, int(branch_at[r])), int(parent[r])
        chain[r] = shared
    return chain


def check_parent(b: int, p: int) -> None:
    """:class:`PackingError` unless rollout ``b``'s parent ``p`` is an earlier rollout or -1."""
    if not -1 <= p < b:
        raise PackingError(f"parent[{b}] = {p} is invalid; rollout {b}'s parent must be an earlier rollout, in "
                           f"[0, {b}), or -1 for none")


def tree_cost(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray, rows, *, multiple: int,
              hidden_size: int, extra: Optional[np.ndarray] = None) -> tuple[int, int, float]:
    """``(packed tokens, real tokens, work)`` of a microbatch of ``rows`` (any order; module docstring), as
    ``tree_layout`` packs :func:`subtree`'s tree of them. ``extra [n]``: a split point of each rollout's own
    tokens besides its children's (the GRPO spelling's prompt slot: ``shared_prefix_layout`` packs the first
    rollout of a group in a microbatch as prompt, then response)."""
    rows = sorted(int(r) for r in rows)
    sub_parent, sub_at = subtree(parent, branch_at, rows)
    children: dict = {}
    for c, p in enumerate(sub_parent.tolist()):  # sync: none, numpy on the host
        children.setdefault(p, set()).add(int(sub_at[c]))
    tokens = real = 0
    work = 0.0
    for i, r in enumerate(rows):
        cuts = children.get(i, set()) | ({int(extra[r])} if extra is not None else set())
        begin, end = int(sub_at[i]), int(lengths[r])
        points = [begin] + sorted(s for s in cuts if begin < s < end) + [end]
        for d, e in zip(points, points[1:]):
            tokens += int(round_up(e - d, multiple))
            real += e - d
            work += float(e * e - d * d) + 6.0 * hidden_size * (e - d)
    return tokens, real, work


def tree_items(trees: list, cost, own: np.ndarray, *, total: int, ranks: int) -> list:
    """What the planner places whole, each a list of rollout indices (ascending), in the order of their first
    rollout: a tree (``trees``: each tree's rollouts, ascending) whose ``cost(rows)[0]`` fits ``total``; a larger
    one split by first-fit-decreasing of its rollouts' ``own`` padded tokens (longest first, ties in index
    order), each into the first part it fits with (the part's cost, the ancestors it needs packed again).
    Fewer items than ``ranks``: :func:`split_for_idle_ranks`.

    Example (a GRPO group, prompt 8, responses ``[2, 4, 1]``, m 1, T 12): parts ``[1]`` (12) and ``[0, 2]``
    (11), the prompt in each.
    """
    items = []
    for rows in trees:
        if cost(rows)[0] <= total:
            items.append(list(rows))
            continue
        parts: list = []
        for b in sorted(rows, key=lambda b: -int(own[b])):  # stable: ties in index order
            part = next((p for p in parts if cost(p + [b])[0] <= total), None)
            if part is None:
                parts.append([b])
            else:
                part.append(b)
        items += [sorted(p) for p in parts]
    return sorted(split_for_idle_ranks(items, own, ranks=ranks), key=lambda rows: rows[0])


def split_for_idle_ranks(members: list, own: np.ndarray, *, ranks: int) -> list:
    """Fewer items than ranks would leave ranks idle: the item with the most ``own`` tokens (of those with two
    rollouts or more) is halved, what its halves share packed in both, until every rank can have one. The
    halves: its rollouts by own tokens, longest first, each to the half with fewer tokens (then rollouts).
    Example: one GRPO group, responses ``[5, 1, 4, 2]``, 2 ranks -> ``[0, 1]`` (6) and ``[2, 3]`` (6)."""
    members = [list(rows) for rows in members]
    while len(members) < ranks:
        size = [int(own[rows].sum()) if len(rows) > 1 else -1 for rows in members]
        widest = max(range(len(members)), key=size.__getitem__, default=-1)
        if widest < 0 or size[widest] < 0:
            break
        halves, load = ([], []), [0, 0]
        for b in sorted(members[widest], key=lambda b: (-int(own[b]), b)):
            side = 0 if (load[0], len(halves[0])) <= (load[1], len(halves[1])) else 1  # fewer tokens, then rollouts
            halves[side].append(b)
            load[side] += int(own[b])
        members[widest:widest + 1] = [sorted(halves[0]), sorted(halves[1])]
    return members


def plan_trees(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray, parallelism: Parallelism, *,
               total: int, balance: str, hidden_size: int, microbatches_per_rank: Optional[int],
               extra: Optional[np.ndarray] = None, order=None) -> StepPlan:
    """The planner of both spellings, on a checked tree (host arrays): the items (:func:`tree_items`), placed by
    :func:`~nn_data.planning.step.place`, each microbatch's rollouts listed by ``order(items)`` (default:
    ascending), its costs by :func:`tree_cost` (``extra``: as there)."""
    m = parallelism.pad_multiple
    cost = lambda rows: tree_cost(lengths, parent, branch_at, rows, multiple=m, hidden_size=hidden_size,  # noqa: E731
                                  extra=extra)
    start = branch_at if extra is None else np.maximum(branch_at, extra)
    own = round_up(lengths - start, m)  # [n] each rollout's own tokens, padded (a GRPO rollout's response)
    root = np.arange(lengths.size)
    for b in range(lengths.size):
        root[b] = root[parent[b]] if parent[b] >= 0 else b
    trees = [np.flatnonzero(root == r).tolist() for r in np.unique(root).tolist()]  # sync: none, numpy host data
    items = tree_items(trees, cost, own, total=total, ranks=parallelism.dp)
    costs = [cost(rows) for rows in items]
    work = np.asarray([c[2] for c in costs], dtype=np.float64)
    placed, steps = place(np.asarray([c[0] for c in costs], dtype=np.int64), work, total=total, dp=parallelism.dp,
                          balance=balance, given=microbatches_per_rank)
    order = order or (lambda parts: sorted(b for rows in parts for b in rows))
    ranks = [[order([items[j] for j in mb]) for mb in rank] for rank in placed]
    mb_costs = [[cost(mb) for mb in rank] for rank in ranks]
    return StepPlan(pad_full_seq_to=total, ranks=ranks, microbatch_tokens=[[c[0] for c in r] for r in mb_costs],
                    microbatch_work=[[c[2] for c in r] for r in mb_costs],
                    real_tokens=sum(c[1] for r in mb_costs for c in r), balance=balance, steps=steps,
                    imbalance_bound=imbalance_bound(work, parallelism.dp))


def host_ints(values, name: str) -> np.ndarray:
    """``values`` (a list, tuple, numpy array or tensor of ints) as 1-D int64 numpy; :class:`PackingError`
    naming ``name`` otherwise."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()  # sync: the planner runs on the host, once per step
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)) or arr.dtype == np.bool_:
        raise PackingError(f"{name} is invalid; expected a 1-D sequence of ints, one per rollout")
    return arr.astype(np.int64)


def check_tree(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray) -> None:
    """The tree's fields (one int per rollout; a parent earlier, a branch point as ``tree_layout`` takes)."""
    n = lengths.size
    for name, arr in (("parent", parent), ("branch_at", branch_at)):
        if arr.size != n:
            raise PackingError(f"{name} has {arr.size} entries for {n} rollouts (lengths); expected one per rollout")
    for b in range(n):
        p, a = int(parent[b]), int(branch_at[b])
        check_parent(b, p)
        lo, hi = (int(branch_at[p]), min(int(lengths[p]), int(lengths[b]))) if p >= 0 else (-1, 0)
        if (p < 0 and a != 0) or (p >= 0 and not lo < a <= hi):
            raise PackingError(f"branch_at[{b}] = {a} is invalid for parent[{b}] = {p}: a root shares nothing (0), a "
                               f"child more than its parent shares and at most both have (here ({lo}, {hi}])")


def plan_step_rollout_tree(lengths, parallelism: Parallelism, *, parent, branch_at, pad_full_seq_to: int,
                           microbatches_per_rank: Optional[int] = None, balance: str = "work",
                           hidden_size: int = 4096) -> StepPlan:
    """Plan one step's rollout trees as :func:`~nn_data.planning.plan_step` does, each tree kept together where
    it fits and every node charged once per microbatch it lands in (module docstring: costs and the split).

    ``parent [n]``, ``branch_at [n]``: the tree (``nn_data.layout.tree_layout``'s fields). The
    :class:`StepPlan`'s ``ranks[r][j]`` lists rollout indices ascending (pack each microbatch with
    :func:`subtree`'s tree of its rollouts); ``microbatch_tokens`` the tree's packed tokens, ``microbatch_work``
    its work, ``real_tokens`` the unpadded tokens packed (every node once per microbatch it is in).

    Raises :class:`PackingError` naming the argument for everything :func:`plan_step` refuses and for a tree
    ``tree_layout`` refuses, and a rollout longer (padded) than ``pad_full_seq_to``.
    """
    check_args(parallelism, balance, hidden_size, microbatches_per_rank)
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    up, at = host_ints(parent, "parent"), host_ints(branch_at, "branch_at")
    check_tree(arr, up, at)
    m = parallelism.pad_multiple
    long = np.flatnonzero(round_up(arr, m) > total)
    if long.size:
        i = int(long[0])
        raise PackingError(f"lengths[{i}] = {int(arr[i])} takes {int(round_up(arr[i], m))} tokens alone (padded to a "
                           f"multiple of {m}), more than pad_full_seq_to={total}; raise pad_full_seq_to")
    return plan_trees(arr, up, at, parallelism, total=total, balance=balance, hidden_size=hidden_size,
                      microbatches_per_rank=microbatches_per_rank)
