"""Shared-prefix attention as distinct query and key/value sequences, for a variable-length kernel
(TransformerEngine's THD attention, flash-attention's varlen): each response's keys and values are its
prompt's followed by its own, gathered into one static-size buffer; a rollout tree's node, at any depth,
likewise takes the tokens of its path before it (:func:`tree_kv`).

Shape legend
    B   rollouts; the shared-prefix row has 2B slots (slot 2b: rollout b's prompt, empty unless b
        leads its group; slot 2b+1: its response), :mod:`nn_data.layout.prefix_layout`
    T   packed tokens (queries)
    K   the key/value buffer's length, ``kv_capacity`` (a Python int)
    N   slots: the 2B slots (a rollout tree's node slots, ``node_capacity``, for :func:`tree_kv`); the
        kernel gets ``N + 1`` sequences (the slots and one slack sequence)

Sequence ``s < 2B`` has the queries of slot ``s`` (its padded length ``n_s``) and the keys and
values:

* prompt slot ``2b``: the slot itself (``n_{2b}`` keys; 0 for a prompt slot left empty);
* response slot ``2b+1``: the ``P[b]`` real prompt tokens of its group's leader slot
  ``2 * leader[b]`` (never that slot's padding), then the slot itself; ``n_{2b+1} + P[b]`` keys, or
  0 when the slot is empty.

With the causal mask aligned to the *bottom right* (the last query sees the last key: flash-attention
>= 2.1's ``causal=True``, TransformerEngine's ``padding_causal_bottom_right``, torch's
``varlen_attn(window_size=(-1, 0))``) a response query at offset ``i`` sees the whole prompt and
its own slot up to ``i``: the shared-prefix rule (:class:`nn_data.masks.PrefixRule`). Slot padding
comes after each slot's real tokens, so no real query sees it.

Sequence ``2B`` (the slack) has no queries and the buffer's unused keys, so that both boundary
tensors end at the tensors' lengths (``T`` and ``K``). The buffer needs ``T + sum_b P[b]`` (at
most; empty responses add none) keys; ``T + B * S`` always suffices (``P[b] <= S``), the caller's
``kv_capacity`` may be tighter (a planner's bound): a device-side assert fires when it is not enough.

Example: slots bounds ``[0,2,4,4,5,6,8]`` (B 3, prompts of rollouts 0 and 2 lead, P ``[2,2,1]``,
leader ``[0,0,2]``), K 13 -> cu_seqlens_q ``[0,2,4,4,5,6,8,8]``, key lengths ``[2,4,0,3,1,3]`` and an
empty slack -> cu_seqlens_kv ``[0,2,6,6,9,10,13,13]``, kv_source ``[0,1, 0,1,2,3, 0,1,4, 5, 5,6,7]``
(K 12 would fire the assert).

A rollout tree (:func:`tree_kv`, ``N`` its node slots): sequence ``s < N`` has the queries of node slot
``s`` and, when the slot is not empty, the keys of the ``begin[s]`` tokens before the node on its
rollout's path (read from its ancestors' slots, never their padding), then the slot itself: the same rule
with the path in place of the prompt, so any depth is exact; the shared prompt's ``2B`` slots give
:func:`shared_prefix_kv`'s buffer. :func:`shared_prefix_kv` takes a depth-1 tree only (each rollout's
``prefix_lengths`` its leader's: a device assert naming :func:`tree_kv`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout.internal import exclusive_cumsum, segment_bounds, segment_ids


__all__ = ["SharedPrefixKV", "shared_prefix_kv", "shared_prefix_packed_seq_params", "tree_kv"]


class SharedPrefixKV(NamedTuple):
    """The kernel's view of a shared-prefix row: ``cu_seqlens_q [N+2]`` and ``cu_seqlens_kv [N+2]``
    int32 (rising to ``T`` and ``K``), ``kv_source [K]`` int64 (the packed position each buffer
    key reads; 0 in the slack), ``kv_valid [K]`` bool (False in the slack), and the Python-int bounds
    ``max_seqlen_q`` (``T``) and ``max_seqlen_kv`` (``K``) a kernel's launch needs without a host read."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_source: torch.Tensor
    kv_valid: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        """``[T, *] -> [K, *]``: the keys (or values) of every sequence in buffer order, one
        ``index_select`` (autograd: the prompt's gradient sums over its responses)."""
        return kv.index_select(0, self.kv_source)  # [K, *]


def shared_prefix_kv(cu_seqlens_padded: torch.Tensor, prefix_lengths: torch.Tensor, leader: torch.Tensor, *,
                     total: int, kv_capacity: int) -> SharedPrefixKV:
    """The :class:`SharedPrefixKV` of a shared-prefix row: the slots' boundaries ``cu_seqlens_padded
    [2B+1]`` (``SharedPrefixLayout.layout.cu_seqlens_padded``; ``[T]`` for ``B = 0``), ``prefix_lengths
    [B]``, ``leader [B]``, ``total`` (T) and ``kv_capacity`` (K, Python ints). No host read; the
    capacity is checked by a device-side assert (module docstring: the bound), and so is the depth: a
    rollout with a response whose ``prefix_lengths`` is not its leader's is a deeper tree's (its path's
    keys are not its leader's prompt slot), refused naming :func:`tree_kv`.

    Raises :class:`PackingError` when the boundaries do not hold ``2B + 1`` entries (or ``[T]`` for
    ``B = 0``), or ``kv_capacity < total``.
    """
    rollouts = int(prefix_lengths.shape[0])
    _check_capacity(kv_capacity, total)
    expected = 2 * rollouts + 1 if rollouts else 1
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.shape[0] != expected:
        raise PackingError(f"cu_seqlens_padded has shape {tuple(cu_seqlens_padded.shape)}; expected "
                           f"[{expected}] (the 2B slots of B={rollouts} rollouts); a rollout tree's node slots "
                           "take tree_kv(layout, kv_capacity=...)")
    bounds = segment_bounds(cu_seqlens_padded, total)  # [2B+1] int64 ([0, T] when B = 0)
    lengths = bounds[1:] - bounds[:-1]  # [2B] slot lengths (1 pseudo-segment when B = 0)
    prompt_part = torch.zeros_like(lengths)  # [2B]: the prompt keys ahead of each sequence's own
    prompt_start = torch.zeros_like(lengths)  # [2B]: where those prompt keys start in the packed row
    if rollouts:
        responses = lengths[1::2]  # [B]
        prefix, leader = prefix_lengths.to(torch.int64), leader.to(torch.int64)
        _checks.device_assert((responses == 0) | (prefix == prefix[leader]),
                              "shared_prefix_kv: a rollout's prefix_lengths differs from its leader's: this is a "
                              "deeper rollout tree (a rollout branching from a response, or a group splitting at "
                              "two points), whose keys are not its leader's prompt slot; build its boundaries "
                              "with tree_kv(layout, kv_capacity=...)")
        prompt_part[1::2] = torch.where(responses > 0, prefix, 0)
        prompt_start[1::2] = bounds[2 * leader]
    return _kv_buffer(bounds, prompt_part, lambda own, offset: prompt_start[own] + offset, total, kv_capacity,
                      "shared_prefix_kv", "the prompt tokens of every non-empty response")


def tree_kv(layout, *, kv_capacity: int) -> SharedPrefixKV:
    """The :class:`SharedPrefixKV` of a rollout tree's row, at any depth (:class:`~nn_data.layout.TreeLayout`
    from :func:`~nn_data.layout.tree_layout`, or the shared prompt's from
    :func:`~nn_data.layout.shared_prefix_layout`, where it equals :func:`shared_prefix_kv`'s): ``N + 1``
    sequences, node slot ``s``'s queries against the ``begin[s]`` path tokens before it and itself (module
    docstring). ``kv_capacity`` K (a Python int): ``T`` plus those path tokens of every non-empty slot; ``T + N
    * S`` always suffices (a device-side assert fires when it is not enough). No host read.

    Example (L ``[6, 5]``, parent ``[-1, 0]``, branch_at ``[0, 2]``, m 1, T 9, K 14): slots ``[0,2), [2,6),
    [6,6), [6,9)`` (rollout 0's head and tail, rollout 1's empty head and its tail from token 2); key lengths
    ``[2, 2+4, 0, 2+3]`` (rollout 0's tail and rollout 1's both see the head's packed ``[0, 1]`` first) and a
    slack of 1 -> cu_seqlens_kv ``[0,2,8,8,13,14]``, kv_source ``[0,1, 0,1,2,3,4,5, 0,1,6,7,8, 0]``.

    Raises :class:`PackingError` for ``kv_capacity`` below ``T`` or a layout that is not a tree's.
    """
    from nn_data.layout import TreeLayout

    if not isinstance(layout, TreeLayout):
        raise PackingError(f"tree_kv: layout must be a TreeLayout (tree_layout(...) or shared_prefix_layout(...)), "
                           f"got {type(layout).__name__}")
    total, rows, nodes = layout.total, layout.rows, layout.nodes
    _check_capacity(kv_capacity, total)
    bounds = layout.layout.bounds()  # [N+1] int64 ([0, T] when B = 0)
    lengths = bounds[1:] - bounds[:-1]  # [N]
    if rows == 0:  # one padding pseudo-segment: no path before it
        return _kv_buffer(bounds, torch.zeros_like(lengths), lambda own, offset: offset, total, kv_capacity,
                          "tree_kv", "the path tokens before every non-empty node")
    owner = nodes.owner[: lengths.shape[0]]  # [N] (B: an empty slot)
    path = torch.where((lengths > 0) & (owner < rows), nodes.begin[: lengths.shape[0]], 0)  # [N]
    rollout = owner.clamp(max=rows - 1)  # [N]

    def source(own, offset):  # [K] each: the packed place of token `offset` on slot own's rollout's path
        return layout.places(rollout[own], offset[:, None])[0][:, 0]

    return _kv_buffer(bounds, path, source, total, kv_capacity, "tree_kv", "the path tokens before every "
                      "non-empty node")


def _check_capacity(kv_capacity, total: int) -> None:
    if isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int) or kv_capacity < total:
        raise PackingError(f"kv_capacity={kv_capacity!r} is invalid; expected an int >= total={total} "
                           "(T + B * S always suffices; a tree's T + N * S)")


def _kv_buffer(bounds: torch.Tensor, before: torch.Tensor, source, total: int, kv_capacity: int, op: str,
               needs: str) -> SharedPrefixKV:
    """The buffer of ``bounds [N+1]`` (the query sequences) where sequence ``s``'s keys are ``before[s]``
    keys read from ``source(s [K], offset [K]) -> [K]`` (packed places), then its own slot; one slack
    sequence to ``K``. Worked example: the module docstring's."""
    device = bounds.device
    lengths = bounds[1:] - bounds[:-1]  # [N]
    kv_start = exclusive_cumsum(before + lengths)  # [N+1]
    _checks.device_assert(kv_start[-1] <= kv_capacity, f"{op}: kv_capacity={kv_capacity} is too small for this "
                          f"row (it needs T + {needs})")
    kv_bounds = torch.cat([kv_start, torch.full((1,), kv_capacity, dtype=torch.int64, device=device)])  # [N+2]
    q_bounds = torch.cat([bounds, torch.full((1,), total, dtype=torch.int64, device=device)])  # [N+2]
    # kv_bounds [0,2,6,6,9,10,13,13] (K 13): buffer key 7 is in sequence 3 at offset 1 < before 2
    # -> source(3, 1) = prompt_start[3] + 1 = 1; key 8 at offset 2 -> bounds[3] + 2 - 2 = 4
    seq = segment_ids(kv_bounds, kv_capacity)  # [K] in [0, N] (N: the slack)
    own = seq.clamp(max=lengths.shape[0] - 1)  # [K] (the slack reads a real sequence's entries, masked)
    offset = torch.arange(kv_capacity, device=device) - kv_bounds[seq]  # [K]
    in_path = offset < before[own]
    ahead = source(own, torch.where(in_path, offset, 0))  # [K] (an own key reads token 0's place, unused)
    out = torch.where(in_path, ahead, bounds[own] + offset - before[own])  # [K]
    valid = seq < lengths.shape[0]
    out = torch.where(valid, out, 0).clamp(0, max(total - 1, 0))
    return SharedPrefixKV(q_bounds.to(torch.int32), kv_bounds.to(torch.int32), out, valid, int(total),
                          int(kv_capacity))


def shared_prefix_packed_seq_params(kv: SharedPrefixKV):
    """megatron-core's THD ``PackedSeqParams`` for TransformerEngine over a :class:`SharedPrefixKV` (a shared
    prompt's or a rollout tree's, :func:`tree_kv`):
    ``cu_seqlens_q(_padded)`` the query boundaries, ``cu_seqlens_kv(_padded)`` the buffer's (the
    padded fields the same objects: no padding between sequences), ``max_seqlen_q = T``,
    ``max_seqlen_kv = K``. Run the attention with ``attn_mask_type`` bottom-right causal
    (``padding_causal_bottom_right``) over ``kv.gather(key)``, ``kv.gather(value)``, without CP
    (TransformerEngine's CP splits keys and values as it splits queries; the per-response buffer is
    not that: under CP use nn_data's mask, :class:`nn_data.masks.PrefixRule`)."""
    from nn_data.megatron_parallel import packed_seq_params_class

    return packed_seq_params_class()(
        qkv_format="thd", cu_seqlens_q=kv.cu_seqlens_q, cu_seqlens_kv=kv.cu_seqlens_kv,
        cu_seqlens_q_padded=kv.cu_seqlens_q, cu_seqlens_kv_padded=kv.cu_seqlens_kv,
        max_seqlen_q=kv.max_seqlen_q, max_seqlen_kv=kv.max_seqlen_kv)
