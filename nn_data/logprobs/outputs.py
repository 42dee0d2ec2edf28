"""The LM head's outputs in one chunked, vocabulary-parallel pass: log-probs at given token ids, the entropy,
the top-k log-probs with their global ids, the argmax, from the logits or from hidden states and the weight.

Shapes: the legend of :mod:`nn_data.logprobs.kernels` (``N`` tokens, ``Vt`` the rank's vocabulary slice, ``J``
ids per position, ``k`` / ``K`` top-k asked / returned).

With ``z`` the (temperature-scaled) logits of one position and ``L = logsumexp(z)`` over the whole vocabulary:

* ``logprobs [N, J]``: ``z[id] - L`` at each given id where ``keep``, else 0;
* ``entropy [N]``: ``-sum_v p_v log p_v = L - sum_v p_v z_v``;
* ``topk_logprobs [N, K]`` and ``topk_indices [N, K]``: the ``K`` largest ``z - L`` and their global ids;
* ``argmax [N]``: the global id of the largest logit (the lowest id among equal ones, as ``torch.argmax``).

Each is opt-in and all come from one read of each chunk (:mod:`nn_data.logprobs.kernels`); with a sampling
filter every output is the filtered, renormalised distribution's (docs/logprobs.md, "The head's outputs in one
pass").

Worked example (V 4, one position, z ``[0, 0, log 2, log 4]`` -> p ``[1/8, 1/8, 2/8, 4/8]``): logprob of id 3
``log(1/2)``; entropy ``-(2/8 log 1/8 + 2/8 log 2/8 + 4/8 log 4/8) = 1.2130``; top-2 ids ``[3, 2]`` with
``[log 1/2, log 1/4]``; argmax 3."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data import _checks
from nn_data.logprobs.kernels import _HeadOutputs, combine_topk, local_ids

__all__ = ["HeadOutputs", "combine_topk", "head_outputs_local", "local_ids"]


class HeadOutputs(NamedTuple):
    """The outputs of one chunked pass (None: not asked): ``logprobs [N, J]`` (``[N]`` for ``[N]`` ids), ``entropy
    [N]``, ``topk_logprobs [N, K]`` (differentiable), ``topk_indices [N, K]`` and ``argmax [N]`` int64, ``lse [N]``
    each position's log-sum-exp (not differentiable)."""

    logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None
    topk_indices: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None


def head_outputs_local(
    rows: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    ids: Optional[torch.Tensor] = None,
    keep: Optional[torch.Tensor] = None,
    entropy: bool = False,
    top_k: int = 0,
    argmax: bool = False,
    vocab_start: int = 0,
    tp_group=None,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    chunk_tokens: int = 256,
    temperature: float = 1.0,
    sampling=None,
) -> HeadOutputs:
    """The asked outputs of ``softmax(z)`` per position, ``z`` the logits ``rows [N, Vt]`` (``weight`` None) or
    ``rows [n, H] @ weight.T`` (``weight [Vt, H]``, this TP rank's rows from ``vocab_start``), divided by
    ``temperature``, one ``[chunk_tokens, Vt]`` chunk at a time. No host sync.

    Args:
        ids: ``[N]`` or ``[N, J]`` global vocabulary ids whose log-probs are returned (0 where ``keep [N]`` is False).
        entropy, top_k, argmax: the outputs asked (``min(top_k, V)`` top log-probs and their global ids).
        sequence_parallel: ``rows`` are this TP rank's ``N/TP`` hidden rows (gathered inside).
        sampling: an optional :class:`~nn_data.logprobs.filters.SamplingFilter`.

    Example: logits ``[[0, 0, log 2, log 4]]``, ``ids=[3]``, ``entropy=True``, ``top_k=2``, ``argmax=True``
    -> logprobs ``[log 1/2]``, entropy ``[1.2130]``, top-k ``[[log 1/2, log 1/4]]`` ids ``[[3, 2]]``, argmax ``[3]``.

    Raises :class:`~nn_data.errors.PackingError`: a negative ``top_k``, ``chunk_tokens`` below 1, a
    temperature that is not positive, ``ids`` not ``[N]`` / ``[N, J]`` integer, ``keep`` without ``ids``."""
    chunk = _checks.positive_int("chunk_tokens", chunk_tokens)
    temperature = _checks.check_temperature(temperature)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise _checks.PackingError(f"top_k must be an int >= 0 (0: no top-k output), got {top_k!r}")
    n = rows.shape[0] * (tp_size if sequence_parallel and weight is not None else 1)
    squeeze = ids is not None and ids.dim() == 1
    if ids is not None:
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2) or ids.shape[0] != n:
            raise _checks.PackingError(f"ids must be integer [N] or [N, J] with N={n} positions, got shape "
                                       f"{tuple(ids.shape)} and dtype {ids.dtype}")
        ids = (ids[:, None] if squeeze else ids).to(torch.int64)  # [N, J]
        keep = torch.ones(n, dtype=torch.bool, device=rows.device) if keep is None else keep
    elif keep is not None:
        raise _checks.PackingError("keep selects which ids are scored: pass ids= with it")
    lp, ent, top_lp, top_ids, arg, lse = _HeadOutputs.apply(
        rows, weight, ids, keep, int(vocab_start), tp_group, int(tp_size), bool(sequence_parallel), chunk,
        temperature, top_k, bool(entropy), bool(argmax), sampling)
    return HeadOutputs(
        logprobs=None if ids is None else (lp.squeeze(1) if squeeze else lp),
        entropy=ent if entropy else None,
        topk_logprobs=top_lp if top_k else None,
        topk_indices=top_ids if top_k else None,
        argmax=arg if argmax else None,
        lse=lse,
    )
