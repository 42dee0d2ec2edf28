"""The vocabulary-parallel log-prob kernels: ``log softmax(z)[target]`` per token, ``z`` read or computed one
chunk of tokens at a time, the vocabulary split over the tensor-parallel group.

Shape legend
    N   tokens this rank scores (``T/C`` under context parallelism)
    n   rows of hidden states this rank holds: ``N``, or ``N/TP`` with sequence parallelism (gathered inside)
    H   hidden size
    Vt  this tensor-parallel rank's vocabulary slice (``V/TP``): columns of the logits, rows of the weight
    c   tokens per chunk (``chunk_tokens``)

Two kernels share the chunk steps (:func:`chunk_lse_and_target`, :func:`combine_vocab_parallel`,
:func:`chunk_logit_grad`): :func:`token_logprobs_local` from the logits ``[N, Vt]`` and
:func:`hidden_logprobs_local` from the hidden states and the output weight, whose logits never exist.

From the logits: beyond them (and, in backward, their gradient) the kernel holds ``O(N)`` values plus
one ``[c, Vt]`` float32 chunk.

From hidden states: ``log p(target[i]) = z[i, target[i]] - logsumexp_v z[i, v]`` with
``z = hidden @ weight.T / temperature``. Forward computes ``z`` for ``c`` tokens at a time and keeps, per
token, the log-sum-exp and the target's logit (``[N]`` each); backward recomputes each chunk's ``z`` and
turns its gradient ``dz = g * (onehot - softmax)`` into the gradients of the hidden states
(``dz @ weight``) and of the weight (``dz.T @ hidden``, accumulated over the chunks in place). Beyond its
inputs and the two gradients the op holds ``O(N)`` values and one or two ``[c, Vt]`` float32 chunks: the
``[N, Vt]`` logits, their log-softmax and their gradient never exist. The price is one more matmul (the
recompute): four ``N x H x Vt`` matmuls for forward + backward where the unfused path has three.

Tensor parallelism (rank ``k`` holding vocabulary ids ``[k*Vt, (k+1)*Vt)``): the per-rank log-sum-exp
and target logit are combined over the TP group with one ``[2, N]`` all-gather
(:func:`combine_vocab_parallel`: the log-sum-exp over ranks, the target's logit from the rank that owns
it); the logits' gradient needs no communication. From hidden states, each rank's ``dz @ weight`` is its
vocabulary slice's share of the hidden states' gradient: summed over the TP group (an all-reduce; a
reduce-scatter of the gathered rows with sequence parallelism), as megatron-core's column-parallel output
layer does.

Worked example (V 3, uniform logits, N 2): ``z = 0`` -> ``lse = log 3``, ``log p = -log 3`` for both
tokens, whatever ``hidden`` and ``weight`` (zero) are.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nn_data.cp_comm import all_gather_dim0, all_reduce_sum, reduce_scatter_dim0
from nn_data.logprobs.filters import row_thresholds, vocab_parallel_thresholds


class _TargetLogProb(torch.autograd.Function):
    """``log softmax(logits[i])[target[i]]`` where ``keep[i]``, else 0: ``[N, Vt] -> [N]`` (float32 or wider).

    Vocab-parallel (``tp_size > 1``): each TP rank holds columns ``[vocab_start,
    vocab_start + Vt)``; the per-rank log-sum-exp and the target's logit (0 on ranks that
    do not own it) are all-gathered as ``[2, N]`` and combined. Backward needs no
    communication: ``d/dz_v = [v = target] - softmax_v``, with the global log-sum-exp saved.

    ``sampling`` (a :class:`~nn_data.logprobs.filters.SamplingFilter`, or None): the softmax runs over the
    logits the filter keeps (``>= tau``, one threshold per row, :mod:`nn_data.logprobs.filters`); a target
    it drops gets ``-inf`` and no one-hot term in the gradient, filtered logits get no gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, keep, vocab_start: int, tp_group, tp_size: int, chunk: int, sampling=None):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        local, owned = target_columns(target, vocab_start, logits.shape[1])
        lse, picked, owned, tau = chunked_lse_and_target(logits, None, 1.0, local, owned, dtype, chunk, sampling,
                                                         tp_group, tp_size)
        ctx.save_for_backward(logits, local, owned, keep, lse, tau)
        ctx.chunk, ctx.sampled = chunk, sampling is not None
        return torch.where(keep, picked - lse, 0.0)

    @staticmethod
    def backward(ctx, grad):
        logits, local, owned, keep, lse, tau = ctx.saved_tensors
        g = torch.where(keep, grad, 0.0).to(lse.dtype)  # [N]
        g_owned = torch.where(owned, g, 0.0)  # [N] the one-hot term, on the owning TP rank only
        out = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk):
            j = i + ctx.chunk
            x = logits[i:j].to(lse.dtype)  # [c, Vt]
            out[i:j] = chunk_logit_grad(x, lse[i:j], tau[i:j] if ctx.sampled else None, g[i:j], g_owned[i:j],
                                        local[i:j], fresh=False)
        return out, None, None, None, None, None, None, None


def target_columns(target: torch.Tensor, vocab_start: int, cols: int):
    """``(local [N], owned [N])``: each target's column on this TP rank (clamped into ``[0, Vt)``) and whether
    this rank holds it. Example: target ``[1, 5, 9]``, vocab_start 4, cols 4 -> local ``[0, 1, 3]``, owned
    ``[F, T, F]``."""
    local = target - vocab_start  # [N] column on this rank
    owned = (local >= 0) & (local < cols)  # [N]
    return local.clamp(0, max(cols - 1, 0)), owned


def chunk_lse_and_target(raw: torch.Tensor, dtype: torch.dtype, local: torch.Tensor, sampling, tp_group,
                         tp_size: int, *, fresh: bool = False):
    """``(lse [c], picked [c], tau [c] or None)`` of one chunk of this rank's logits ``raw [c, Vt]``: the
    log-sum-exp over its columns and the logit at ``local`` (in ``dtype``, float32 or wider), over the
    columns the filter keeps when ``sampling`` is set (``tau`` the thresholds, in ``raw``'s dtype).
    ``fresh``: ``raw`` may be overwritten (the log-sum-exp is then taken in place: no second chunk)."""
    x = raw.to(dtype)  # [c, Vt], a copy when the dtype changes
    fresh = fresh or raw.dtype != dtype
    tau = None
    if sampling is not None:
        tau = _thresholds(raw, sampling, tp_group, tp_size)
        x, fresh = _filtered(x, tau), True
    picked = x.gather(1, local[:, None]).squeeze(1)  # [c]
    if not fresh:  # x is the caller's tensor
        return torch.logsumexp(x, dim=-1), picked, tau
    # [c]; a row with no column kept on this TP rank (filtered) is all -inf: shift it by 0, its lse is -inf
    top = x.amax(dim=-1).nan_to_num(neginf=0.0)
    return x.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top), picked, tau


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden [c, H] @ weight.T / temperature``: ``[c, Vt]`` in the inputs' dtype, a new tensor (divided in
    place, as NeMo-RL scales its logits)."""
    z = hidden @ weight.T  # [c, Vt]
    return z if temperature == 1.0 else z.div_(temperature)


def chunked_lse_and_target(rows, weight, temperature: float, local, owned, dtype, chunk: int, sampling, tp_group,
                           tp_size: int):
    """Both kernels' forward over ``N`` tokens, ``chunk`` at a time: ``(lse [N], picked [N], owned [N], tau)``
    for the whole vocabulary (:func:`chunk_lse_and_target` per chunk, then :func:`combine_vocab_parallel`).

    ``rows`` is the logits ``[N, Vt]`` (``weight`` None), or the hidden states ``[N, H]`` whose chunk of
    logits ``rows[i:j] @ weight.T / temperature`` is made here and overwritten by its log-sum-exp. ``tau``:
    the thresholds ``[N]`` with a filter, else ``[0]``."""
    n = rows.shape[0]
    lse = rows.new_empty(n, dtype=dtype)
    picked = rows.new_empty(n, dtype=dtype)
    tau = rows.new_empty(n if sampling is not None else 0, dtype=dtype)  # [N] thresholds when filtering
    for i in range(0, n, chunk):  # static: n and chunk are Python ints
        j = i + chunk
        raw = rows[i:j] if weight is None else chunk_logits(rows[i:j], weight, temperature)  # [c, Vt]
        lse[i:j], picked[i:j], tau_c = chunk_lse_and_target(raw, dtype, local[i:j], sampling, tp_group, tp_size,
                                                            fresh=weight is not None)
        if tau_c is not None:
            tau[i:j] = tau_c
        del raw, tau_c  # one [c, Vt] chunk alive at a time: freed before the next matmul allocates
    lse, picked, owned = combine_vocab_parallel(lse, picked, owned, tp_group, tp_size, sampling is not None)
    return lse, picked, owned, tau


def combine_vocab_parallel(lse, picked, owned, tp_group, tp_size: int, sampled: bool):
    """The whole vocabulary's ``(lse [N], picked [N], owned [N])`` from every TP rank's: one all-gather of
    ``[2, N]`` (the log-sum-exp over ranks; the target logit from the rank that owns it, 0 elsewhere).
    With a filter, a target it dropped (``picked = -inf``) loses its one-hot term."""
    picked = torch.where(owned, picked, 0.0)
    if tp_size > 1:
        n = lse.shape[0]
        every = all_gather_dim0(torch.stack([lse, picked]), tp_group).view(tp_size, 2, n)  # [TP, 2, N]
        lse, picked = torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0)  # [N] each
    if sampled:
        owned = owned & (picked > float("-inf"))  # a filtered target: no one-hot term
    return lse, picked, owned


def chunk_logit_grad(x, lse, tau, g, g_owned, local, *, fresh: bool) -> torch.Tensor:
    """The gradient of one chunk's logits, ``[c, Vt]`` in ``lse``'s dtype: ``-softmax * g`` plus ``g_owned``
    at the target column (``softmax`` over the kept columns when ``tau`` is given; 0 where filtered).
    ``x [c, Vt]`` holds the chunk's logits in that dtype; ``fresh``: ``x`` may be overwritten."""
    if tau is not None:
        x = _filtered(x, tau).sub_(lse[:, None])
    else:
        x = x.sub_(lse[:, None]) if fresh else x.sub(lse[:, None])
    d = x.exp_()  # [c, Vt] softmax (0 where filtered)
    return d.mul_(-g[:, None]).scatter_add_(1, local[:, None], g_owned[:, None])


def _thresholds(raw: torch.Tensor, sampling, tp_group, tp_size: int) -> torch.Tensor:
    """The filter's threshold of each row of ``raw [c, Vt]``, in the logits' own dtype (as NeMo-RL filters)."""
    if tp_size > 1:
        return vocab_parallel_thresholds(raw, sampling, tp_group, tp_size)
    return row_thresholds(raw, sampling)


def _filtered(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """A new ``[c, Vt]`` tensor: ``x`` with the entries below their row's ``tau [c]`` set to ``-inf``."""
    return x.masked_fill(x < tau[:, None], float("-inf"))


def token_logprobs_local(
    logits: torch.Tensor,
    target: torch.Tensor,
    keep: torch.Tensor,
    *,
    vocab_start: int = 0,
    tp_group: Optional["dist.ProcessGroup"] = None,
    tp_size: int = 1,
    chunk_tokens: int = 256,
    sampling=None,
) -> torch.Tensor:
    """Log-prob of ``target`` at each row of ``logits [N, Vt]`` where ``keep [N]``, else 0: ``[N]``.

    Differentiable w.r.t. ``logits``; memory beyond the logits is ``O(N)`` plus one
    ``[chunk_tokens, Vt]`` chunk. ``target`` holds vocabulary ids in ``[0, V)`` where ``keep``.
    ``sampling``: an optional :class:`~nn_data.logprobs.filters.SamplingFilter` (top-k / top-p); the
    log-softmax then runs over the kept logits only (under TP, one all-to-all and one all-gather
    per chunk find each row's threshold).
    """
    return _TargetLogProb.apply(logits, target, keep, vocab_start, tp_group, tp_size, chunk_tokens, sampling)


class _LinearTargetLogProb(torch.autograd.Function):
    """``log softmax(hidden @ weight.T / t)[i, target[i]]`` where ``keep[i]``, else 0: ``[N]`` (float32 or wider).

    ``hidden [n, H]`` (``n = N/TP`` rows with ``sequence_parallel``, gathered over the TP group here and
    again in backward, never kept gathered), ``weight [Vt, H]`` this rank's vocabulary rows starting at
    ``vocab_start``. ``sampling``: as :func:`token_logprobs_local` (top-k / top-p, one
    threshold per token, computed from each chunk's logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, keep, vocab_start: int, tp_group, tp_size: int, sequence_parallel: bool,
                chunk: int, temperature: float, sampling=None):
        full = _gather_rows(hidden, tp_group, tp_size, sequence_parallel)  # [N, H]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        local, owned = target_columns(target, vocab_start, weight.shape[0])
        lse, picked, owned, tau = chunked_lse_and_target(full, weight, temperature, local, owned, dtype, chunk,
                                                         sampling, tp_group, tp_size)
        ctx.save_for_backward(hidden, weight, local, owned, keep, lse, tau)
        ctx.parallel = (tp_group, tp_size, sequence_parallel)
        ctx.chunk, ctx.temperature, ctx.sampled = chunk, temperature, sampling is not None
        return torch.where(keep, picked - lse, 0.0)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, local, owned, keep, lse, tau = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        full = _gather_rows(hidden, *ctx.parallel)  # [N, H]
        g = torch.where(keep, grad, 0.0).to(lse.dtype)  # [N]
        g_owned = torch.where(owned, g, 0.0)  # [N] the one-hot term, on the owning TP rank only
        acc = torch.promote_types(weight.dtype, torch.float32)  # the weight gradient accumulates in float32 or wider
        grad_full = torch.empty_like(full) if want_hidden else None  # [N, H]
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None  # [Vt, H]
        for i in range(0, full.shape[0], ctx.chunk):
            j = i + ctx.chunk
            x = chunk_logits(full[i:j], weight, ctx.temperature).to(lse.dtype)  # [c, Vt], a new tensor
            dz = chunk_logit_grad(x, lse[i:j], tau[i:j] if ctx.sampled else None, g[i:j], g_owned[i:j], local[i:j],
                                  fresh=True)  # [c, Vt] the gradient of the scaled logits
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)  # [c, Vt] the gradient of hidden @ weight.T
            if want_hidden:
                grad_full[i:j] = dz.to(weight.dtype) @ weight  # [c, H]
            if want_weight:
                grad_weight.addmm_(dz.T, full[i:j].to(acc))  # [Vt, H] += [Vt, c] @ [c, H]
            del x, dz  # one [c, Vt] chunk alive at a time: freed before the next matmul allocates
        grad_hidden = _reduce_rows(grad_full, *ctx.parallel) if want_hidden else None
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def _gather_rows(hidden: torch.Tensor, tp_group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """``[n, H]`` -> ``[N, H]``: with sequence parallelism every TP rank's rows, rank-major (one all-gather)."""
    if sequence_parallel and tp_size > 1:
        return all_gather_dim0(hidden, tp_group)  # [TP*n, H]
    return hidden


def _reduce_rows(grad_full: torch.Tensor, tp_group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """The hidden states' gradient from every TP rank's vocabulary slice: ``[N, H]`` summed over the group
    (all-reduce), or with sequence parallelism this rank's ``[n, H]`` rows of the sum (reduce-scatter)."""
    if tp_size == 1:
        return grad_full
    if sequence_parallel:
        return reduce_scatter_dim0(grad_full, tp_group)  # [n, H]
    return all_reduce_sum(grad_full, tp_group)  # [N, H]


def hidden_logprobs_local(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    keep: torch.Tensor,
    *,
    vocab_start: int = 0,
    tp_group=None,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    chunk_tokens: int = 256,
    temperature: float = 1.0,
    sampling=None,
) -> torch.Tensor:
    """Log-prob of ``target [N]`` under ``softmax(hidden @ weight.T / temperature)`` where ``keep [N]``, else
    0: ``[N]``, the logits one ``[chunk_tokens, Vt]`` chunk at a time.

    ``hidden [n, H]`` (``n = N``, or ``N/TP`` with ``sequence_parallel``), ``weight [Vt, H]`` in the same
    dtype (this TP rank's vocabulary rows from ``vocab_start``); ``target`` vocabulary ids where ``keep``.
    Differentiable w.r.t. ``hidden`` and ``weight``; equals :func:`token_logprobs_local`
    on the logits ``hidden @ weight.T / temperature`` (values and gradients). ``sampling``: an optional
    :class:`~nn_data.logprobs.filters.SamplingFilter` (top-k / top-p over each token's logits, exact: one threshold
    per token from its chunk).
    """
    return _LinearTargetLogProb.apply(hidden, weight, target, keep, vocab_start, tp_group, tp_size,
                                      bool(sequence_parallel), chunk_tokens, float(temperature), sampling)
