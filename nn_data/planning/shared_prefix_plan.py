"""The step plan over GRPO groups: each group's prompt packed once per microbatch it lands in. The thin spelling
of :func:`~nn_data.planning.tree_plan.plan_step_rollout_tree`: the groups become the depth-1 tree (each
rollout's parent its group's first, ``branch_at`` its prompt length) planned by the one planner
(:func:`~nn_data.planning.tree_plan.plan_trees`).

Vocabulary
    n   rollouts of the step; ``L[b]`` their lengths, ``P[b]`` the prompt rollout ``b`` shares with
        the others of its group ``g[b]`` (every rollout of a group has the same ``P``)
    m   ``parallelism.pad_multiple``; T ``pad_full_seq_to``; h ``hidden_size``

A group costs

    need = round_up(P, m) + sum over its rollouts of round_up(L - P, m)     (tokens of a microbatch)
    work = P * (P + 6h) + sum over its rollouts of (L - P) * (L + P + 6h)

Example: lengths ``[10, 12, 9, 6]``, prefix lengths ``[8, 8, 8, 2]``, groups ``[5, 5, 5, 3]``, m 1,
T 16: group 5 needs ``8 + 2 + 4 + 1 = 15``, group 3 ``2 + 4 = 6``; on one rank with T 16 they
take two microbatches, ``[0, 1, 2]`` (15 tokens; end to end they would be 31) and ``[3]``. With T 12
group 5 is split: responses ``[2, 4, 1]`` into bins of ``12 - 8 = 4`` -> ``[1]`` and ``[0, 2]``:
parts ``[1]`` (12 tokens) and ``[0, 2]`` (11 tokens), its prompt in each."""

from __future__ import annotations

from typing import Optional

import numpy as np

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.planning.alignment import Parallelism
from nn_data.planning.step import StepPlan, check_args, first_over, host_ints, host_lengths
from nn_data.planning.tree_plan import plan_trees


def check_groups(lengths: np.ndarray, prefix_lengths: np.ndarray, group_ids: np.ndarray, *, multiple: int,
                 total: int) -> np.ndarray:
    """Each rollout's group leader ``[n]`` (the group's first rollout), after refusing a prefix longer than its
    rollout, prefix lengths that differ inside a group and a rollout whose prompt and response cannot fit
    ``total`` together."""
    n = int(lengths.size)
    if prefix_lengths.size != n:
        raise PackingError(f"prefix_lengths has {prefix_lengths.size} entries for {n} rollouts (lengths); expected "
                           "one per rollout")
    past = np.flatnonzero(prefix_lengths > lengths)
    if past.size:
        i = int(past[0])
        raise PackingError(f"prefix_lengths[{i}] = {int(prefix_lengths[i])} is invalid; it is past the rollout's "
                           f"length lengths[{i}] = {int(lengths[i])} (a prompt is part of its rollout)")
    alone = round_up(prefix_lengths, multiple) + round_up(lengths - prefix_lengths, multiple)  # [n] its prompt with it
    i = first_over(alone, total)
    if i is not None:
        raise PackingError(f"lengths[{i}] = {int(lengths[i])} with prefix_lengths[{i}] = {int(prefix_lengths[i])} "
                           f"takes {int(alone[i])} tokens alone (prompt and response each padded to a multiple of "
                           f"{multiple}), more than pad_full_seq_to={total}; raise pad_full_seq_to")
    order = np.argsort(group_ids, kind="stable")  # [n] rollouts group by group, each group in index order
    ids = group_ids[order]
    is_start = np.concatenate([ids[:1] == ids[:1], ids[1:] != ids[:-1]])  # [n] e.g. ids [3 5 5 5] -> [T T F F]
    leader = np.empty(n, dtype=np.int64)
    leader[order] = order[np.flatnonzero(is_start)][np.cumsum(is_start) - 1]  # each rollout's group's first
    differ = np.flatnonzero(prefix_lengths[order] != prefix_lengths[leader[order]])
    if differ.size:
        i, first = int(order[differ[0]]), int(leader[order[differ[0]]])
        raise PackingError(f"prefix_lengths[{i}] = {int(prefix_lengths[i])} differs from prefix_lengths[{first}] = "
                           f"{int(prefix_lengths[first])} of the same group (group_ids {int(group_ids[i])}); the "
                           "rollouts of a group share one prompt")
    return leader


def plan_step_shared_prefix(lengths, parallelism: Parallelism, *, group_ids, prefix_lengths, pad_full_seq_to: int,
                            microbatches_per_rank: Optional[int] = None, balance: str = "work",
                            hidden_size: int = 4096) -> StepPlan:
    """Plan one GRPO step's rollouts as :func:`~nn_data.planning.plan_step` does, each group kept together and
    its prompt charged once per microbatch it lands in (module docstring).

    Args:
        group_ids: ``[n]``; rollouts with equal ids share a prompt.
        prefix_lengths: ``[n]``, the prompt's tokens (the same in a group, at most the rollout's length).

    The :class:`StepPlan`'s ``ranks[r][j]`` lists rollout indices group by group (each group in index order: its
    first is its leader); ``microbatch_tokens``, ``microbatch_work`` and ``real_tokens`` count each prompt once
    per microbatch. Raises :class:`PackingError` naming the argument for everything :func:`plan_step` refuses,
    ``group_ids`` or ``prefix_lengths`` not one int per rollout, a prefix longer than its rollout, prefix lengths
    that differ inside a group, a rollout whose prompt and response cannot fit ``pad_full_seq_to`` together."""
    check_args(parallelism, balance, hidden_size, microbatches_per_rank)
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    prefix = host_lengths(prefix_lengths, "prefix_lengths")
    ids = host_ints(group_ids, "group_ids", "a 1-D sequence of ints, one per rollout (rollouts of one group share "
                    "its id)").astype(np.int64)
    if ids.size != arr.size:
        raise PackingError(f"group_ids has {ids.size} entries for {arr.size} rollouts (lengths); expected one per "
                           "rollout")
    leader = check_groups(arr, prefix, ids, multiple=parallelism.pad_multiple, total=total)
    star = (leader != np.arange(arr.size)) & (prefix > 0)  # [n] a follower shares its leader's prompt
    parent, branch_at = np.where(star, leader, -1), np.where(star, prefix, 0)  # the depth-1 tree
    return plan_trees(arr, parent, branch_at, parallelism, total=total, balance=balance, hidden_size=hidden_size,
                      microbatches_per_rank=microbatches_per_rank, extra=prefix,
                      order=lambda parts: _in_order(parts, ids))


def _in_order(items: list, ids: np.ndarray) -> list:
    """A microbatch's rollouts from its items: group by group in the order the groups come, each group's
    rollouts in index order (parts of one group that met in a microbatch are merged: one prompt).
    Example: items ``[[4, 6], [1], [5]]``, rollouts 4, 5, 6 of group 9 and 1 of group 2 -> ``[4, 5, 6, 1]``."""
    runs: dict = {}
    for rows in items:
        runs.setdefault(int(ids[rows[0]]), []).extend(rows)
    return [b for rows in runs.values() for b in sorted(rows)]
