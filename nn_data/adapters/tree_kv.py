"""Tree attention as distinct query and key/value sequences, for a variable-length kernel (TransformerEngine's
THD attention, flash-attention's varlen): each node slot's keys and values are the tokens of its rollout's path
before it, then its own, gathered into one static-size buffer (:func:`tree_kv`).

Shape legend
    T   packed tokens (queries)
    K   the key/value buffer's length, ``kv_capacity`` (a Python int)
    N   the tree's node slots (``node_capacity``; ``2B`` for GRPO groups); the kernel gets ``N + 1`` sequences
        (the slots and one slack sequence)

Sequence ``s < N`` has the queries of slot ``s`` and the keys of the ``begin[s]`` path tokens before it, then
the slot itself; with the causal mask aligned *bottom right* (flash-attention's ``causal=True``,
TransformerEngine's ``padding_causal_bottom_right``) a query sees its whole path and its slot up to itself: the
tree's rule (:class:`nn_data.masks.PrefixRule`). Sequence ``N`` (the slack) holds the buffer's unused keys.

Example: GRPO groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1: slot bounds ``[0,2,4,4,5,6,8]``,
K 13 -> cu_seqlens_q ``[0,2,4,4,5,6,8,8]``, key lengths ``[2,4,0,3,1,3]`` and an empty slack ->
cu_seqlens_kv ``[0,2,6,6,9,10,13,13]``, kv_source ``[0,1, 0,1,2,3, 0,1,4, 5, 5,6,7]`` (K 12 would fire the
assert)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout.internal import exclusive_cumsum, segment_bounds, segment_ids


__all__ = ["TreeKV", "tree_kv", "tree_packed_seq_params"]


class TreeKV(NamedTuple):
    """The kernel's view of a tree microbatch's row: ``cu_seqlens_q [N+2]`` and ``cu_seqlens_kv [N+2]``
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


def tree_kv(layout, *, kv_capacity: int) -> TreeKV:
    """The :class:`TreeKV` of a tree microbatch's row (:class:`~nn_data.layout.TreeLayout`, any depth): ``N + 1``
    sequences (module docstring). ``kv_capacity`` K (a Python int): ``T`` plus the path tokens of every non-empty
    slot; ``T + N * S`` always suffices (a device-side assert fires when it is not enough). No host read.

    Example (L ``[6, 5]``, parent ``[-1, 0]``, branch_at ``[0, 2]``, m 1, T 9, K 14): slots ``[0,2), [2,6),
    [6,6), [6,9)`` (rollout 0's head and tail, rollout 1's empty head and its tail from token 2); key lengths
    ``[2, 2+4, 0, 2+3]`` (rollout 0's tail and rollout 1's both see the head's packed ``[0, 1]`` first) and a
    slack of 1 -> cu_seqlens_kv ``[0,2,8,8,13,14]``, kv_source ``[0,1, 0,1,2,3,4,5, 0,1,6,7,8, 0]``.

    Raises :class:`PackingError` for ``kv_capacity`` below ``T`` or a layout that is not a tree's."""
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
                           "(T + N * S always suffices)")


def _kv_buffer(bounds: torch.Tensor, before: torch.Tensor, source, total: int, kv_capacity: int, op: str,
               needs: str) -> TreeKV:
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
    # -> source(3, 1) = the path's token 1 = packed 1; key 8 at offset 2 -> bounds[3] + 2 - 2 = 4
    seq = segment_ids(kv_bounds, kv_capacity)  # [K] in [0, N] (N: the slack)
    own = seq.clamp(max=lengths.shape[0] - 1)  # [K] (the slack reads a real sequence's entries, masked)
    offset = torch.arange(kv_capacity, device=device) - kv_bounds[seq]  # [K]
    in_path = offset < before[own]
    ahead = source(own, torch.where(in_path, offset, 0))  # [K] (an own key reads token 0's place, unused)
    out = torch.where(in_path, ahead, bounds[own] + offset - before[own])  # [K]
    valid = seq < lengths.shape[0]
    out = torch.where(valid, out, 0).clamp(0, max(total - 1, 0))
    return TreeKV(q_bounds.to(torch.int32), kv_bounds.to(torch.int32), out, valid, int(total),
                          int(kv_capacity))


def tree_packed_seq_params(kv: TreeKV):
    """megatron-core's THD ``PackedSeqParams`` over a :class:`TreeKV`: the query and the buffer's boundaries (padded
    fields the same objects), ``max_seqlen_q = T``, ``max_seqlen_kv = K``. Run the attention bottom-right causal
    over ``kv.gather(key)``, ``kv.gather(value)``, without CP (under CP use :class:`nn_data.masks.PrefixRule`)."""
    from nn_data.megatron_parallel import packed_seq_params_class

    return packed_seq_params_class()(
        qkv_format="thd", cu_seqlens_q=kv.cu_seqlens_q, cu_seqlens_kv=kv.cu_seqlens_kv,
        cu_seqlens_q_padded=kv.cu_seqlens_q, cu_seqlens_kv_padded=kv.cu_seqlens_kv,
        max_seqlen_q=kv.max_seqlen_q, max_seqlen_kv=kv.max_seqlen_kv)
