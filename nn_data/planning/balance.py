"""Sequences to data-parallel ranks and microbatches under a hard token capacity, balancing a weight.

Vocabulary
    n   sequences; ``need[i]`` the padded length of sequence ``i`` (tokens it takes in a microbatch)
    D   data-parallel ranks; k microbatches per rank; T the capacity (``pad_full_seq_to``)
    weight[i]   what is balanced across ranks: a sequence's work, or its tokens

:func:`greedy_assignment` takes the sequences longest first and puts each on the **least-loaded rank that
still has room for it**, there into its first microbatch with room. The microbatches' room sits in max segment
trees and the ranks' loads in a heap, so one placement costs O(log D + log k) (at most ``POPS`` ranks without
room passed over); with the sort, O(n log n). A sequence that finds no rank with room is named, so that the
caller plans again. :func:`refine` then moves or swaps sequences between the most and the least loaded rank
while that lowers the larger load.

Worked example: needs ``[6, 5, 4, 3, 2]`` (already longest first), weights equal to the needs,
T 8, D 2, k 1: 6 -> rank 0 (both empty, lowest index), 5 -> rank 1, 4 -> no room on either
(2 and 3 left): failed 2. With k 2: 6 -> r0 mb0, 5 -> r1 mb0, 4 -> r1 (load 5 < 6) mb1, 3 -> r0
(6 < 9) mb1, 2 -> r0 (9 = 9, lowest index) mb0 (room 2): rank 0 ``[[0, 4], [3]]`` (11),
rank 1 ``[[1], [2]]`` (9)."""

from __future__ import annotations

import bisect
import heapq
import math
from typing import NamedTuple, Optional, Sequence

from nn_data.planning.ffd import adjust_bin_count

# Ranks without room passed over before the rank tree picks the leftmost rank with room (bounds a
# placement's cost when many of the least-loaded ranks are full; rare: the sequences come longest first).
POPS = 8


class Assignment(NamedTuple):
    """``ranks[r][j]``: sequence indices of microbatch ``j`` on rank ``r`` (``k`` per rank, some
    possibly empty), or None when sequence ``failed`` found no room; ``steps``: heap pops and tree
    nodes visited (the complexity test counts them)."""

    ranks: Optional[list]
    steps: int
    failed: int = -1


def _max_tree(leaves: int, values: Sequence[int]) -> list:
    """A max segment tree over ``leaves`` leaves (a power of two), ``values`` first, -1 after."""
    tree = [-1] * (2 * leaves)
    tree[leaves:leaves + len(values)] = values
    for node in range(leaves - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    return tree


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def greedy_assignment(order: Sequence[int], need: Sequence[int], weight: Sequence[float], capacity: int,
                      ranks: int, per_rank: int) -> Assignment:
    """Each sequence of ``order`` (longest first) on the least-loaded rank with room, first fit
    inside it (module docstring); ``ranks`` None when one finds no room in ``per_rank`` microbatches."""
    leaves, rleaves = _pow2(per_rank), _pow2(ranks)
    size = 2 * leaves
    tree = _max_tree(leaves, [capacity] * per_rank) * ranks  # rank r's tree at [r * size, (r + 1) * size)
    rtree = _max_tree(rleaves, [capacity] * ranks)  # leaf r: the most room any microbatch of rank r has
    heap = [(0.0, r, 0) for r in range(ranks)]  # (load, rank, version); sorted, so already a heap
    load, version = [0.0] * ranks, [0] * ranks
    bins = [[[] for _ in range(per_rank)] for _ in range(ranks)]
    steps = 0
    for i in order:
        n = need[i]
        chosen, aside = -1, []
        while heap and len(aside) < POPS:
            entry = heapq.heappop(heap)
            steps += 1
            if entry[2] != version[entry[1]]:
                continue  # stale: the rank was chosen through the rank tree since
            if tree[entry[1] * size + 1] >= n:
                chosen = entry[1]
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(heap, entry)
        if chosen < 0:
            if rtree[1] < n:
                return Assignment(None, steps, i)
            node = 1
            while node < rleaves:
                node = 2 * node if rtree[2 * node] >= n else 2 * node + 1
                steps += 1
            chosen = node - rleaves
        base, node = chosen * size, 1
        while node < leaves:  # first microbatch of the rank with room
            node = 2 * node if tree[base + 2 * node] >= n else 2 * node + 1
            steps += 1
        bins[chosen][node - leaves].append(i)
        tree[base + node] -= n
        node >>= 1
        while node:  # refresh the maxima upwards, stopping where one does not change
            a, b = tree[base + 2 * node], tree[base + 2 * node + 1]
            best = a if a > b else b
            steps += 1
            if tree[base + node] == best:
                break
            tree[base + node] = best
            node >>= 1
        node = rleaves + chosen
        rtree[node] = tree[base + 1]
        node >>= 1
        while node:
            a, b = rtree[2 * node], rtree[2 * node + 1]
            best = a if a > b else b
            steps += 1
            if rtree[node] == best:
                break
            rtree[node] = best
            node >>= 1
        load[chosen] += weight[i]
        version[chosen] += 1
        heapq.heappush(heap, (load[chosen], chosen, version[chosen]))
    return Assignment([spread(b, per_rank) for b in bins], steps)


def bins_to_ranks(bins: Sequence[list], bin_weight: Sequence[float], ranks: int, per_rank: int) -> list:
    """Whole bins to ranks, heaviest first, each to the least-loaded rank with fewer than
    ``per_rank`` bins (needs ``len(bins) <= ranks * per_rank``); each rank then :func:`spread` to
    ``per_rank`` microbatches. Example: bin weights ``[5, 4, 3, 1]``, 2 ranks, 2 each -> rank 0
    ``[5, 1]``, rank 1 ``[4, 3]``."""
    heap = [(0.0, r) for r in range(ranks)]
    mine: list = [[] for _ in range(ranks)]
    for b in sorted(range(len(bins)), key=lambda j: -bin_weight[j]):
        while True:
            weight, r = heapq.heappop(heap)
            if len(mine[r]) < per_rank:
                break
        mine[r].append(list(bins[b]))
        if len(mine[r]) < per_rank:
            heapq.heappush(heap, (weight + bin_weight[b], r))
    return [spread(m, per_rank) for m in mine]


def spread(bins: Sequence[list], per_rank: int) -> list:
    """Exactly ``per_rank`` microbatches from at most that many bins: empty ones take a sequence
    from the bin with the most sequences (NeMo-RL's rule); they stay empty only when the rank has
    fewer sequences than microbatches. Example: ``[[0, 1, 2], []]``, 3 -> ``[[0], [2], [1]]``."""
    full = [list(b) for b in bins if b]
    target = min(per_rank, sum(len(b) for b in full))
    out = adjust_bin_count(full, 1, target=target) if full else []
    return out + [[] for _ in range(per_rank - len(out))]


def refine(ranks: list, need: Sequence[int], weight: Sequence[float], capacity: int, rounds: int) -> int:
    """Lower the heaviest rank's load, in place, by at most ``rounds`` moves or swaps with the lightest rank (within
    the capacity, none emptying a microbatch); returns the candidates examined. Per round each sequence ``a`` of the
    heaviest rank is tried moved to the lightest rank's roomiest microbatch, and swapped with the lightest rank's
    sequences nearest ``w[a] - gap / 2`` in weight; the best change is applied if it lowers the heavy load.

    Example: loads 10 ``[[6, 4]]`` and 4 ``[[3, 1]]`` (weights = tokens, T 10): gap 6, the swap 6 <-> 3 gives 7 and 7."""
    loads = [math.fsum(weight[i] for mb in rank for i in mb) for rank in ranks]
    room = [[capacity - sum(need[i] for i in mb) for mb in rank] for rank in ranks]
    examined = 0
    for _ in range(rounds):
        hi = max(range(len(ranks)), key=loads.__getitem__)
        lo = min(range(len(ranks)), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            break
        light = sorted((weight[b], j, b) for j, mb in enumerate(ranks[lo]) for b in mb)
        light_w = [w for w, _, _ in light]
        roomiest = max(range(len(ranks[lo])), key=room[lo].__getitem__)
        best, change = loads[hi], None
        for j, mb in enumerate(ranks[hi]):
            for a in mb:
                wa = weight[a]
                examined += 1
                if len(mb) > 1 and room[lo][roomiest] >= need[a] and max(loads[hi] - wa, loads[lo] + wa) < best:
                    best, change = max(loads[hi] - wa, loads[lo] + wa), (j, a, roomiest, None)
                at = bisect.bisect_left(light_w, wa - gap / 2)
                for wb, jb, b in light[max(0, at - 1):at + 2]:
                    examined += 1
                    fits = room[hi][j] + need[a] >= need[b] and room[lo][jb] + need[b] >= need[a]
                    if fits and wb < wa and max(loads[hi] - wa + wb, loads[lo] + wa - wb) < best:
                        best, change = max(loads[hi] - wa + wb, loads[lo] + wa - wb), (j, a, jb, b)
        if change is None:
            break
        j, a, jb, b = change
        ranks[hi][j].remove(a)
        ranks[lo][jb].append(a)
        moved = weight[a] - (0.0 if b is None else weight[b])
        room[hi][j] += need[a]
        room[lo][jb] -= need[a]
        if b is not None:
            ranks[lo][jb].remove(b)
            ranks[hi][j].append(b)
            room[hi][j] -= need[b]
            room[lo][jb] += need[b]
        loads[hi] -= moved
        loads[lo] += moved
    return examined
