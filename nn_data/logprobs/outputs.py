"""The LM head's outputs in one chunked, vocabulary-parallel pass: log-probs at given token ids, the entropy,
the top-k log-probs with their global ids, the argmax, from the logits or from hidden states and the weight.

Shape legend
    N   tokens this rank scores (``T/C`` under context parallelism)
    n   rows of hidden states this rank holds: ``N``, or ``N/TP`` with sequence parallelism (gathered inside)
    H   hidden size
    Vt  this tensor-parallel rank's vocabulary slice (``V/TP``): columns of the logits, rows of the weight
    J   token ids scored per position (1 for the next token; ``K`` for a teacher's top-k ids)
    k   top-k asked; K = min(k, V) returned, k' = min(k, Vt) candidates per TP rank
    c   tokens per chunk (``chunk_tokens``)

With ``z`` the (temperature-scaled) logits of one position and ``L = logsumexp(z)`` over the whole vocabulary:

* ``logprobs [N, J]``: ``z[id] - L`` at each given id where ``keep``, else 0;
* ``entropy [N]``: ``-sum_v p_v log p_v = L - sum_v p_v z_v``;
* ``topk_logprobs [N, K]`` and ``topk_indices [N, K]``: the ``K`` largest ``z - L`` and their global ids;
* ``argmax [N]``: the global id of the largest logit (the lowest id among equal ones, as ``torch.argmax``).

Each is opt-in; the logits of a chunk are computed (or read) once in forward and once in backward, and every
asked output comes from that one read. Per TP rank and chunk: the local max ``m``, ``s = sum exp(z - m)``,
``e = sum exp(z - m) (z - m) / s`` (the local softmax's mean of ``z - m``), the local top-k' and argmax; one
all-gather of ``[3, N]`` statistics (plus ``[N, k']`` values and ids for top-k) combines them:
``L = logsumexp_r(m_r + log s_r)``, ``sum_v p_v z_v = sum_r exp(m_r + log s_r - L) (m_r + e_r)``.

Backward, with ``x = z - L`` (log p) and ``p = exp(x)``, one formula for every output's gradient:
``dz = -p * (G + g_H * (x + H)) + scatter(ids, g_ids)`` where ``G`` sums the gradients of every log-prob output
of the position (each ``z[id] - L`` contributes ``-p``), ``g_H`` is the entropy's (``dH/dz = -p (x + H)``) and
the scatter adds each log-prob's gradient at its id's column on the TP rank that owns it. The hidden states'
and the weight's gradients follow as in :mod:`nn_data.logprobs.kernels` (``dz @ weight``, ``dz.T @ hidden``).

Worked example (V 4, one position, z ``[0, 0, log 2, log 4]`` -> p ``[1/8, 1/8, 2/8, 4/8]``): logprob of id 3
``log(1/2)``; entropy ``-(2/8 log 1/8 + 2/8 log 2/8 + 4/8 log 4/8) = 1.2130``; top-2 ids ``[3, 2]`` with
``[log 1/2, log 1/4]``; argmax 3.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nn_data import _checks
from nn_data.cp_comm import all_gather_dim0
from nn_data.logprobs.kernels import _gather_rows, _reduce_rows, chunk_logits

_STATS = 3  # per-rank statistics gathered over TP: log-sum-exp, softmax mean of z, max


class HeadOutputs(NamedTuple):
    """The outputs of one chunked pass; an output not asked for is None.

    ``logprobs [N, J]`` (or ``[N]`` when the ids were ``[N]``), ``entropy [N]``, ``topk_logprobs [N, K]``
    (differentiable), ``topk_indices [N, K]`` int64, ``argmax [N]`` int64 (not differentiable), ``lse [N]``
    the log-sum-exp of each position's logits (not differentiable)."""

    logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None
    topk_indices: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None


def local_ids(ids: torch.Tensor, vocab_start: int, cols: int):
    """``(local [N, J], owned [N, J])``: each global id's column on this TP rank (clamped into ``[0, Vt)``)
    and whether this rank holds it. Example: ids ``[[1], [5], [9]]``, vocab_start 4, cols 4 -> local
    ``[[0], [1], [3]]``, owned ``[[F], [T], [F]]``."""
    local = ids - vocab_start  # [N, J]
    owned = (local >= 0) & (local < cols)  # [N, J]
    return local.clamp(0, max(cols - 1, 0)), owned


def chunk_stats(z: torch.Tensor, dtype, local, owned, k: int, want_entropy: bool, want_argmax: bool, *,
                fresh: bool = False):
    """One chunk's per-rank statistics from its logits ``z [c, Vt]`` (read once, any dtype):
    ``(stats [3, c], picked [c, J] or None, topk (values [c, k'], local columns [c, k']) or None,
    argmax local column [c] or None)``. ``stats``: the local log-sum-exp, the local softmax's mean of ``z``
    (when ``want_entropy``), the local max; ``picked``: ``z`` at ``local`` (0 where not ``owned``).
    ``fresh``: ``z`` may be overwritten (the exponentials then take its place: one chunk fewer)."""
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
    stats = torch.zeros(_STATS, x.shape[0], dtype=dtype, device=x.device)  # [3, c]
    stats[2] = top
    if not want_entropy:
        e = x.sub_(top[:, None]) if fresh or x is not z else x - top[:, None]  # [c, Vt] z - m
        stats[0] = e.exp_().sum(dim=-1).log_() + top
        return stats, picked, topk, arg
    shifted = x - top[:, None]  # [c, Vt] z - m
    e = shifted.exp()  # [c, Vt]
    s = e.sum(dim=-1)  # [c]
    stats[0] = s.log() + top
    stats[1] = (e.mul_(shifted)).sum(dim=-1) / s + top  # [c] the local softmax's mean of z
    return stats, picked, topk, arg


def combine_stats(stats: torch.Tensor, tp_group, tp_size: int):
    """``(lse [N], mean [N], every [TP, 3, N])``: the whole vocabulary's log-sum-exp and softmax mean of ``z``
    from every TP rank's statistics ``[3, N]`` (one all-gather). Example (TP 2): local lse ``[log 2, log 6]``,
    means ``[0, 1]`` -> lse ``log 8``, mean ``2/8 * 0 + 6/8 * 1 = 0.75``."""
    every = stats[None] if tp_size == 1 else all_gather_dim0(stats[None], tp_group)  # [TP, 3, N]
    lse = torch.logsumexp(every[:, 0], dim=0)  # [N]
    weight = (every[:, 0] - lse).exp()  # [TP, N] each rank's share of the probability mass
    return lse, (weight * every[:, 1]).sum(0), every


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
    """The gradient of one chunk's logits ``z [c, Vt]`` in ``dtype``: ``-p * (g_sum + g_entropy * (x +
    entropy))`` plus ``g_local [c, M]`` at the columns ``local [c, M]`` (0 where another rank owns the id),
    with ``x = z - lse`` and ``p = exp(x)``; ``entropy``/``g_entropy`` None without the entropy output.
    ``fresh``: ``z`` may be overwritten."""
    x = z.to(dtype)  # [c, Vt], a copy when the dtype changes
    x = x.sub_(lse[:, None]) if fresh or z.dtype != dtype else x.sub(lse[:, None])  # [c, Vt] log p
    if g_entropy is None:
        d = x.exp_().mul_(-g_sum[:, None])  # [c, Vt]
    else:
        p = x.exp()  # [c, Vt]
        d = p.mul_(x.add_(entropy[:, None]).mul_(-g_entropy[:, None]).sub_(g_sum[:, None]))  # [c, Vt]
    if local is not None:
        d.scatter_add_(1, local, g_local)
    return d


class _HeadOutputs(torch.autograd.Function):
    """Every asked output of :func:`head_outputs_local` in one pass: ``rows`` is the logits ``[N, Vt]``
    (``weight`` None) or the hidden states ``[n, H]`` with ``weight [Vt, H]``. Returns six tensors (an output
    not asked for is empty): logprobs ``[N, J]``, entropy ``[N]``, top-k log-probs and ids ``[N, K]``,
    argmax ``[N]``, lse ``[N]``."""

    @staticmethod
    def forward(ctx, rows, weight, ids, keep, vocab_start: int, tp_group, tp_size: int, sequence_parallel: bool,
                chunk: int, temperature: float, k: int, want_entropy: bool, want_argmax: bool):
        full = rows if weight is None else _gather_rows(rows, tp_group, tp_size, sequence_parallel)  # [N, *]
        dtype = torch.promote_types(rows.dtype, torch.float32)
        n, cols = full.shape[0], (rows.shape[1] if weight is None else weight.shape[0])
        local, owned = local_ids(ids, vocab_start, cols) if ids is not None else (None, None)  # [N, J] each
        stats = full.new_empty((_STATS, n), dtype=dtype)  # [3, N]
        picked = full.new_zeros((n, ids.shape[1] if ids is not None else 0), dtype=dtype)  # [N, J]
        kk = min(k, cols)
        cand = full.new_empty((n, kk), dtype=dtype)  # [N, k'] this rank's top-k' logits
        cand_ids = torch.empty((n, kk), dtype=torch.int64, device=full.device)  # [N, k'] their global ids
        arg = torch.empty((n if want_argmax else 0), dtype=torch.int64, device=full.device)  # [N]
        for i in range(0, n, chunk):  # static: n and chunk are Python ints
            j = i + chunk
            z = _chunk(full, weight, i, j, temperature)  # [c, Vt]
            st, pk, tk, am = chunk_stats(z, dtype, None if local is None else local[i:j],
                                         None if owned is None else owned[i:j], k, want_entropy, want_argmax,
                                         fresh=weight is not None or temperature != 1.0)
            stats[:, i:j] = st
            if pk is not None:
                picked[i:j] = pk
            if tk is not None:
                cand[i:j], cand_ids[i:j] = tk.values, tk.indices + vocab_start
            if am is not None:
                arg[i:j] = am + vocab_start
            del z, st, pk, tk, am  # one chunk's temporaries alive at a time
        lse, mean, every = combine_stats(stats, tp_group, tp_size)  # [N], [N], [TP, 3, N]
        empty = lse.new_empty(0)
        logprobs = empty
        if ids is not None:
            if tp_size > 1:
                picked = all_gather_dim0(picked[None], tp_group).sum(0)  # [N, J] from the owning rank
            logprobs = torch.where(keep[:, None], picked - lse[:, None], 0.0)  # [N, J]
        entropy = lse - mean if want_entropy else empty  # [N]
        top_lp, top_ids = empty, torch.empty(0, dtype=torch.int64, device=full.device)
        if k:
            best, top_ids = combine_topk(cand, cand_ids, k, tp_group, tp_size)  # [N, K] each
            top_lp = best - lse[:, None]  # [N, K]
        argmax = combine_argmax(every[:, 2], arg, tp_group, tp_size) if want_argmax else arg  # [N]
        ctx.save_for_backward(rows, weight, local, owned, keep, lse, entropy, top_ids)
        ctx.parallel = (tp_group, tp_size, sequence_parallel)
        ctx.chunk, ctx.temperature, ctx.vocab_start = chunk, temperature, vocab_start
        ctx.mark_non_differentiable(top_ids, argmax, lse)
        return logprobs, entropy, top_lp, top_ids, argmax, lse

    @staticmethod
    def backward(ctx, g_lp, g_entropy, g_top, _ids, _argmax, _lse):
        rows, weight, local, owned, keep, lse, entropy, top_ids = ctx.saved_tensors
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
        if top_ids.numel():
            g = g_top.to(dtype)  # [N, K]
            g_sum += g.sum(1)
            top_local, top_owned = local_ids(top_ids, ctx.vocab_start, weight.shape[0] if from_hidden else rows.shape[1])
            cols.append(top_local)
            grads.append(torch.where(top_owned, g, 0.0))
        col = torch.cat(cols, 1) if cols else None  # [N, M]
        g_col = torch.cat(grads, 1) if cols else None  # [N, M]
        g_h = g_entropy.to(dtype) if entropy.numel() else None  # [N]
        if not from_hidden:
            out = torch.empty_like(rows)  # [N, Vt]
        else:
            want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_full = torch.empty_like(full) if want_hidden else None  # [N, H]
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_weight else None
        for i in range(0, n, ctx.chunk):
            j = i + ctx.chunk
            z = _chunk(full, weight, i, j, ctx.temperature)  # [c, Vt]
            dz = chunk_grad(z, dtype, lse[i:j], entropy[i:j] if g_h is not None else None, g_sum[i:j],
                            None if g_h is None else g_h[i:j], None if col is None else col[i:j],
                            None if col is None else g_col[i:j], fresh=from_hidden or ctx.temperature != 1.0)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)  # [c, Vt] the gradient of the unscaled logits
            if not from_hidden:
                out[i:j] = dz
            else:
                if want_hidden:
                    grad_full[i:j] = dz.to(weight.dtype) @ weight  # [c, H]
                if want_weight:
                    grad_weight.addmm_(dz.T, full[i:j].to(dtype))  # [Vt, H] += [Vt, c] @ [c, H]
            del z, dz  # one chunk's temporaries alive at a time
        if not from_hidden:
            return (out,) + (None,) * 12
        grad_hidden = _reduce_rows(grad_full, *ctx.parallel) if want_hidden else None
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        return (grad_hidden, grad_weight) + (None,) * 11


def _chunk(full: torch.Tensor, weight, i: int, j: int, temperature: float) -> torch.Tensor:
    """Rows ``i:j`` of the logits: read (``weight`` None; divided by ``temperature`` into a new tensor when it
    is not 1) or computed, ``full[i:j] @ weight.T / temperature`` (a new tensor)."""
    if weight is not None:
        return chunk_logits(full[i:j], weight, temperature)  # [c, Vt]
    return full[i:j] if temperature == 1.0 else full[i:j] / temperature


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
) -> HeadOutputs:
    """The asked outputs of ``softmax(z)`` per position, ``z`` the logits ``rows [N, Vt]`` (``weight`` None)
    or ``rows [n, H] @ weight.T`` (``weight [Vt, H]``, this TP rank's vocabulary rows from ``vocab_start``),
    divided by ``temperature``, one ``[chunk_tokens, Vt]`` chunk at a time: the ``[N, Vt]`` logits are never
    built from hidden states, nor their log-softmax or gradient from either.

    ``ids [N]`` or ``[N, J]``: global vocabulary ids whose log-probs are returned (0 where ``keep [N]`` is
    False); ``entropy``: the entropy ``-sum p log p``; ``top_k``: the ``min(top_k, V)`` largest log-probs and
    their global ids; ``argmax``: the id of the largest logit. Differentiable w.r.t. the logits (or the hidden
    states and the weight) through the log-probs, the entropy and the top-k log-probs. ``sequence_parallel``:
    ``rows`` are this TP rank's ``N/TP`` hidden rows (gathered inside). No host sync.

    Example: logits ``[[0, 0, log 2, log 4]]``, ``ids=[3]``, ``entropy=True``, ``top_k=2``, ``argmax=True``
    -> logprobs ``[log 1/2]``, entropy ``[1.2130]``, top-k ``[[log 1/2, log 1/4]]`` ids ``[[3, 2]]``, argmax ``[3]``.

    Raises :class:`~nn_data.errors.PackingError`: a negative ``top_k``, ``chunk_tokens`` below 1, a
    temperature that is not positive, ``ids`` not ``[N]`` / ``[N, J]`` integer, ``keep`` without ``ids``.
    """
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
        temperature, top_k, bool(entropy), bool(argmax))
    return HeadOutputs(
        logprobs=None if ids is None else (lp.squeeze(1) if squeeze else lp),
        entropy=ent if entropy else None,
        topk_logprobs=top_lp if top_k else None,
        topk_indices=top_ids if top_k else None,
        argmax=arg if argmax else None,
        lse=lse,
    )
