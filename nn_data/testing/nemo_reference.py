"""NeMo-RL's log-prob semantics as loops: the oracle of ``nn_data.nemo_rl.model_utils`` (one sequence, one position at a time).

Shape legend: ``B`` sequences, ``S`` unpacked row length, ``T`` packed tokens, ``V`` vocabulary.

What ``nemo_rl.distributed.model_utils`` (HEAD 7ea279a) computes, in the plainest form, differentiable w.r.t.
the logits in their dtype: top-k keeps the logits ``>=`` the row's ``k``-th largest, top-p then a token whose
strictly-higher mass is ``< top_p``; a target outside ``[0, V)`` scores 0 with the gradient ``-softmax`` times
the output's (NeMo-RL masks only the one-hot term); packed, position ``s`` of sequence ``b`` scores the token at
``start + s + 1`` for ``s < min(n_b - 1, S - 1)``, ``n_b`` its padded segment, 0 beyond."""

from __future__ import annotations

from typing import Optional

import torch


def reference_filter(row: torch.Tensor, top_k: Optional[int] = None, top_p: float = 1.0) -> torch.Tensor:
    """``[V]`` bool: the tokens of one row of logits a top-k / top-p filter keeps."""
    keep = torch.ones_like(row, dtype=torch.bool)
    if top_k is not None and top_k > 0:
        kth = sorted(row.tolist(), reverse=True)[top_k - 1]
        keep = row >= kth
    if top_p != 1.0:
        probs = torch.softmax(torch.where(keep, row, float("-inf")), dim=-1).tolist()
        order = sorted(range(row.shape[0]), key=lambda v: -row[v].item())
        above = 0.0  # mass of the tokens ranked strictly above the current one
        nucleus = torch.zeros_like(keep)
        for rank, v in enumerate(order):
            nucleus[v] = rank == 0 or above < top_p
            above += probs[v]
        keep = keep & nucleus
    return keep


def reference_logprob(row: torch.Tensor, token: int, top_k: Optional[int] = None, top_p: float = 1.0) -> torch.Tensor:
    """``log softmax(row over the kept tokens)[token]``; ``-inf`` if filtered. For a token outside
    ``[0, V)``: the value 0 with NeMo-RL's gradient ``-softmax`` (``lse.detach() - lse``)."""
    keep = reference_filter(row.detach(), top_k, top_p)
    kept = torch.where(keep, row, float("-inf"))
    if not 0 <= token < row.shape[0]:
        lse = torch.logsumexp(kept, dim=-1)
        return lse.detach() - lse
    return torch.log_softmax(kept, dim=-1)[token]


def reference_roll_per_segment(target: torch.Tensor, cu_seqlens_padded) -> torch.Tensor:
    """``[1, T]``: every padded segment of the packed ``target`` rolled left by one (its last position
    takes the segment's first token), NeMo-RL's ``target_is_pre_rolled`` input before CP sharding."""
    bounds = [int(v) for v in cu_seqlens_padded]
    out = target.clone()
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[0, start:end] = target[0, start:end].roll(-1)
    return out


def reference_packed_logprobs(logits: torch.Tensor, rolled: torch.Tensor, cu_seqlens_padded, seq_len: int,
                              top_k: Optional[int] = None, top_p: float = 1.0) -> torch.Tensor:
    """``[B, S-1]`` from the full packed logits ``[1, T, V]`` and the per-segment rolled targets ``[1, T]``."""
    bounds = [int(v) for v in cu_seqlens_padded]
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        row = [logits.sum() * 0] * (seq_len - 1)
        for s in range(min(end - start - 1, seq_len - 1)):
            row[s] = reference_logprob(logits[0, start + s], int(rolled[0, start + s]), top_k, top_p)
        rows.append(torch.stack(row) if row else logits.new_zeros(0))
    if not rows:
        return logits.new_zeros((0, seq_len - 1)) + logits.sum() * 0
    return torch.stack(rows)


def reference_row_logprobs(logits: torch.Tensor, target: torch.Tensor, top_k: Optional[int] = None,
                           top_p: float = 1.0) -> torch.Tensor:
    """``[B, S-1]`` for unpacked rows: ``out[b, s] = log p(target[b, s+1] | logits[b, s])``."""
    rows, seq_len = target.shape
    out = [[reference_logprob(logits[b, s], int(target[b, s + 1]), top_k, top_p) for s in range(seq_len - 1)]
           for b in range(rows)]
    if rows == 0 or seq_len <= 1:
        return logits.new_zeros((rows, max(seq_len - 1, 0))) + logits.sum() * 0
    return torch.stack([torch.stack(r) for r in out])
