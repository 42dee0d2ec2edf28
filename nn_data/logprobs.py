"""Per-token log-probs from CP-local packed logits, gathered as ``[1, T/C]`` values and unpacked to ``[B, S]``.

Shape legend
    B   sequences; ``cu_seqlens`` and ``cu_seqlens_padded`` have B+1 entries
    S   row length of the output (``seq_len``: a Python int, or a symbolic size under compile)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    V   vocabulary; ``Vt = V / TP`` columns on a tensor-parallel rank (vocab-parallel logits)
    c   tokens per chunk of the log-sum-exp (``chunk_tokens``)

Memory: the logits are read in chunks of ``c`` tokens, so beyond the logits (and,
in backward, their gradient) the op holds ``O(T)`` values plus one ``[c, Vt]``
float32 chunk. Only ``[1, T/C]`` log-probs cross the CP group (one all-gather); the
gathered ``[1, T, V]`` logits and the unpacked ``[B, S, V]`` never exist.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from nn_data import _checks
from nn_data.cp_comm import GatherFromContextParallel, all_gather_dim0
from nn_data.groups import given_group_info
from nn_data.sampling import row_thresholds, vocab_parallel_thresholds
from nn_data.layout import Boundaries, PackLayout, layout_from_boundaries, op_layout
from nn_data.layout.internal import (
    ZigzagLocal, boundary_args, packed_segments, reads_host, target_ids, target_ids_device, target_ids_host
)
from nn_data.targets import next_token_at


class _TargetLogProb(torch.autograd.Function):
    """``log softmax(logits[i])[target[i]]`` where ``keep[i]``, else 0: ``[N, Vt] -> [N]`` (float32 or wider).

    Vocab-parallel (``tp_size > 1``): each TP rank holds columns ``[vocab_start,
    vocab_start + Vt)``; the per-rank log-sum-exp and the target's logit (0 on ranks that
    do not own it) are all-gathered as ``[2, N]`` and combined. Backward needs no
    communication: ``d/dz_v = [v = target] - softmax_v``, with the global log-sum-exp saved.

    ``sampling`` (a :class:`~nn_data.sampling.SamplingFilter`, or None): the softmax runs over the
    logits the filter keeps (``>= tau``, one threshold per row, ``nn_data.sampling``); a target
    it drops gets ``-inf`` and no one-hot term in the gradient, filtered logits get no gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, keep, vocab_start: int, tp_group, tp_size: int, chunk: int, sampling=None):
        n, cols = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        local, owned = target_columns(target, vocab_start, cols)
        lse = logits.new_empty(n, dtype=dtype)
        picked = logits.new_empty(n, dtype=dtype)
        tau = logits.new_empty(n if sampling is not None else 0, dtype=dtype)  # [N] thresholds when filtering
        for i in range(0, n, chunk):  # static: n and chunk are Python ints
            j = i + chunk
            lse[i:j], picked[i:j], tau_c = chunk_lse_and_target(logits[i:j], dtype, local[i:j], sampling, tp_group,
                                                                tp_size)
            if tau_c is not None:
                tau[i:j] = tau_c
        lse, picked, owned = combine_vocab_parallel(lse, picked, owned, tp_group, tp_size, sampling is not None)
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
    ``sampling``: an optional :class:`~nn_data.sampling.SamplingFilter` (top-k / top-p); the
    log-softmax then runs over the kept logits only (under TP, one all-to-all and one all-gather
    per chunk find each row's threshold).
    """
    return _TargetLogProb.apply(logits, target, keep, vocab_start, tp_group, tp_size, chunk_tokens, sampling)


class TokenLogProbs(nn.Module):
    """Per-token log-probs ``[B, S]`` from CP-local packed logits ``[1, T/C, Vt]``, NeMo-RL's layout.

    ``forward(logits [1, T/C, Vt], packed_ids [1, T] int, cu_seqlens [B+1] int,
    cu_seqlens_padded [B+1] int, places=None, *, seq_len=None, layout=None) -> [B, S]`` (float32; float64 for
    float64 logits). ``S`` is ``seq_len`` when given, else the configured one: a stream whose row
    length varies passes it per call; inside a compiled region pass ``x.shape[1]`` of a ``[B, S]``
    tensor marked with :func:`nn_data.rows.with_dynamic_row_length`, so one graph serves every
    ``S`` (0 and 1 included; a changed int attribute would recompile). Given the pack's ``layout``
    (instead of, or with, the boundaries) nothing is read on the host; without it the boundaries are
    read once eagerly (the validation, every target id checked in the same read).
    ``logits`` is this rank's zigzag shard (vocab-parallel over ``tp_group``: rank ``k`` holds
    columns ``[k*Vt, (k+1)*Vt)``), ``packed_ids`` the full packed ids. Each local position's
    next token *within its sequence* is scored on the shard in chunks of ``chunk_tokens``, the
    ``[1, T/C]`` values are all-gathered over ``cp_group`` and unpacked. ``None`` groups mean
    not split; ``pg_collection`` (megatron-core's ``ProcessGroupCollection``) stands for the groups
    not given (its ``cp`` and ``tp``). Result: ``out[b, s] = log p(x[b, s] | x[b, :s])`` for ``1 <= s < L[b]``, else 0
    (``docs/design.md``, "Differences from NeMo-RL"). Gradients reach the local logits; every CP
    rank is assumed to compute the same loss (``grad_mode="own"``).

    Example (C 1, V 3, uniform logits): cu_seqlens ``[0, 3]``, cu_seqlens_padded ``[0, 4]``,
    seq_len 4 -> ``[[0, log(1/3), log(1/3), 0]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``seq_len`` below 0, ``chunk_tokens`` below 1, a
    group this process is not in (``__init__``); no ``seq_len`` at all, ``logits`` not ``[1, T/C, Vt]`` floating point,
    ``packed_ids`` not ``[1, T]``, ``T`` not a multiple of ``2C``, bad boundary tensors (call); bad
    boundaries, a length over ``seq_len`` or its segment, a target id outside ``[0, V)`` (validation).
    """

    def __init__(
        self,
        seq_len: Optional[int] = None,
        *,
        cp_group: Optional["dist.ProcessGroup"] = None,
        tp_group: Optional["dist.ProcessGroup"] = None,
        chunk_tokens: int = 256,
        validate: bool = True,
        host_reads: bool = True,
        pg_collection=None,
    ):
        super().__init__()
        self.seq_len = _checks.row_length("seq_len", seq_len, allow_none=True)
        self.host_reads = bool(host_reads)
        self.chunk_tokens = _checks.positive_int("chunk_tokens", chunk_tokens)
        self.cp_rank, self.cp_size, cp_group = given_group_info(cp_group, pg_collection=pg_collection, field="cp")
        self.tp_rank, self.tp_size, tp_group = given_group_info(tp_group, pg_collection=pg_collection, field="tp")
        self.tp_group, self.validate = tp_group, bool(validate)
        self.gather = GatherFromContextParallel(cp_group, validate=False) if self.cp_size > 1 else None

    def extra_repr(self) -> str:
        return (f"seq_len={self.seq_len}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, "
                f"tp_size={self.tp_size}, tp_rank={self.tp_rank}, chunk_tokens={self.chunk_tokens}")

    def forward(
        self,
        logits: torch.Tensor,
        packed_ids: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None,
        cu_seqlens_padded: Optional[torch.Tensor] = None,
        places: Optional[ZigzagLocal] = None,
        *,
        seq_len=None,
        layout: Optional[PackLayout] = None,
    ) -> torch.Tensor:
        seq_len = resolve_seq_len("TokenLogProbs", seq_len, self.seq_len)
        _checks.check_packed("logits", logits)
        if logits.dim() != 3 or not logits.dtype.is_floating_point:
            raise _checks.PackingError(f"logits must be floating point [1, T/C, V], got shape "
                                       f"{tuple(logits.shape)} and dtype {logits.dtype}")
        local_total, cols = logits.shape[1], logits.shape[2]
        total = check_full_ids("logits", logits, packed_ids, local_total, self.cp_size)
        layout = logprob_layout("TokenLogProbs", packed_ids, total, cols * self.tp_size, cu_seqlens, cu_seqlens_padded,
                               seq_len, layout, cp_size=self.cp_size, validate=self.validate, host_reads=self.host_reads)
        target, keep = targets_on_rank(layout, packed_ids, total, places, self.cp_size, self.cp_rank)  # [T/C] each
        local = token_logprobs_local(
            logits.squeeze(0), target, keep, vocab_start=self.tp_rank * cols, tp_group=self.tp_group,
            tp_size=self.tp_size, chunk_tokens=self.chunk_tokens,
        )  # [T/C]
        return rows_from_local(local, layout, self.gather, total, seq_len)  # [B, S]


def resolve_seq_len(op: str, seq_len, configured: Optional[int]):
    """The row length ``S`` of a call: ``seq_len=`` (an int is checked; a symbolic size passes), else the
    configured one, else :class:`~nn_data.errors.PackingError`."""
    if seq_len is None:
        if configured is None:
            raise _checks.PackingError(f"{op} needs the row length S: pass seq_len= to forward (or to the constructor)")
        return configured
    if isinstance(seq_len, int):
        _checks.row_length("seq_len", seq_len)
    return seq_len


def check_full_ids(name: str, local: torch.Tensor, packed_ids: torch.Tensor, local_total: int, cp_size: int) -> int:
    """``T`` (``local_total * C``) after checking that ``packed_ids`` is the full packed ids ``[1, T]`` on
    ``local``'s device (``name`` holds this rank's ``T/C`` positions)."""
    _checks.check_packed_ids("packed_ids", packed_ids)
    total = local_total * cp_size
    if packed_ids.shape[1] != total:
        raise _checks.PackingError(
            f"packed_ids has shape {tuple(packed_ids.shape)} but {name} {tuple(local.shape)} on "
            f"cp_size={cp_size} ranks cover T={total} positions; pass the full packed ids [1, {total}]"
        )
    _checks.check_same_device(**{name: local, "packed_ids": packed_ids})
    return total


def targets_on_rank(layout: PackLayout, packed_ids: torch.Tensor, total: int, places, cp_size: int, cp_rank: int):
    """``(target [T/C], keep [T/C])``: each of this rank's positions' next token within its sequence and
    whether it has one (:func:`nn_data.targets.next_token_at` on the layout's real lengths)."""
    segments = packed_segments(layout.cu_seqlens, layout.cu_seqlens_padded, total)
    if places is None:
        places = layout.local_places(cp_size, cp_rank)
    return next_token_at(packed_ids[0], segments, places, total)  # [T/C] each


def rows_from_local(local: torch.Tensor, layout: PackLayout, gather, total: int, seq_len) -> torch.Tensor:
    """This rank's ``[T/C]`` log-probs -> ``[B, S]`` rows: one all-gather over the CP group (``gather``,
    None without CP), then the unpack shifted by one."""
    packed = local if gather is None else gather(local[None], layout=layout).squeeze(0)  # [T]
    if total == 0:  # nothing was packed (every row empty, no pad_full_seq_to): all zeros, still in the graph
        return packed.sum().expand(layout.rows, seq_len).clone()
    # out[b, s] = packed[cu_seqlens_padded[b] + s - 1] for 1 <= s < L[b], else 0: the log-prob of token s
    # is scored at position s - 1. Example: [a0, a1, a2, pad], L 3, S 4 -> [0, lp(a0->a1), lp(a1->a2), 0].
    return layout.unpack(packed[None], seq_len, 0.0, shift=1)  # [B, S]


def logprob_layout(op: str, packed_ids, total: int, vocab: int, cu_seqlens, cu_seqlens_padded, seq_len, layout, *,
                  cp_size: int, validate: bool, host_reads: bool) -> PackLayout:
    """The layout of a log-prob call and its validation: the one read of the boundaries, with "every
    target id is in the vocabulary" folded into it (eager, no layout given), or device asserts."""
    if layout is None:
        if cu_seqlens is None or cu_seqlens_padded is None:
            raise _checks.PackingError(f"{op} needs cu_seqlens and cu_seqlens_padded, or layout=")
        boundary_args("packed_ids", packed_ids, total, cu_seqlens_padded, cp_size, cu_seqlens)
    elif layout.cu_seqlens is None:
        raise _checks.PackingError(f"{op} needs a layout with cu_seqlens (PackResult.layout)")
    bad_ids = None
    if validate:
        bounds, lengths = packed_segments(layout.cu_seqlens if layout is not None else cu_seqlens,
                                          layout.cu_seqlens_padded if layout is not None else cu_seqlens_padded,
                                          total)
        bad_ids = target_ids(packed_ids[0], bounds, lengths, total, vocab)  # [T]
    if layout is not None or not reads_host(validate, host_reads):
        layout = op_layout(op, "packed_ids", packed_ids, total, cp_size, cu_seqlens_padded, layout,
                           validate=validate, host_reads=host_reads, cu_seqlens=cu_seqlens, seq_len=seq_len)
        if bad_ids is not None:
            target_ids_device(op, bad_ids, vocab)
        return layout
    ids_ok = (~bad_ids.any(), lambda: target_ids_host(bad_ids, packed_ids[0], vocab))
    bounds = Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens, also_check=ids_ok)
    return layout_from_boundaries(bounds, op=op, seq_len=seq_len, cp_size=cp_size)
