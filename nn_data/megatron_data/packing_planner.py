"""Bin sequences into packable microbatches: first-fit-decreasing in O(n log n).

First-fit-decreasing (FFD) takes the sequences longest first and puts each into the
first (lowest-numbered) open bin with room, opening a new bin when none has. The
textbook loop scans every open bin for every sequence: O(n * bins), quadratic when
bins are small. Here the bins' remaining capacities sit in the leaves of a max
segment tree, so "leftmost bin with room >= length" is one root-to-leaf descent:
O(log n) per sequence, O(n log n) with the sort (numpy). Unopened bins are leaves
with full capacity to the right of the open ones, so the leftmost fit is the
first-fit bin, or the next new bin.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from nn_data.plan.checks import packed_length_arg
from nn_data.plan.rules import round_up
from nn_data.errors import PackingError


class FFDPlan(NamedTuple):
    """``bins``: per bin (in opening order) the indices of its sequences, longest first;
    ``loads``: tokens in each bin; ``steps``: tree nodes visited (``<= n * (log2 n + 1)``
    descents plus as many updates, for the complexity test)."""

    bins: list
    loads: list
    steps: int


def round_up_lengths(lengths: Sequence[int], multiple: int) -> np.ndarray:
    """``lengths`` rounded up to ``multiple`` (int64 numpy array). Example: ``[3, 8], 4 -> [4, 8]``."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise PackingError(f"sequence_length_pad_multiple={multiple!r} is invalid; expected an int >= 1")
    return round_up(np.asarray(lengths, dtype=np.int64).reshape(-1), multiple)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> FFDPlan:
    """Pack ``lengths`` into bins of ``capacity`` tokens with first-fit-decreasing.

    Ties keep the input order (stable sort). Every index appears in exactly one bin and
    no bin's load exceeds ``capacity``.

    Example: lengths ``[5, 9, 3, 4, 6]``, capacity 10 -> order 9, 6, 5, 4, 3 ->
    bins ``[[1], [4, 3], [0, 2]]`` with loads ``[9, 10, 8]``.

    Raises :class:`~nn_data.errors.PackingError` for ``capacity < 1`` or above the int32 limit of
    packed boundaries (``2**31 - 1``), a negative length
    or a length above ``capacity`` (naming the index).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise PackingError(f"max_tokens_per_microbatch={capacity!r} is invalid; expected an int >= 1")
    packed_length_arg("max_tokens_per_microbatch", capacity)  # a bin is one packed microbatch
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr > capacity))
    if bad.size:
        i = int(bad[0])
        raise PackingError(f"sequence {i} is {int(arr[i])} tokens long (after padding), outside [0, "
                           f"max_tokens_per_microbatch={capacity}]; raise max_tokens_per_microbatch")
    n = int(arr.size)
    if n == 0:
        return FFDPlan([], [], 0)
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
    return FFDPlan(bins, loads, steps)
