"""Shared-prefix attention as distinct query and key/value sequences, for a variable-length kernel
(TransformerEngine's THD attention, flash-attention's varlen): each response's keys and values are its
prompt's followed by its own, gathered into one static-size buffer.

Shape legend
    B   rollouts; the shared-prefix row has 2B slots (slot 2b: rollout b's prompt, empty unless b
        leads its group; slot 2b+1: its response), :mod:`nn_data.layout.prefix_layout`
    T   packed tokens (queries)
    K   the key/value buffer's length, ``kv_capacity`` (a Python int)
    N   sequences handed to the kernel: ``2B + 1`` (the 2B slots and one slack sequence)

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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout.internal import exclusive_cumsum, segment_bounds, segment_ids


__all__ = ["SharedPrefixKV", "shared_prefix_kv", "shared_prefix_packed_seq_params"]


class SharedPrefixKV(NamedTuple):
    """The kernel's view of a shared-prefix row: ``cu_seqlens_q [N+1]`` and ``cu_seqlens_kv [N+1]``
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
    capacity is checked by a device-side assert (module docstring: the bound).

    Raises :class:`PackingError` when the boundaries do not hold ``2B + 1`` entries (or ``[T]`` for
    ``B = 0``), or ``kv_capacity < total``.
    """
    rollouts = int(prefix_lengths.shape[0])
    if isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int) or kv_capacity < total:
        raise PackingError(f"kv_capacity={kv_capacity!r} is invalid; expected an int >= total={total} "
                           "(T + B * S always suffices)")
    expected = 2 * rollouts + 1 if rollouts else 1
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.shape[0] != expected:
        raise PackingError(f"cu_seqlens_padded has shape {tuple(cu_seqlens_padded.shape)}; expected "
                           f"[{expected}] (the 2B slots of B={rollouts} rollouts)")
    bounds = segment_bounds(cu_seqlens_padded, total)  # [2B+1] int64 ([0, T] when B = 0)
    device = bounds.device
    lengths = bounds[1:] - bounds[:-1]  # [2B] slot lengths (1 pseudo-segment when B = 0)
    prompt_part = torch.zeros_like(lengths)  # [2B]: the prompt keys ahead of each sequence's own
    prompt_start = torch.zeros_like(lengths)  # [2B]: where those prompt keys start in the packed row
    if rollouts:
        responses = lengths[1::2]  # [B]
        prompt_part[1::2] = torch.where(responses > 0, prefix_lengths.to(torch.int64), 0)
        prompt_start[1::2] = bounds[2 * leader.to(torch.int64)]
    kv_lengths = prompt_part + lengths  # [2B]
    kv_start = exclusive_cumsum(kv_lengths)  # [2B+1]
    _checks.device_assert(kv_start[-1] <= kv_capacity, f"shared_prefix_kv: kv_capacity={kv_capacity} is too small "
                          "for this row (it needs T + the prompt tokens of every non-empty response)")
    kv_bounds = torch.cat([kv_start, torch.full((1,), kv_capacity, dtype=torch.int64, device=device)])  # [2B+2]
    q_bounds = torch.cat([bounds, torch.full((1,), total, dtype=torch.int64, device=device)])  # [2B+2]
    # kv_bounds [0,2,6,6,9,10,13,13] (K 13): buffer key 7 is in sequence 3 at offset 1 < prompt_part 2
    # -> prompt_start[3] + 1 = 1; key 8 at offset 2 -> bounds[3] + 2 - 2 = 4
    seq = segment_ids(kv_bounds, kv_capacity)  # [K] in [0, 2B] (2B: the slack)
    own = seq.clamp(max=lengths.shape[0] - 1)  # [K] (the slack reads a real sequence's entries, masked)
    offset = torch.arange(kv_capacity, device=device) - kv_bounds[seq]  # [K]
    in_prompt = offset < prompt_part[own]
    source = torch.where(in_prompt, prompt_start[own] + offset, bounds[own] + offset - prompt_part[own])  # [K]
    valid = seq < lengths.shape[0]
    source = torch.where(valid, source, 0).clamp(0, max(total - 1, 0))
    return SharedPrefixKV(q_bounds.to(torch.int32), kv_bounds.to(torch.int32), source, valid, int(total),
                          int(kv_capacity))


def shared_prefix_packed_seq_params(kv: SharedPrefixKV):
    """megatron-core's THD ``PackedSeqParams`` for TransformerEngine over a :class:`SharedPrefixKV`:
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
