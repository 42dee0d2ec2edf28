"""Which sequences run in which round, and each round's blocks: the algorithm of
:func:`~nn_data.planning.plan_step_dynamic_cp` (:mod:`nn_data.planning.dynamic_cp_plan`).

Vocabulary
    R       ranks of the pool; a round gives each of them ``tpr`` tokens
    sizes   the allowed CP sizes, ascending; ``j`` indexes them, ``c = sizes[j]``
    block   ``c`` ranks sharing their sequences (each sharded over all ``c``): at most ``c * tpr``
            padded tokens; its **load** is its modelled time (the cost model's ``sequence`` costs at
            ``c`` plus ``block(c)``), the same on each of its ranks
    c_min   a sequence's smallest size: the smallest ``c`` whose ``c * tpr`` tokens hold it padded

Each round is planned on its own, in two steps: **its sequences** (:func:`packed_rounds`: best-fit-decreasing
on tokens, a block opened for the longest sequence left at its ``c_min``; one bisection per table and a skip
over the placed, :class:`Alive`, so O(n log n) for the step), then **its blocks**
(:func:`nn_data.planning.cp_tree.balance`, top down over the buddy tree of its ranks), keeping the faster. For
small steps (:data:`CHUNKED_UP_TO`, :data:`STATIC_UP_TO`) equal runs of tokens (:func:`chunks`) and static CP's
plan are tried too. Every round's blocks are laid out largest first from rank 0 (:func:`laid_out`).
docs/dynamic-cp.md, "The plan"."""

from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence

#: Steps of at most this many sequences are also planned as equal runs of tokens (:func:`chunks`).
CHUNKED_UP_TO = 1024
#: Steps of at most this many sequences are also planned as static CP (nn_data.planning.plan_step).
STATIC_UP_TO = 16384
#: A round whose slowest block is within this factor of its ranks' mean time is kept as packed.
BALANCED = 1.005


class Costs(NamedTuple):
    """The tables the algorithm reads, per size index ``j``: ``need[j][i]`` (sequence ``i``'s tokens
    padded for ``sizes[j]``), ``seq[j][i]`` (its ``sequence`` cost there), ``extra[j]`` (a block's
    ``block`` cost), ``capacity[j] = sizes[j] * tpr``; ``c_min[i]`` (the index of ``i``'s smallest
    size); ``order`` (sequences longest first, ties by index) and ``rank_of[i]``, ``i``'s place in it."""

    sizes: list
    need: list
    seq: list
    extra: list
    capacity: list
    c_min: list
    order: list
    rank_of: list


class Alive:
    """Positions ``0 .. n-1`` of the length order not placed yet: ``find(p)`` is the first at or after
    ``p`` (``n`` when none), by path-halving pointers. Example: n 4, remove 1 and 2: ``find(1) -> 3``."""

    def __init__(self, n: int):
        self.next = list(range(n + 1))
        self.n, self.left = n, n

    def find(self, p: int) -> int:
        nxt = self.next
        while nxt[p] != p:
            nxt[p] = nxt[nxt[p]]
            p = nxt[p]
        return p

    def remove(self, p: int) -> None:
        self.next[p] = p + 1
        self.left -= 1


def load(costs: Costs, j: int, items: Sequence[int]) -> float:
    """A block's load: its sequences' costs at ``sizes[j]`` plus the block cost (0 when empty)."""
    return sum(costs.seq[j][i] for i in items) + costs.extra[j] if items else 0.0


def packed_rounds(costs: Costs, ranks: int, promote: int = 0) -> list:
    """Step 1 of the module docstring: rounds, each a list of ``(size index, sequences)`` blocks whose sizes sum to at
    most ``ranks``, every sequence in exactly one. ``promote``: a sequence that needs CP opens its block that many
    sizes larger, so that long sequences share blocks."""
    pos, n, sizes = costs.order, len(costs.order), costs.sizes
    need_at = [[-costs.need[j][i] for i in pos] for j in range(len(sizes))]  # rising along pos
    c_min_at = [-costs.c_min[i] for i in pos]  # rising along pos
    first = [bisect.bisect_left(c_min_at, -j) for j in range(len(sizes))]  # the first position a size holds
    top_of = [bisect.bisect_right(sizes, free) - 1 for free in range(ranks + 1)]  # the largest size <= free
    alive = Alive(n)
    find, remove, left_of = alive.find, alive.remove, bisect.bisect_left
    c_min, capacity, need_of = costs.c_min, costs.capacity, costs.need
    rounds = []
    while alive.left:
        free, blocks = ranks, []
        while free > 0:
            top = top_of[free]
            p = find(first[top])
            if p >= n:
                break
            remove(p)
            i = pos[p]
            j = c_min[i]
            if promote and j > 0:
                j = min(j + promote, top)
            need, items, start = need_at[j], [i], first[j]
            room = capacity[j] - need_of[j][i]
            while True:  # the longest sequences left that fit the block's room
                q = left_of(need, -room)
                q = find(q if q > start else start)
                if q >= n:
                    break
                remove(q)
                items.append(pos[q])
                room += need[q]
            blocks.append((j, items))
            free -= sizes[j]
        rounds.append(blocks)
    return rounds


def chunks(costs: Costs, rounds: int) -> list:
    """The sequences (longest first) cut into ``rounds`` runs of about equal padded tokens at their
    smallest sizes: round ``k`` takes those whose tokens start before ``(k + 1) / rounds`` of the
    step's. Example: tokens ``[6, 4, 4, 2]``, 2 rounds -> starts 0, 6, 10, 14 of 16 -> ``[[0, 1], [2, 3]]``."""
    need = [costs.need[costs.c_min[i]][i] for i in costs.order]
    total = max(sum(need), 1)
    out: list = [[] for _ in range(rounds)]
    start = 0
    for i, n in zip(costs.order, need):
        out[min(rounds - 1, start * rounds // total)].append(i)
        start += n
    return out


def chunked_rounds(costs: Costs, rounds: int) -> Optional[list]:
    """``rounds`` rounds from :func:`chunks`, each planned by the tree (what a round cannot hold moves,
    shortest first, to the next); ``(time, blocks)`` per round (blocks with their loads, as
    :func:`with_loads`), or None when the last cannot hold its."""
    from nn_data.planning import cp_tree

    top = len(costs.sizes) - 1
    out, carried = [], []
    for items in chunks(costs, rounds):
        items, carried = carried + items, []
        while True:
            found = cp_tree.balance(costs, items, top)
            if found is not None:
                break
            carried.insert(0, items.pop())
        out.append(with_loads(costs, found))
    return None if carried else out


def balanced_round(costs: Costs, blocks: list, ranks: int) -> tuple:
    """``(time, blocks)`` for one round of :func:`packed_rounds`, blocks ``(size index, sequences, load)``:
    its own blocks, or the tree's plan of its sequences (:func:`nn_data.planning.cp_tree.balance`) when
    that is faster."""
    from nn_data.planning import cp_tree

    loaded = [(j, items, load(costs, j, items)) for j, items in blocks]
    own = max(x for _, _, x in loaded)
    used = sum(costs.sizes[j] for j, _ in blocks)
    if used == ranks and own <= BALANCED * sum(costs.sizes[j] * x for j, _, x in loaded) / ranks:
        return own, loaded  # every rank busy and within BALANCED of the mean: nothing to gain
    items = sorted((i for _, items in blocks for i in items), key=costs.rank_of.__getitem__)
    tree = cp_tree.balance(costs, items, len(costs.sizes) - 1)
    if tree is not None and tree[0] < own:
        return with_loads(costs, tree)
    return own, loaded


def with_loads(costs: Costs, found: tuple) -> tuple:
    """``(time, blocks)`` with each block ``(size index, sequences, load)``."""
    time, blocks = found
    return time, [(j, items, load(costs, j, items)) for j, items in blocks]


def laid_out(block_sizes: Sequence[int], ranks: int) -> list:
    """``(start, block index)`` for one round's blocks laid out largest first from rank 0, so each
    starts at a multiple of its size (power-of-two sizes summing to at most ``ranks``); the ranks left
    over get empty one-rank blocks (index -1). Example: sizes ``[1, 4, 2]`` on 8 ranks ->
    ``[(0, 1), (4, 2), (6, 0), (7, -1)]``."""
    laid, start = [], 0
    for b in sorted(range(len(block_sizes)), key=block_sizes.__getitem__, reverse=True):  # stable: ties keep order
        laid.append((start, b))
        start += block_sizes[b]
    return laid + [(s, -1) for s in range(start, ranks)]
