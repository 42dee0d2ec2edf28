"""The step plan over rollout trees: each tree in one microbatch where it fits, every shared node charged once
per microbatch it lands in.

Vocabulary
    n   rollouts of the step; ``L[b]`` their lengths; ``parent[b]`` (an earlier rollout, or -1) and
        ``branch_at[b]`` (the tokens ``b`` shares with it): the tree (``nn_data.layout.tree_layout``)
    m   ``parallelism.pad_multiple``; T ``pad_full_seq_to``; h ``hidden_size``
    item    what the planner places whole: a tree, or a part of a tree too large for one microbatch

A microbatch packs the tree of the rollouts it holds (:func:`subtree`: each rollout's parent the nearest
ancestor present, sharing what it shares with that one), as ``tree_layout`` lays it out: each rollout's own
tokens split where its children branch, every node rounded up to ``m``. So a set of rollouts costs

    need = sum over its nodes of round_up(node, m)
    work = sum over its nodes starting at position d, n tokens long, of (d + n)^2 - d^2 + 6hn

(:func:`~nn_data.planning.step.sequence_work`'s model: a node's queries see its ``d`` ancestors' tokens
and causally their own). A rollout alone costs ``sequence_work(L)``; a GRPO group (the depth-1 tree) the
prompt once and each response, as :func:`~nn_data.planning.shared_prefix_plan.plan_step_shared_prefix`.

A tree whose need is above T is split greedily in index order into parts of at most T, each part packing
again the ancestors its rollouts need (a part's first rollout re-rooted with all its tokens). The items are
placed by :func:`~nn_data.planning.step.place`, :func:`~nn_data.planning.plan_step`'s rules; parts of
one tree that meet in a microbatch share their ancestors there, so a microbatch costs at most the sum of
its items' needs: ``plan_step``'s guarantees hold (every rollout once, every microbatch at most T, the
same microbatch count on every rank, the ranks' work balanced).

Example: lengths ``[10, 12, 9]``, parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, m 1: nodes ``[0,6)
[6,10)`` of rollout 0, ``[6,8) [8,12)`` of 1, ``[8,9)`` of 2: need ``6 + 4 + 2 + 4 + 1 = 17`` (31 end to
end); with T 16 the tree is split in index order: ``[0, 1]`` (``6 + 4 + 6 = 16``) and ``[2]`` (9, re-rooted).
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
    """``(parent, branch_at)`` of the rollouts ``rows`` (ascending indices) alone, indices into ``rows``:
    each one's nearest ancestor in ``rows``, with the tokens it shares with it (the smallest ``branch_at``
    on the way up), or -1 and 0. Example: parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, rows ``[0, 2]``
    -> ``[-1, 0]``, ``[0, 6]`` (rollout 2 shares 6 tokens of rollout 0 through rollout 1)."""
    where = {int(r): i for i, r in enumerate(rows)}
    out_parent, out_at = np.full(len(rows), -1, dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):  # host ints: a walk up each path
        shared, p = int(branch_at[r]), int(parent[r])
        while p >= 0 and p not in where:
            shared, p = min(shared, int(branch_at[p])), int(parent[p])
        if p >= 0 and shared > 0:
            out_parent[i], out_at[i] = where[p], shared
    return out_parent, out_at


def tree_cost(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray, rows, *, multiple: int,
              hidden_size: int) -> tuple[int, int, float]:
    """``(packed tokens, real tokens, work)`` of a microbatch of ``rows`` (module docstring)."""
    rows = list(rows)
    sub_parent, sub_at = subtree(parent, branch_at, rows)
    tokens = real = 0
    work = 0.0
    for i, r in enumerate(rows):
        splits = sorted({int(sub_at[c]) for c in range(len(rows)) if sub_parent[c] == i})
        points = [int(sub_at[i])] + [s for s in splits if s > sub_at[i]] + [int(lengths[r])]
        for d, e in zip(points, points[1:]):
            tokens += int(round_up(e - d, multiple))
            real += e - d
            work += float(e * e - d * d) + 6.0 * hidden_size * (e - d)
    return tokens, real, work


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
        if not -1 <= p < b:
            raise PackingError(f"parent[{b}] = {p} is invalid; rollout {b}'s parent must be an earlier rollout, in "
                               f"[0, {b}), or -1 for none")
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
    cost = lambda rows: tree_cost(arr, up, at, rows, multiple=m, hidden_size=hidden_size)  # noqa: E731
    items = []
    root = np.arange(arr.size)
    for b in range(arr.size):
        root[b] = root[up[b]] if up[b] >= 0 else b
    for r in np.unique(root).tolist():  # sync: none, numpy host data (the planner is host code)
        part: list = []
        for b in np.flatnonzero(root == r).tolist():  # sync: none, numpy host data
            if part and cost(part + [b])[0] > total:
                items.append(part)
                part = []
            part.append(b)
        items.append(part)
    costs = [cost(rows) for rows in items]
    placed, steps = place(np.asarray([c[0] for c in costs], dtype=np.int64),
                          np.asarray([c[2] for c in costs], dtype=np.float64), total=total, dp=parallelism.dp,
                          balance=balance, given=microbatches_per_rank)
    ranks = [[sorted(b for j in mb for b in items[j]) for mb in rank] for rank in placed]
    mb_costs = [[cost(mb) for mb in rank] for rank in ranks]
    return StepPlan(pad_full_seq_to=total, ranks=ranks, microbatch_tokens=[[c[0] for c in r] for r in mb_costs],
                    microbatch_work=[[c[2] for c in r] for r in mb_costs],
                    real_tokens=sum(c[1] for r in mb_costs for c in r), balance=balance, steps=steps,
                    imbalance_bound=imbalance_bound(np.asarray([c[2] for c in costs]), parallelism.dp))
