"""Finding a batch's rollout tree on the host: each rollout's parent and branch point from its token ids.

Shape legend
    B   rollouts; S their row length

For a data loader whose rollouts carry no tree: :func:`find_rollout_tree` gives each rollout the earlier
rollout it shares the longest common prefix with (the smallest index among equals, so every branch point
exceeds its parent's; -1 when none) and that prefix's length. Rollouts are compared ``chunk`` tokens at a time,
only those still equal going on: ``O(B^2 * chunk + sum of the shared tokens)``."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nn_data.errors import PackingError


class RolloutTree(NamedTuple):
    """``parent [B]`` and ``branch_at [B]`` int64: each rollout's tree entry (numpy from
    :func:`find_rollout_tree`; ``[B]`` tensors as the rollout-tree microbatch's own arguments in
    ``PackedForward``)."""

    parent: object
    branch_at: object


def find_rollout_tree(input_ids, seq_lengths, *, chunk: int = 512) -> RolloutTree:
    """The :class:`RolloutTree` of rollouts ``input_ids [B, S]`` (numpy or a CPU tensor) with ``seq_lengths [B]``:
    each rollout's longest common prefix with an earlier one. Example: rollouts ``[1 2 3 4]``, ``[1 2 9]``, ``[1 2
    3 7 7]``, ``[5]`` -> parent ``[-1, 0, 0, -1]``, branch_at ``[0, 2, 3, 0]``."""
    ids, lengths = np.asarray(input_ids), np.asarray(seq_lengths).astype(np.int64)
    if ids.ndim != 2 or lengths.shape != (ids.shape[0],):
        raise PackingError(f"input_ids must be [B, S] and seq_lengths [B]; got {ids.shape} and {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > ids.shape[1]):
        i = int(np.flatnonzero((lengths < 0) | (lengths > ids.shape[1]))[0])
        raise PackingError(f"seq_lengths[{i}] = {int(lengths[i])} is invalid; a rollout's length lies in [0, S], "
                           f"S = {ids.shape[1]} (input_ids' row length)")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PackingError(f"chunk={chunk!r} is invalid; expected a positive int")
    rows = ids.shape[0]
    parent, branch_at = np.full(rows, -1, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    for b in range(1, rows):  # host ints: a data loader's helper
        limit = np.minimum(lengths[:b], lengths[b])  # [b]: a common prefix ends at the shorter rollout
        common = np.zeros(b, dtype=np.int64)
        active, start = np.arange(b), 0
        while active.size and start < lengths[b]:
            stop = min(start + chunk, int(lengths[b]))
            differ = ids[active, start:stop] != ids[b, start:stop]  # [k, c]
            differ |= np.arange(start, stop)[None, :] >= limit[active][:, None]
            first = np.where(differ.any(1), differ.argmax(1), stop - start)  # [k]
            common[active] = start + first
            active, start = active[first == stop - start], stop
        best = int(common.argmax())  # the smallest index among the longest
        if common[best] > 0:
            parent[b], branch_at[b] = best, common[best]
    return RolloutTree(parent, branch_at)
