"""The LM head's one chunked, vocabulary-parallel kernel: from the logits, or from the hidden states and the
output weight (whose logits never exist), every asked output of ``softmax(z)`` per token in one pass.

Shape legend
    N   tokens this rank scores (``T/C`` under context parallelism)
    n   rows of hidden states this rank holds: ``N``, or ``N/TP`` with sequence parallelism (gathered inside)
    H   hidden size
    Vt  this tensor-parallel rank's vocabulary slice (``V/TP``): columns of the logits, rows of the weight
    J   token ids scored per position (1 for the next token; ``K`` for a teacher's top-k ids)
    k   top-k asked; K = min(k, V) returned, k' = min(k, Vt) candidates per TP rank
    c   tokens per chunk (``chunk_tokens``)

``z = logits / temperature`` or ``z = hidden @ weight.T / temperature``, one ``[c, Vt]`` chunk at a time: per
TP rank and chunk the max, the log-sum-exp, the softmax's mean of ``z`` (for the entropy), the top-k' and the
argmax (:func:`chunk_stats`), combined over the TP group by one all-gather (:func:`combine_stats`). Backward
recomputes each chunk's ``z`` and applies one formula for every output's gradient (:func:`chunk_grad`;
docs/logprobs.md, "The head's outputs in one pass"). A sampling filter (:mod:`nn_data.logprobs.filters`) sets
the logits below each token's threshold to ``-inf`` before anything is read. Beyond its inputs the kernel
holds ``O(N)`` values and one ``[c, Vt]`` chunk.

Worked example (V 3, uniform logits, N 2): ``z = 0`` -> ``lse = log 3``, ``log p = -log 3`` for both
tokens, entropy ``log 3``, whatever ``hidden`` and ``weight`` (zero) are."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nn_data.cp_comm import all_gather_dim0, all_reduce_sum, reduce_scatter_dim0
from nn_data.logprobs.filters import row_thresholds, vocab_parallel_thresholds

_BLOCK = 16  # rows of the entropy's exponentials: a [16, Vt] block beside the chunk, never a second chunk
_FLOOR = -1e4  # below every log-probability whose exp is nonzero in float32 and float64: exp(-1e4) = 0


def _stat_rows(want_entropy: bool, want_argmax: bool) -> int:
    """Per-rank statistics gathered over TP: the log-sum-exp; with the entropy or the argmax also the softmax
    mean of ``z`` and the max (3 rows)."""
    return 3 if want_entropy or want_argmax else 1


def local_ids(ids: torch.Tensor, vocab_start: int, cols: int):
    """``(local [N, J], owned [N, J])``: each global id's column on this TP rank (clamped into ``[0, Vt)``)
    and whether this rank holds it. Example: ids ``[[1], [5], [9]]``, vocab_start 4, cols 4 -> local
    ``[[0], [1], [3]]``, owned ``[[F], [T], [F]]``."""
    local = ids - vocab_start  # [N, J]
    owned = (local >= 0) & (local < cols)  # [N, J]
    return local.clamp(0, max(cols - 1, 0)), owned


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``hidden [c, H] @ weight.T / temperature``: ``[c, Vt]`` in the inputs' dtype, a new tensor (divided in
    place, as NeMo-RL scales its logits)."""
    z = hidden @ weight.T  # [c, Vt]
    return z if temperature == 1.0 else z.div_(temperature)


def _chunk(full: torch.Tensor, weight, i: int, j: int, temperature: float):
    """``(z [c, Vt], fresh)``: rows ``i:j`` of the logits, read (``weight`` None) or computed (``full[i:j] @
    weight.T``), divided by ``temperature``; ``fresh``: a new tensor the caller may overwrite."""
    if weight is not None:
        return chunk_logits(full[i:j], weight, temperature), True  # [c, Vt]
    return (full[i:j], False) if temperature == 1.0 else (full[i:j] / temperature, True)


def _filter(z: torch.Tensor, tau: torch.Tensor, fresh: bool) -> torch.Tensor:
    """``z [c, Vt]`` with the entries below their row's ``tau [c]`` set to ``-inf``: in place when ``fresh``."""
    below = z < tau[:, None].to(z.dtype)  # [c, Vt]
    return z.masked_fill_(below, float("-inf")) if fresh else z.masked_fill(below, float("-inf"))


def _thresholds(z: torch.Tensor, sampling, tp_group, tp_size: int) -> torch.Tensor:
    """The filter's threshold of each row of ``z [c, Vt]``, in the logits' own dtype (as NeMo-RL filters)."""
    if tp_size > 1:
        return vocab_parallel_thresholds(z, sampling, tp_group, tp_size)
    return row_thresholds(z, sampling)


def chunk_stats(z: torch.Tensor, dtype, local, owned, k: int, want_entropy: bool, want_argmax: bool, *,
                fresh: bool = False):
    """One chunk's per-rank statistics from its logits ``z [c, Vt]`` (read once): ``(stats [R, c], picked [c, J],
    topk (values, local columns) [c, k'], argmax local column [c])``, each None when not asked. ``stats``: the
    local log-sum-exp and, with the entropy or the argmax (``R`` 3), the local softmax's mean of ``z`` and the local
    max; ``picked``: ``z`` at ``local`` (0 where not ``owned``). ``fresh``: ``z`` may be overwritten. ``-inf``
    entries (filtered) weigh 0."""
    x = z.to(dtype)  # [c, Vt] (z itself when the dtype matches)
    arg = None
    if want_argmax:  # the max and its first column in one pass
        top, arg = x.max(dim=-1)  # [c] each
    else:
        top = x.amax(dim=-1)  # [c]
    picked = None
    if local is not None:
        picked = torch.where(owned, x.gather(1, local), 0.0)  # [c, J]
    topk = torch.topk(x, min(k, x.shape[1]), dim=-1) if k else None  # [c, k'] each
    stats = torch.zeros(_stat_rows(want_entropy, want_argmax), x.shape[0], dtype=dtype, device=x.device)  # [R, c]
    if stats.shape[0] > 1:
        stats[2] = top
    shift = top.nan_to_num(neginf=0.0)  # [c] a row all -inf on this rank (filtered) is shifted by 0
    x = x.sub_(shift[:, None]) if fresh or x is not z else x - shift[:, None]  # [c, Vt] z - m, may be -inf
    if not want_entropy:
        s = x.exp_().sum(dim=-1)  # [c]
    else:  # s and sum exp(z - m) (z - m), a [16, Vt] block of exponentials at a time beside the chunk
        x.clamp_min_(_FLOOR)  # -inf (filtered) -> a finite value whose exp is 0: no 0 * -inf
        s, dot = x.new_empty(x.shape[0]), x.new_empty(x.shape[0])  # [c] each
        for r in range(0, x.shape[0], _BLOCK):  # static: Python ints
            e = x[r:r + _BLOCK].exp()  # [b, Vt]
            s[r:r + _BLOCK] = e.sum(dim=-1)
            dot[r:r + _BLOCK] = e.mul_(x[r:r + _BLOCK]).sum(dim=-1)
        stats[1] = torch.where(s > 0, dot / s, 0.0) + shift  # [c] the local softmax's mean of z
    stats[0] = s.log() + shift
    return stats, picked, topk, arg


def combine_stats(stats: torch.Tensor, picked, tp_group, tp_size: int):
    """``(lse [N], mean [N], top [TP, N], picked [N, J])`` (None where not asked) over the whole vocabulary from every
    TP rank's ``stats [R, N]`` and ``picked [N, J]``: one all-gather of both. Example (TP 2): local lse ``[log 2,
    log 6]``, means ``[0, 1]`` -> lse ``log 8``, mean ``2/8 * 0 + 6/8 * 1 = 0.75``."""
    r = stats.shape[0]
    if tp_size > 1:
        both = stats if picked is None else torch.cat([stats, picked.T])  # [R + J, N]
        every = all_gather_dim0(both[None], tp_group)  # [TP, R + J, N]
        picked = None if picked is None else every[:, r:].sum(0).T  # [N, J] from the owning rank
    else:
        every = stats[None]  # [1, R, N]
    lse = torch.logsumexp(every[:, 0], dim=0)  # [N]
    if r == 1:
        return lse, None, None, picked
    weight = (every[:, 0] - lse).exp()  # [TP, N] each rank's share of the probability mass
    return lse, (weight * every[:, 1]).sum(0), every[:, 2], picked


def combine_topk(values: torch.Tensor, ids: torch.Tensor, k: int, tp_group, tp_size: int):
    """The global top-``k`` ``(values [N, K], ids [N, K])`` from every TP rank's candidates ``values [N, k']``
    and their global ``ids [N, k']`` (one all-gather of each): ``K = min(k, k' * TP)``. Example (TP 2, k 2):
    rank 0 ``[5, 1]`` ids ``[0, 3]``, rank 1 ``[4, 2]`` ids ``[6, 4]`` -> ``[5, 4]`` ids ``[0, 6]``."""
    if tp_size > 1:
        n, kk = values.shape
        values = all_gather_dim0(values[None], tp_group).permute(1, 0, 2).reshape(n, tp_size * kk)  # [N, TP*k']
        ids = all_gather_dim0(ids[None], tp_group).permute(1, 0, 2).reshape(n, tp_size * kk)  # [N, TP*k']
    best, pos = torch.topk(values, min(k, values.shape[1]), dim=-1)  # [N, K]
    return best, ids.gather(1, pos)


def combine_argmax(top: torch.Tensor, ids: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """The global argmax id ``[N]`` from every TP rank's max ``top [TP, N]`` (already gathered) and local
    argmax ``ids [N]`` (global ids; one all-gather): the first rank with the largest value, so the lowest id
    among equal logits. Example (TP 2): maxima ``[[3, 7], [3, 2]]``, ids ``[[1, 0], [5, 6]]`` -> ``[1, 0]``."""
    if tp_size > 1:
        ids = all_gather_dim0(ids[None], tp_group)  # [TP, N]
        return ids.gather(0, top.argmax(dim=0, keepdim=True)).squeeze(0)
    return ids


def chunk_grad(z: torch.Tensor, dtype, lse, entropy, g_sum, g_entropy, local, g_local, *,
               fresh: bool) -> torch.Tensor:
    """The gradient of one chunk's logits ``z [c, Vt]`` in ``dtype``: ``-p * (g_sum + g_entropy * (x + entropy))``
    plus ``g_local [c, M]`` at the columns ``local [c, M]``, with ``x = z - lse``, ``p = exp(x)`` (0 where filtered);
    ``entropy``/``g_entropy`` None without the entropy output. ``fresh``: ``z`` may be overwritten."""
    x = z.to(dtype)  # [c, Vt], a copy when the dtype changes
    x = x.sub_(lse[:, None]) if fresh or z.dtype != dtype else x.sub(lse[:, None])  # [c, Vt] log p
    if g_entropy is None:
        d = x.exp_().mul_(-g_sum[:, None])  # [c, Vt]
    else:  # p (a + b x) with a = -(g_sum + g_H H), b = -g_H: a [16, Vt] block of exponentials at a time
        a, b = -(g_sum + g_entropy * entropy), -g_entropy  # [c] each
        d = x.clamp_min_(_FLOOR)  # -inf (filtered) -> a finite value whose exp is 0: no 0 * -inf
        for r in range(0, d.shape[0], _BLOCK):  # static: Python ints
            p = d[r:r + _BLOCK].exp()  # [b, Vt]
            d[r:r + _BLOCK].mul_(b[r:r + _BLOCK, None]).add_(a[r:r + _BLOCK, None]).mul_(p)
    if local is not None:
        d.scatter_add_(1, local, g_local)
    return d


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


class _HeadOutputs(torch.autograd.Function):
    """Every asked output in one pass over ``rows``, the logits ``[N, Vt]`` (``weight`` None) or hidden states ``[n,
    H]`` with ``weight [Vt, H]``: six tensors (empty when not asked), logprobs ``[N, J]``, entropy ``[N]``, top-k
    log-probs and ids ``[N, K]``, argmax ``[N]``, lse ``[N]``."""

    @staticmethod
    def forward(ctx, rows, weight, ids, keep, vocab_start: int, tp_group, tp_size: int, sequence_parallel: bool,
                chunk: int, temperature: float, k: int, want_entropy: bool, want_argmax: bool, sampling=None):
        full = rows if weight is None else _gather_rows(rows, tp_group, tp_size, sequence_parallel)  # [N, *]
        dtype = torch.promote_types(rows.dtype, torch.float32)
        n, cols = full.shape[0], (rows.shape[1] if weight is None else weight.shape[0])
        local, owned = local_ids(ids, vocab_start, cols) if ids is not None else (None, None)  # [N, J] each
        stats = full.new_empty((_stat_rows(want_entropy, want_argmax), n), dtype=dtype)  # [R, N]
        picked = full.new_zeros((n, ids.shape[1] if ids is not None else 0), dtype=dtype)  # [N, J]
        kk = min(k, cols)
        cand = full.new_empty((n, kk), dtype=dtype)  # [N, k'] this rank's top-k' logits
        cand_ids = torch.empty((n, kk), dtype=torch.int64, device=full.device)  # [N, k'] their global ids
        arg = torch.empty((n if want_argmax else 0), dtype=torch.int64, device=full.device)  # [N]
        tau = full.new_empty((n if sampling is not None else 0), dtype=dtype)  # [N] the filter's thresholds
        for i in range(0, n, chunk):  # static: n and chunk are Python ints
            j = i + chunk
            z, fresh = _chunk(full, weight, i, j, temperature)  # [c, Vt]
            if sampling is not None:
                tau[i:j] = _thresholds(z, sampling, tp_group, tp_size)
                z, fresh = _filter(z, tau[i:j], fresh), True
            st, pk, tk, am = chunk_stats(z, dtype, None if local is None else local[i:j],
                                         None if owned is None else owned[i:j], k, want_entropy, want_argmax,
                                         fresh=fresh)
            stats[:, i:j] = st
            if pk is not None:
                picked[i:j] = pk
            if tk is not None:
                cand[i:j], cand_ids[i:j] = tk.values, tk.indices + vocab_start
            if am is not None:
                arg[i:j] = am + vocab_start
            del z, st, pk, tk, am  # one chunk alive at a time: freed before the next matmul allocates
        lse, mean, top, picked = combine_stats(stats, None if ids is None else picked, tp_group, tp_size)
        # an output not asked for: a new empty tensor each (outputs sharing one tensor break torch.compile)
        logprobs = lse.new_empty(0)
        if ids is not None:
            if sampling is not None:
                owned = owned & (picked > float("-inf"))  # a filtered id: no one-hot term
            logprobs = torch.where(keep[:, None], picked - lse[:, None], 0.0)  # [N, J]
        entropy = lse - mean if want_entropy else lse.new_empty(0)  # [N]
        top_lp, top_ids = lse.new_empty(0), torch.empty(0, dtype=torch.int64, device=full.device)
        top_local = top_owned = top_ids  # empty without top-k (a saved None breaks torch.compile's backward)
        if k:
            best, top_ids = combine_topk(cand, cand_ids, k, tp_group, tp_size)  # [N, K] each
            top_lp = best - lse[:, None]  # [N, K]
            top_local, top_owned = local_ids(top_ids, vocab_start, cols)  # [N, K] each
            if sampling is not None:
                top_owned = top_owned & (best > float("-inf"))  # a filtered id (K above the kept count)
        argmax = combine_argmax(top, arg, tp_group, tp_size) if want_argmax else arg  # [N]
        ctx.save_for_backward(rows, weight, local, owned, keep, lse, entropy, top_local, top_owned, tau)
        ctx.parallel = (tp_group, tp_size, sequence_parallel)
        ctx.chunk, ctx.temperature, ctx.sampled = chunk, temperature, sampling is not None
        ctx.mark_non_differentiable(top_ids, argmax, lse)
        return logprobs, entropy, top_lp, top_ids, argmax, lse

    @staticmethod
    def backward(ctx, g_lp, g_entropy, g_top, _ids, _argmax, _lse):
        rows, weight, local, owned, keep, lse, entropy, top_local, top_owned, tau = ctx.saved_tensors
        from_hidden = weight is not None
        full = _gather_rows(rows, *ctx.parallel) if from_hidden else rows  # [N, *]
        dtype, n = lse.dtype, lse.shape[0]
        g_sum = torch.zeros_like(lse)  # [N] the gradients of every log-prob output of a position
        cols, grads = [], []  # [N, M] columns on this rank and their gradients (0 where another rank owns the id)
        if local is not None:
            g = torch.where(keep[:, None], g_lp, 0.0).to(dtype)  # [N, J]
            g_sum += g.sum(1)
            cols.append(local)
            grads.append(torch.where(owned, g, 0.0))
        if top_local.numel():
            g = g_top.to(dtype)  # [N, K]
            g_sum += g.sum(1)
            cols.append(top_local)
            grads.append(torch.where(top_owned, g, 0.0))
        col = None if not cols else cols[0] if len(cols) == 1 else torch.cat(cols, 1)  # [N, M]
        g_col = None if not cols else grads[0] if len(cols) == 1 else torch.cat(grads, 1)  # [N, M]
        g_h = g_entropy.to(dtype) if entropy.numel() else None  # [N]
        if not from_hidden:
            out = torch.empty_like(rows)  # [N, Vt]
        else:
            want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_full = torch.empty_like(full) if want_hidden else None  # [N, H]
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_weight else None
        for i in range(0, n, ctx.chunk):
            j = i + ctx.chunk
            z, fresh = _chunk(full, weight, i, j, ctx.temperature)  # [c, Vt]
            if ctx.sampled:
                z, fresh = _filter(z, tau[i:j], fresh), True
            dz = chunk_grad(z, dtype, lse[i:j], entropy[i:j] if g_h is not None else None, g_sum[i:j],
                            None if g_h is None else g_h[i:j], None if col is None else col[i:j],
                            None if col is None else g_col[i:j], fresh=fresh)  # [c, Vt]
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)  # [c, Vt] the gradient of the unscaled logits
            if not from_hidden:
                out[i:j] = dz
            else:
                if want_hidden:
                    grad_full[i:j] = dz.to(weight.dtype) @ weight  # [c, H]
                if want_weight:
                    grad_weight.addmm_(dz.T, full[i:j].to(dtype))  # [Vt, H] += [Vt, c] @ [c, H]
            del z, dz  # one chunk alive at a time
        if not from_hidden:
            return (out,) + (None,) * 13
        grad_hidden = _reduce_rows(grad_full, *ctx.parallel) if want_hidden else None
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        return (grad_hidden, grad_weight) + (None,) * 12


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
    """Log-prob of ``target [N]`` at each row of ``logits [N, Vt]`` where ``keep [N]``, else 0: ``[N]``, the
    head kernel with only this output asked; differentiable w.r.t. ``logits``. ``target`` holds vocabulary ids
    in ``[0, V)`` where ``keep``; ``sampling``: an optional :class:`~nn_data.logprobs.filters.SamplingFilter`
    (the log-softmax then runs over the kept logits only).

    Example: logits ``[[0., 0., 0.]]``, target ``[2]``, keep ``[True]`` -> ``[-log 3]``."""
    return _HeadOutputs.apply(logits, None, target[:, None].to(torch.int64), keep, int(vocab_start), tp_group,
                              int(tp_size), False, int(chunk_tokens), 1.0, 0, False, False, sampling)[0].squeeze(1)


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
    """Log-prob of ``target [N]`` under ``softmax(hidden @ weight.T / temperature)`` where ``keep [N]``, else 0:
    ``[N]``, equal to :func:`token_logprobs_local` on those logits (values and gradients of ``hidden`` and
    ``weight``), one ``[chunk_tokens, Vt]`` chunk at a time. ``hidden [n, H]`` (``n = N``, or ``N/TP`` with
    ``sequence_parallel``), ``weight [Vt, H]`` this TP rank's vocabulary rows from ``vocab_start``;
    ``sampling`` as there.

    Example: ``hidden [2, H]`` and ``weight [3, H]`` of zeros, target ``[0, 2]`` -> ``[-log 3, -log 3]``."""
    return _HeadOutputs.apply(hidden, weight, target[:, None].to(torch.int64), keep, int(vocab_start), tp_group,
                              int(tp_size), bool(sequence_parallel), int(chunk_tokens), float(temperature), 0, False,
                              False, sampling)[0].squeeze(1)
