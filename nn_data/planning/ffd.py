"""Bin sequences into packable microbatches: first-fit-decreasing in O(n log n), and NeMo-RL's bin rules.

The bins' remaining capacities sit in the leaves of a max segment tree (unopened bins full, to the right), so
"leftmost bin with room >= length" is one root-to-leaf descent: O(log n) per sequence. :func:`ffd_ties_last`
and :func:`adjust_bin_count` are NeMo-RL's conventions (its tie order, the bin count raised to a multiple of
the data-parallel ranks), for ``balance="nemo-rl"`` and ``BatchedDataDict.shard_by_batch_size``."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from nn_data.layout import round_up
from nn_data.layout.internal import checks
from nn_data.errors import PackingError


class FFDBins(NamedTuple):
    """``bins``: per bin (in opening order) the indices of its sequences, longest first;
    ``loads``: tokens in each bin; ``steps``: tree nodes visited (``<= n * (log2 n + 1)``
    descents plus as many updates, for the complexity test)."""

    bins: list
    loads: list
    steps: int


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> FFDBins:
    """Pack ``lengths`` into bins of ``capacity`` tokens with first-fit-decreasing, ties in input order; every index
    in exactly one bin, no bin above ``capacity``.

    Example: lengths ``[5, 9, 3, 4, 6]``, capacity 10 -> order 9, 6, 5, 4, 3 ->
    bins ``[[1], [4, 3], [0, 2]]`` with loads ``[9, 10, 8]``.

    Raises :class:`~nn_data.errors.PackingError` for ``capacity < 1`` or above ``2**31 - 1``, a negative length or
    a length above ``capacity`` (naming the index)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise PackingError(f"max_tokens_per_microbatch={capacity!r} is invalid; expected an int >= 1")
    checks.fixed_total_arg("max_tokens_per_microbatch", capacity)  # a bin is one packed microbatch
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr > capacity))
    if bad.size:
        i = int(bad[0])
        raise PackingError(f"sequence {i} is {int(arr[i])} tokens long (after padding), outside [0, "
                           f"max_tokens_per_microbatch={capacity}]; raise max_tokens_per_microbatch")
    n = int(arr.size)
    if n == 0:
        return FFDBins([], [], 0)
    order = np.argsort(-arr, kind="stable").tolist()  # sync: none, numpy on the host
    need_of = arr.tolist()  # sync: none, numpy on the host
    leaves = 1 << (n - 1).bit_length()  # a leaf per possible bin (at most n bins)
    tree = [capacity] * (2 * leaves)  # tree[i] = max remaining capacity below node i
    bins: list = []
    steps = 0
    for idx in order:
        need = need_of[idx]
        node = 1
        while node < leaves:  # descend to the leftmost leaf with room >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
            steps += 1
        leaf = node - leaves
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(idx)
        tree[node] -= need
        node //= 2
        while node:  # refresh the maxima on the way back up
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
            steps += 1
    loads = [capacity - tree[leaves + b] for b in range(len(bins))]
    return FFDBins(bins, loads, steps)


def ffd_ties_last(lengths: Sequence[int], capacity: int) -> FFDBins:
    """First-fit-decreasing with equal lengths taken last index first (NeMo-RL's order: it sorts
    ``(length, index)`` pairs descending). :func:`first_fit_decreasing` keeps ties in input order,
    so it runs on the reversed list. Example: ``[4, 4]``, capacity 4 -> bins ``[[1], [0]]``."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n = int(arr.size)
    plan = first_fit_decreasing(arr[::-1], capacity)
    return plan._replace(bins=[[n - 1 - i for i in b] for b in plan.bins])


def adjust_bin_count(bins: list, shards: int, target: Optional[int] = None) -> list:
    """At least ``shards`` bins and a multiple of ``shards``, or exactly ``target`` bins when given: new bins each take
    the last sequence of the bin with most sequences (NeMo-RL's rule). Example: bins ``[[0, 1, 2], [3]]``, 4
    shards -> ``[[0], [3], [2], [1]]``."""
    if target is None:
        target = max(len(bins), shards)
        target += (-target) % shards
    if target == len(bins):
        return bins
    count = sum(len(b) for b in bins)
    if count < target:
        raise PackingError(f"Cannot create {target} bins with only {count} sequences. Each bin must contain at "
                           f"least one sequence. Either reduce min_bin_count/bin_count_multiple or provide more "
                           f"sequences. (each of the {shards} data-parallel shards needs the same number of "
                           "microbatches)")
    bins = [list(b) for b in bins]
    donors = sorted(range(len(bins)), key=lambda i: (len(bins[i]), i), reverse=True)  # NeMo-RL's tie order
    for _ in range(target - len(bins)):
        donor = next(i for i in donors if len(bins[i]) > 1)
        bins.append([bins[donor].pop()])
    return bins
