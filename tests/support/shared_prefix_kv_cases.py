"""The shared-prefix key/value buffer against nn_data's prefix mask: shared by the CPU test
(tests/models/test_shared_prefix_kv.py) and the GPU check's step (tests/cuda/test_cuda_shared_prefix.py).

``varlen_reference`` is a variable-length attention written out sequence by sequence (the semantics of
flash-attention's varlen kernel with ``causal=True``: the mask aligned to the bottom right), so the
boundaries and index maps :func:`nn_data.adapters.tree_kv.tree_kv` builds (for GRPO groups and
rollout trees) can be checked on a CPU; on a GPU the same inputs go to the real kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nn_data.adapters.tree_kv import tree_kv
from nn_data.layout import PackSpec, shared_prefix_layout, tree_layout
from nn_data.masks import document_causal_mask

#: ``(group_ids, prefix_lengths, seq_lengths, m)``: groups of 3 and 1, an empty response, a prompt of 0,
#: slots rounded up to 4 (prompt padding the responses must not see), non-contiguous groups.
ROWS = (
    ([7, 7, 7, 9], [5, 5, 5, 2], [8, 5, 11, 6], 1),
    ([7, 7, 7, 9], [5, 5, 5, 2], [8, 5, 11, 6], 4),
    ([2, 5, 5, 2], [0, 3, 3, 0], [4, 6, 9, 5], 2),
    ([3, 4, 3], [6, 2, 6], [9, 12, 14], 4),
)
SEQ_LEN = 16


def shared_row(groups, prefix, lengths, multiple: int, device="cpu"):
    """``(shared layout, kv maps, T)`` for a row of rollouts, with 8 slack positions and a buffer of
    the always-sufficient ``T + B * S`` keys."""
    lens, pre, gid = (torch.tensor(x, device=device) for x in (lengths, prefix, groups))
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    prompts = dict(zip(groups, prefix))  # each group's prompt once
    total = up(sum(up(p) for p in prompts.values()) + sum(up(n - p) for n, p in zip(lengths, prefix)) + 8)
    shared = shared_prefix_layout(lens, pre, gid, row_len=SEQ_LEN, spec=PackSpec(multiple, 1, fixed_total=total))
    kv = tree_kv(shared, kv_capacity=total + len(lengths) * SEQ_LEN)
    return shared, kv, total


def tree_row(tree, multiple: int, device="cpu"):
    """``(tree layout, kv maps, T)`` for a rollout tree (tests/support/tree_reference.py's ``Tree``), nodes
    rounded up to ``multiple``, slack to spare, and a buffer of the always-sufficient ``T + N * S`` keys."""
    total = sum(tree.lengths) + 3 * len(tree.lengths) * multiple + 8
    layout = tree_layout(*(torch.tensor(x, device=device) for x in tree), row_len=max(tree.lengths),
                         spec=PackSpec(multiple, fixed_total=total))
    slots = layout.nodes.owner.shape[0] - 1
    return layout, tree_kv(layout, kv_capacity=total + slots * max(tree.lengths)), total


def varlen_reference(q, k, v, cu_q, cu_kv, scale=None):
    """``q [Tq, H, D]``, ``k, v [K, H, D]`` -> ``[Tq, H, D]``: each sequence ``i`` attends its queries
    ``cu_q[i]:cu_q[i+1]`` over its keys ``cu_kv[i]:cu_kv[i+1]``, query ``a`` seeing key ``j`` iff
    ``j <= a + (Lk - Lq)`` (causal, bottom right). A test reference: a loop over sequences."""
    out = torch.zeros_like(q)
    bq, bk = cu_q.tolist(), cu_kv.tolist()
    for i in range(len(bq) - 1):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if lq == 0:
            continue
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # [Lq, Lk]
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]))
        att = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed.to(q.device), scale=scale)  # [1,H,Lq,D]
        out[bq[i]:bq[i + 1]] = att[0].transpose(0, 1)
    return out


def dense_reference(q, k, v, shared, scale=None):
    """The same attention on the packed row under nn_data's dense mask with the prefix rule: ``[T, H, D]``."""
    total = q.shape[0]
    mask = document_causal_mask(torch.arange(total, device=q.device), shared.segment_ids(),
                                prefix=shared.prefix_rule())  # [T, T]
    att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale)  # [1, H, T, D]
    return att[0].transpose(0, 1)


def real_queries(shared) -> torch.Tensor:
    """``[T]`` bool: the packed positions holding a rollout's real token (padding queries may differ)."""
    return ~shared.layout.padding_mask()[0]
