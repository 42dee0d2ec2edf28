"""Token log-probs straight from hidden states and the output weight: the logits exist one chunk at a time.

Shape legend
    N   tokens this rank scores (``T/C`` under context parallelism)
    n   rows of hidden states this rank holds: ``N``, or ``N/TP`` with sequence parallelism (gathered inside)
    H   hidden size
    Vt  rows of this tensor-parallel rank's output weight, its vocabulary slice (``V/TP``)
    c   tokens per chunk (``chunk_tokens``)

``log p(target[i]) = z[i, target[i]] - logsumexp_v z[i, v]`` with ``z = hidden @ weight.T / temperature``.
Forward computes ``z`` for ``c`` tokens at a time and keeps, per token, the log-sum-exp and the target's
logit (``[N]`` each); backward recomputes each chunk's ``z`` and turns its gradient
``dz = g * (onehot - softmax)`` into the gradients of the hidden states (``dz @ weight``) and of the weight
(``dz.T @ hidden``, accumulated over the chunks in place). Beyond its inputs and the two gradients the
op holds ``O(N)`` values and one or two ``[c, Vt]`` float32 chunks: the ``[N, Vt]`` logits, their
log-softmax and their gradient never exist. The price is one more matmul (the recompute): four
``N x H x Vt`` matmuls for forward + backward where the unfused path has three.

Tensor parallelism (vocab-parallel weight, rank ``k`` holding rows ``[k*Vt, (k+1)*Vt)``): the per-rank
log-sum-exp and target logit are combined over the TP group with one ``[2, N]`` all-gather
(``nn_data.logprobs.combine_vocab_parallel``: the maximum and the sum of exponentials over ranks,
the target's logit from the rank that owns it). Each rank's ``dz @ weight`` is its vocabulary slice's
share of the hidden states' gradient: summed over the TP group (an all-reduce; a reduce-scatter of the
gathered rows with sequence parallelism), as megatron-core's column-parallel output layer does.

Worked example (V 3, uniform logits, N 2): ``z = 0`` -> ``lse = log 3``, ``log p = -log 3`` for both
tokens, whatever ``hidden`` and ``weight`` (zero) are.
"""

from __future__ import annotations

import torch

from nn_data.cp_comm import all_gather_dim0, all_reduce_sum, reduce_scatter_dim0
from nn_data.logprobs import chunk_lse_and_target, chunk_logit_grad, combine_vocab_parallel, target_columns


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden [c, H] @ weight.T / temperature``: ``[c, Vt]`` in the inputs' dtype, a new tensor (divided in
    place, as NeMo-RL scales its logits)."""
    z = hidden @ weight.T  # [c, Vt]
    return z if temperature == 1.0 else z.div_(temperature)


class _LinearTargetLogProb(torch.autograd.Function):
    """``log softmax(hidden @ weight.T / t)[i, target[i]]`` where ``keep[i]``, else 0: ``[N]`` (float32 or wider).

    ``hidden [n, H]`` (``n = N/TP`` rows with ``sequence_parallel``, gathered over the TP group here and
    again in backward, never kept gathered), ``weight [Vt, H]`` this rank's vocabulary rows starting at
    ``vocab_start``. ``sampling``: as :func:`nn_data.logprobs.token_logprobs_local` (top-k / top-p, one
    threshold per token, computed from each chunk's logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, keep, vocab_start: int, tp_group, tp_size: int, sequence_parallel: bool,
                chunk: int, temperature: float, sampling=None):
        full = _gather_rows(hidden, tp_group, tp_size, sequence_parallel)  # [N, H]
        n, cols = full.shape[0], weight.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        local, owned = target_columns(target, vocab_start, cols)
        lse = full.new_empty(n, dtype=dtype)
        picked = full.new_empty(n, dtype=dtype)
        tau = full.new_empty(n if sampling is not None else 0, dtype=dtype)  # [N] thresholds when filtering
        for i in range(0, n, chunk):  # static: n and chunk are Python ints
            j = i + chunk
            raw = chunk_logits(full[i:j], weight, temperature)  # [c, Vt], overwritten by the log-sum-exp
            lse[i:j], picked[i:j], tau_c = chunk_lse_and_target(raw, dtype, local[i:j], sampling, tp_group, tp_size,
                                                                fresh=True)
            if tau_c is not None:
                tau[i:j] = tau_c
            del raw, tau_c  # one [c, Vt] chunk alive at a time: freed before the next matmul allocates
        lse, picked, owned = combine_vocab_parallel(lse, picked, owned, tp_group, tp_size, sampling is not None)
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
    Differentiable w.r.t. ``hidden`` and ``weight``; equals :func:`nn_data.logprobs.token_logprobs_local`
    on the logits ``hidden @ weight.T / temperature`` (values and gradients). ``sampling``: an optional
    :class:`~nn_data.sampling.SamplingFilter` (top-k / top-p over each token's logits, exact: one threshold
    per token from its chunk).
    """
    return _LinearTargetLogProb.apply(hidden, weight, target, keep, vocab_start, tp_group, tp_size,
                                      bool(sequence_parallel), chunk_tokens, float(temperature), sampling)

