"""The step plan over GRPO groups: each group's prompt packed once per microbatch it lands in.

Vocabulary
    n   rollouts of the step; ``L[b]`` their lengths, ``P[b]`` the prompt rollout ``b`` shares with
        the others of its group ``g[b]`` (every rollout of a group has the same ``P``)
    m   ``parallelism.pad_multiple``; T ``pad_full_seq_to``; h ``hidden_size``
    item    what the planner places whole: a group, or a part of a group too large for one microbatch

A microbatch packs, per group it holds, the prompt once and then each rollout's response, every
slot rounded up to ``m`` (the shared-prefix layout, ``nn_data.layout.prefix_layout``: a prompt slot
per group, a response slot per rollout). So an item costs

    need = round_up(P, m) + sum over its rollouts of round_up(L - P, m)     (tokens of a microbatch)
    work = P * (P + 6h) + sum over its rollouts of (L - P) * (L + P + 6h)

The work is :func:`~nn_data.planning.step.sequence_work`'s model with the prompt charged once: a
response's queries see the prompt and the response, so its attention is what the whole rollout's
``L^2`` adds to the prompt's ``P^2`` (``L^2 - P^2``), and its linear layers run on its ``L - P``
tokens. A group of one rollout costs exactly ``sequence_work(L)``.

A group whose need is above T is split by first-fit-decreasing of its responses into parts of at most
``T - round_up(P, m)`` response tokens, each part with the prompt again. First fit leaves any two
parts together above T, so two parts of one group never share a microbatch: every microbatch holds
each of its groups' prompts once, and its packed tokens are the sum of its items' needs. A step with
fewer items than ranks has its widest items halved (the prompt in both) until every rank can have one,
rather than leaving ranks idle.

The items are planned by :func:`~nn_data.planning.step.place`, :func:`~nn_data.planning.step.plan_step`'s
own rules (least-loaded rank with room, first fit inside it, refinement; or NeMo-RL's deal), so the
guarantees are :func:`plan_step`'s: every rollout exactly once, every microbatch at most T tokens,
the same microbatch count on every rank, the ranks' work balanced.

Example: lengths ``[10, 12, 9, 6]``, prefix lengths ``[8, 8, 8, 2]``, groups ``[5, 5, 5, 3]``, m 1,
T 16: group 5 needs ``8 + 2 + 4 + 1 = 15``, group 3 ``2 + 4 = 6``; on one rank with T 16 they
take two microbatches, ``[0, 1, 2]`` (15 tokens; end to end they would be 31) and ``[3]``. With T 12
group 5 is split: responses ``[2, 4, 1]`` into bins of ``12 - 8 = 4`` -> ``[1]`` and ``[0, 2]``:
parts ``[1]`` (12 tokens) and ``[0, 2]`` (11 tokens), its prompt in each.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.planning.alignment import Parallelism
from nn_data.planning.ffd import first_fit_decreasing
from nn_data.planning.step import (StepPlan, check_args, host_lengths, imbalance_bound, place, sequence_work,
                                   short_repr)


class Rollouts(NamedTuple):
    """The step's rollouts as the planner costs them, each ``[n]``: ``ids`` group ids; ``prompt`` /
    ``response`` padded prompt and response tokens; ``prefix`` / ``real`` the unpadded ones; ``head_work``
    the prompt's work ``P(P + 6h)``; ``tail_work`` the response's ``(L - P)(L + P + 6h)``."""

    ids: np.ndarray
    prompt: np.ndarray
    response: np.ndarray
    prefix: np.ndarray
    real: np.ndarray
    head_work: np.ndarray
    tail_work: np.ndarray

    def cost(self, rows) -> tuple:
        """``(packed tokens, real tokens, work)`` of a microbatch of ``rows``: each group's prompt once (its
        first rollout there is the leader), every rollout's response. Example (m 1): prompts ``[8, 8, 2]``,
        responses ``[2, 4, 4]``, groups ``[5, 5, 3]``, rows ``[0, 1, 2]`` -> ``8 + 2 + 2 + 4 + 4 = 20`` tokens."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        heads = rows[np.unique(self.ids[rows], return_index=True)[1]]  # the first rollout of each group
        return (int(self.response[rows].sum() + self.prompt[heads].sum()),
                int(self.real[rows].sum() + self.prefix[heads].sum()),
                float(self.tail_work[rows].sum() + self.head_work[heads].sum()))


def host_group_ids(group_ids, n: int) -> np.ndarray:
    """``group_ids`` (a list, tuple, numpy array or tensor of ``n`` ints; any value) as int64 numpy;
    :class:`PackingError` naming the argument otherwise."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()  # sync: the planner runs on the host, once per step
    arr = np.asarray(group_ids)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)) or arr.dtype == np.bool_:
        raise PackingError(f"group_ids={short_repr(group_ids)} is invalid; expected a 1-D "
                           "sequence of ints, one per rollout (rollouts of one group share its id)")
    if arr.size != n:
        raise PackingError(f"group_ids has {arr.size} entries for {n} rollouts (lengths); expected one per rollout")
    return arr.astype(np.int64)


def host_rollouts(lengths: np.ndarray, prefix_lengths: np.ndarray, group_ids: np.ndarray, *, multiple: int,
                  total: int, hidden_size: int) -> Rollouts:
    """The step's :class:`Rollouts`, after refusing a prefix longer than its rollout, prefix lengths that
    differ inside a group and a rollout whose prompt and response cannot fit ``total`` together."""
    n = int(lengths.size)
    if prefix_lengths.size != n:
        raise PackingError(f"prefix_lengths has {prefix_lengths.size} entries for {n} rollouts (lengths); expected "
                           "one per rollout")
    past = np.flatnonzero(prefix_lengths > lengths)
    if past.size:
        i = int(past[0])
        raise PackingError(f"prefix_lengths[{i}] = {int(prefix_lengths[i])} is invalid; it is past the rollout's "
                           f"length lengths[{i}] = {int(lengths[i])} (a prompt is part of its rollout)")
    prompt, response = round_up(prefix_lengths, multiple), round_up(lengths - prefix_lengths, multiple)
    alone = prompt + response  # [n] a rollout alone in a microbatch, its prompt with it
    long = np.flatnonzero(alone > total)
    if long.size:
        i = int(long[0])
        raise PackingError(f"lengths[{i}] = {int(lengths[i])} with prefix_lengths[{i}] = {int(prefix_lengths[i])} "
                           f"takes {int(alone[i])} tokens alone (prompt and response each padded to a multiple of "
                           f"{multiple}), more than pad_full_seq_to={total}; raise pad_full_seq_to")
    order = np.argsort(group_ids, kind="stable")  # [n] rollouts group by group, each group in index order
    ids = group_ids[order]
    is_start = np.concatenate([ids[:1] == ids[:1], ids[1:] != ids[:-1]])  # [n] e.g. ids [3 5 5 5] -> [T T F F]
    leader = order[np.flatnonzero(is_start)][np.cumsum(is_start) - 1]  # [n] each sorted rollout's group's first
    differ = np.flatnonzero(prefix_lengths[order] != prefix_lengths[leader])
    if differ.size:
        i, first = int(order[differ[0]]), int(leader[differ[0]])
        raise PackingError(f"prefix_lengths[{i}] = {int(prefix_lengths[i])} differs from prefix_lengths[{first}] = "
                           f"{int(prefix_lengths[first])} of the same group (group_ids {int(group_ids[i])}); the "
                           "rollouts of a group share one prompt")
    tail = (lengths - prefix_lengths).astype(np.float64) * (lengths + prefix_lengths + 6.0 * hidden_size)
    return Rollouts(ids=group_ids, prompt=prompt, response=response, prefix=prefix_lengths,
                    real=lengths - prefix_lengths, head_work=sequence_work(prefix_lengths, hidden_size),
                    tail_work=tail)


def group_items(rollouts: Rollouts, *, total: int, ranks: int) -> list:
    """The items (module docstring): ``items[j]`` the rollout indices of item ``j`` in index order, items
    in the order of their first rollout. A group that fits ``total`` is one item; a larger one is split by
    first-fit-decreasing of its responses into parts of at most ``total - round_up(P, m)`` response tokens."""
    ids = rollouts.ids
    order = np.argsort(ids, kind="stable")  # [n] group by group, each in index order
    cuts = np.flatnonzero(ids[order][1:] != ids[order][:-1]) + 1  # [groups - 1] where a new group begins
    items = []
    for rows in np.split(order, cuts) if ids.size else []:
        rows = rows.tolist()  # sync: none, numpy on the host
        head = int(rollouts.prompt[rows[0]])
        if head + int(rollouts.response[rows].sum()) <= total:
            items.append(rows)
            continue
        bins = first_fit_decreasing(rollouts.response[rows], total - head).bins
        items += [sorted(rows[k] for k in b) for b in bins]
    items = _split_for_idle_ranks(items, rollouts.response, ranks=ranks)
    return sorted(items, key=lambda rows: rows[0])


def _split_for_idle_ranks(members: list, response: np.ndarray, *, ranks: int) -> list:
    """Fewer items than ranks would leave ranks idle: the item with the most response tokens (of those
    with two rollouts or more) is halved, its prompt in both halves, until every rank can have one.
    The halves: its rollouts by response length, longest first, each to the half with fewer tokens.
    Example: one group, responses ``[5, 1, 4, 2]``, 2 ranks -> ``[0, 1]`` (6) and ``[2, 3]`` (6)."""
    members = [list(rows) for rows in members]
    while len(members) < ranks:
        size = [int(response[rows].sum()) if len(rows) > 1 else -1 for rows in members]
        widest = max(range(len(members)), key=size.__getitem__, default=-1)
        if widest < 0 or size[widest] < 0:
            break
        halves, load = ([], []), [0, 0]
        for b in sorted(members[widest], key=lambda b: (-int(response[b]), b)):
            side = 0 if (load[0], len(halves[0])) <= (load[1], len(halves[1])) else 1  # fewer tokens, then rollouts
            halves[side].append(b)
            load[side] += int(response[b])
        members[widest:widest + 1] = [sorted(halves[0]), sorted(halves[1])]
    return members


def plan_step_shared_prefix(lengths, parallelism: Parallelism, *, group_ids, prefix_lengths, pad_full_seq_to: int,
                            microbatches_per_rank: Optional[int] = None, balance: str = "work",
                            hidden_size: int = 4096) -> StepPlan:
    """Plan one GRPO step's rollouts as :func:`~nn_data.planning.plan_step` does, each group kept together and
    its prompt charged once per microbatch it lands in (module docstring: the costs and the split).

    ``group_ids [n]``: rollouts with equal ids share a prompt of ``prefix_lengths [n]`` tokens (the same in a
    group, at most the rollout's length). The :class:`StepPlan`'s ``ranks[r][j]`` lists rollout indices
    group by group (each group in index order: its first is its leader); ``microbatch_tokens`` are the
    shared-prefix packed tokens, ``microbatch_work`` the work with the prompt once, ``real_tokens`` the
    unpadded tokens packed (each prompt once per microbatch it is in).

    Raises :class:`PackingError` naming the argument for everything :func:`plan_step` refuses and for:
    ``group_ids`` or ``prefix_lengths`` not one int per rollout, a prefix longer than its rollout,
    prefix lengths that differ inside a group, a rollout whose prompt and response (each padded to
    ``parallelism.pad_multiple``) cannot fit ``pad_full_seq_to`` together.
    """
    check_args(parallelism, balance, hidden_size, microbatches_per_rank)
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    rollouts = host_rollouts(arr, host_lengths(prefix_lengths, "prefix_lengths"), host_group_ids(group_ids, arr.size),
                             multiple=parallelism.pad_multiple, total=total, hidden_size=hidden_size)
    items = group_items(rollouts, total=total, ranks=parallelism.dp)
    costs = [rollouts.cost(rows) for rows in items]  # (tokens, real, work) per item
    need = np.asarray([c[0] for c in costs], dtype=np.int64)
    work = np.asarray([c[2] for c in costs], dtype=np.float64)
    placed, steps = place(need, work, total=total, dp=parallelism.dp, balance=balance, given=microbatches_per_rank)
    ranks = [[_in_order([items[j] for j in mb], rollouts.ids) for mb in rank] for rank in placed]
    mb_costs = [[rollouts.cost(mb) for mb in rank] for rank in ranks]
    return StepPlan(pad_full_seq_to=total, ranks=ranks, microbatch_tokens=[[c[0] for c in r] for r in mb_costs],
                    microbatch_work=[[c[2] for c in r] for r in mb_costs],
                    real_tokens=sum(c[1] for r in mb_costs for c in r), balance=balance, steps=steps,
                    imbalance_bound=imbalance_bound(work, parallelism.dp))


def _in_order(items: list, ids: np.ndarray) -> list:
    """A microbatch's rollouts from its items: group by group in the order the groups come, each group's
    rollouts in index order (parts of one group that met in a microbatch are merged: one prompt).
    Example: items ``[[4, 6], [1], [5]]``, rollouts 4, 5, 6 of group 9 and 1 of group 2 -> ``[4, 5, 6, 1]``."""
    runs: dict = {}
    for rows in items:
        runs.setdefault(int(ids[rows[0]]), []).extend(rows)
    return [b for rows in runs.values() for b in sorted(rows)]
