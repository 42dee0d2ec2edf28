"""One round's blocks, top down over the buddy tree of its ranks (:mod:`nn_data.planning.cp_rounds`, step 2): a
node of ``c`` ranks runs all its sequences as one block or, when every sequence fits half of it, splits them
into two halves balanced by rank-time and plans each the same way, whichever is faster; O(m log R) for a round
of ``m`` sequences.

Worked example (cost ``L^2 / c``, no block cost, ``tpr = 32``, 4 ranks; lengths ``[48, 24, 16, 8]``): one
block of 4 ranks takes ``3200 / 4 = 800``; halves ``[48]`` (it needs 2 ranks: 1152) and ``[24, 16, 8]``
(``896 / 2 = 448``, or split again ``[24]`` = 576 and ``[16, 8]`` = 320: 576, so 448): 1152. One
block wins: 800."""

from __future__ import annotations

import bisect
import heapq
from typing import Optional

#: Rounds of at most this many sequences may also split their tokens by differencing (:func:`_differenced`).
DIFFERENCED_UP_TO = 256


def balance(costs, items: list, j: int) -> Optional[tuple]:
    """``(time, blocks)`` for ``items`` (sequence ids, heaviest first) on a node of ``sizes[j]`` ranks,
    ``blocks`` a list of ``(size index, sequences)``; None when they do not fit it (module docstring)."""
    if not items:
        return 0.0, []
    need, seq = costs.need[j], costs.seq[j]
    best = None
    if sum(need[i] for i in items) <= costs.capacity[j]:
        best = (sum(seq[i] for i in items) + costs.extra[j], [(j, items)])
    if j > 0 and all(costs.c_min[i] < j for i in items):
        split = halves(costs, items, j - 1)
        if split is not None:
            left, right = balance(costs, split[0], j - 1), balance(costs, split[1], j - 1)
            if left is not None and right is not None and (best is None or max(left[0], right[0]) < best[0]):
                best = (max(left[0], right[0]), left[1] + right[1])
    return best


def halves(costs, items: list, j: int) -> Optional[tuple]:
    """``items`` into two nodes of ``sizes[j]`` ranks: heaviest first, each to the half with less
    rank-time that has room for it (at its padding for ``sizes[j]``); when that leaves one out, the
    halves whose tokens differencing makes most equal (the tokens are what is tight); else None."""
    need, weight, cap = costs.need[j], costs.seq[j], costs.capacity[j]
    sides, loads, tokens = ([], []), [0.0, 0.0], [0, 0]
    for i in items:
        first = 0 if loads[0] <= loads[1] else 1
        for s in (first, 1 - first):
            if tokens[s] + need[i] <= cap:
                sides[s].append(i)
                loads[s] += weight[i]
                tokens[s] += need[i]
                break
        else:
            return _differenced(costs, items, j) if len(items) <= DIFFERENCED_UP_TO else None
    return sides


def _differenced(costs, items: list, j: int) -> Optional[tuple]:
    """The two halves whose padded tokens are as equal as Karmarkar-Karp's differencing (the two largest
    remaining sums set against each other, their difference put back) and then :func:`_even_out` make
    them; None when even those do not fit. Example: ``[8, 7, 6, 5, 4]``: 8-7, 6-5 -> 1, 1; 4-1 -> 3;
    3-1 -> 2: halves of 14 and 16, evened to 15 and 15."""
    need, cap = costs.need[j], costs.capacity[j]
    heap = [(-need[i], n, None, None, i) for n, i in enumerate(items)]  # (-difference, tie, big, small, leaf)
    heapq.heapify(heap)
    count = len(heap)
    while len(heap) > 1:
        big, small = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, (big[0] - small[0], count, big, small, None))
        count += 1
    sides: tuple = ([], [])
    stack = [(heap[0], 0)]
    while stack:  # a node's big part stays on its side, its small part goes to the other
        node, side = stack.pop()
        if node[4] is not None:
            sides[side].append(node[4])
            continue
        stack.append((node[2], side))
        stack.append((node[3], 1 - side))
    _even_out(sides, need)
    if max(sum(need[i] for i in side) for side in sides) > cap:
        return None
    rank = costs.rank_of
    return tuple(sorted(side, key=rank.__getitem__) for side in sides)


def _even_out(sides: tuple, need, rounds: int = 4) -> None:
    """Move one sequence of the fuller half to the other, or swap one for a smaller one there (the
    exchange nearest half the difference, by bisection), while that brings their tokens closer; in place."""
    sums = [sum(need[i] for i in side) for side in sides]
    for _ in range(rounds):
        big = 0 if sums[0] >= sums[1] else 1
        gap = sums[big] - sums[1 - big]
        other = sorted(sides[1 - big], key=need.__getitem__)
        values = [need[i] for i in other]
        best, change = gap, None
        for a in sides[big]:
            if abs(gap - 2 * need[a]) < best:
                best, change = abs(gap - 2 * need[a]), (a, None)
            at = bisect.bisect_left(values, need[a] - gap / 2)
            for b in other[max(0, at - 1):at + 1]:
                delta = need[a] - need[b]
                if 0 < delta and abs(gap - 2 * delta) < best:
                    best, change = abs(gap - 2 * delta), (a, b)
        if change is None:
            return
        a, b = change
        moved = need[a] - (0 if b is None else need[b])
        sides[big].remove(a)
        sides[1 - big].append(a)
        if b is not None:
            sides[1 - big].remove(b)
            sides[big].append(b)
        sums[big] -= moved
        sums[1 - big] += moved
