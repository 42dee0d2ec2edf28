"""Top-k / top-p (nucleus) filtering of logits as one threshold per row, for log-probs under sampling parameters.

Shape legend
    c   rows (tokens) of one chunk
    V   full vocabulary; ``Vt = V / TP`` columns on a tensor-parallel rank
    M   rows one TP rank filters after the all-to-all, ``ceil(c / TP)``

The filter is NeMo-RL's (``TrainingSamplingParams``, read by attribute; ``top_k`` None or <= 0 and ``top_p ==
1.0`` disable it): top-k keeps the logits ``>=`` the row's ``k``-th largest; top-p keeps the entries whose
ascending running softmax sum is ``> 1 - top_p``. The kept entries are the row's largest, so the filter is a
threshold ``tau`` per row (in the logits' dtype; every entry equal to ``tau`` kept), ``keep = logits >= tau``.

Worked example (one row, V 4, top_p 0.5): logits ``[1.0, 3.0, 0.0, 2.0]`` -> sorted ``[0, 1, 2, 3]``
-> softmax ``[0.032, 0.087, 0.237, 0.644]`` -> running sum ``[0.032, 0.119, 0.356, 1.0]``; ``> 0.5``
keeps the last entry only, ``tau = 3.0``: only the token with logit 3.0 keeps probability."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data._alias import moved_attribute
from nn_data.cp_comm import all_gather_dim0, all_to_all_dim0


class SamplingFilter(NamedTuple):
    """``top_k`` (None: no top-k) and ``top_p`` (1.0: no top-p) of a filter that does something."""

    top_k: Optional[int]
    top_p: float


def sampling_filter(sampling_params) -> Optional[SamplingFilter]:
    """The filter ``sampling_params`` asks for, or None when it filters nothing (NeMo-RL's
    ``need_top_k_or_top_p_filtering``). Example: ``top_k=-1, top_p=0.9 -> SamplingFilter(None, 0.9)``."""
    if sampling_params is None:
        return None
    top_k, top_p = getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0)
    top_k = int(top_k) if top_k is not None and top_k > 0 else None
    top_p = 1.0 if top_p is None else float(top_p)
    if top_k is None and top_p == 1.0:
        return None
    return SamplingFilter(top_k, top_p)


def row_thresholds(x: torch.Tensor, filt: SamplingFilter) -> torch.Tensor:
    """``tau [c]`` (``x``'s dtype) for full rows ``x [c, V]``: row ``i`` keeps ``x[i] >= tau[i]``. Example:
    ``[[1., 3., 0., 2.]]`` with top-k 2 -> ``[2.]``; with top-p 0.5 -> ``[3.]``."""
    vocab = x.shape[-1]
    if filt.top_p == 1.0:
        return torch.topk(x, filt.top_k, dim=-1).values[:, -1]  # [c] the k-th largest
    ordered = torch.sort(x, dim=-1).values  # [c, V] ascending
    floor = ordered[:, :1] if filt.top_k is None else ordered[:, vocab - filt.top_k : vocab - filt.top_k + 1]  # [c, 1]
    if filt.top_k is not None:
        ordered = ordered.masked_fill(ordered < floor, float("-inf"))
    running = torch.cumsum(ordered.softmax(dim=-1), dim=-1)  # [c, V] non-decreasing
    kept = (running > 1 - filt.top_p).sum(dim=-1).clamp(min=1)  # [c] the largest entry is always kept
    first = (vocab - kept)[:, None]  # [c, 1] index of the smallest kept entry in the sorted row
    return torch.maximum(ordered.gather(1, first), floor).squeeze(1)  # [c]


def vocab_parallel_thresholds(local: torch.Tensor, filt: SamplingFilter, group, tp_size: int) -> torch.Tensor:
    """``tau [c]`` for rows whose columns are split over ``tp_size`` ranks (``local [c, Vt]``): an all-to-all gives
    each rank ``M = ceil(c/TP)`` full rows, it computes their thresholds, an all-gather hands every rank all ``c``.
    Example (TP 2, c 3): rows padded to 4, rank 0 filters rows 0-1, rank 1 rows 2-3; row 3 (padding) is dropped."""
    rows, cols = local.shape
    per_rank = -(-rows // tp_size)  # M
    padded = torch.nn.functional.pad(local, (0, 0, 0, per_rank * tp_size - rows))  # [TP*M, Vt]
    blocks = all_to_all_dim0(padded, group).view(tp_size, per_rank, cols)  # [TP, M, Vt]: block j = columns of rank j
    full = blocks.permute(1, 0, 2).reshape(per_rank, tp_size * cols)  # [M, V]
    return all_gather_dim0(row_thresholds(full, filt), group)[:rows]  # [TP*M] -> [c]


__getattr__ = moved_attribute("nn_data.sampling")  # this module's 0.1.x path and its moved names
