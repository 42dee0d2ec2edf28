"""NeMo-RL's distillation and entropy functions of ``nemo_rl.distributed.model_utils`` on nn_data's one-pass head
(:mod:`nn_data.logprobs.outputs`), re-exported by :mod:`nn_data.nemo_rl.model_utils`: docs/logprobs.md, "NeMo-RL's
entropy, distillation and vocabulary-parallel helpers".

Shape legend
    B   rows; S positions of a row on this rank (``S_cp``: this rank's zigzag shard under CP), S_full all of them
    Vt  this tensor-parallel rank's vocabulary slice (``V/TP``), starting at ``vocab_start_index``
    K   token ids per position (a teacher's top-k)
    N   positions this rank holds; c positions per chunk (``chunk_tokens``)

The soft cross entropy (:class:`DistributedCrossEntropy`): ``H(p, q) = -sum_v p_v log q_v`` with ``p = softmax(t)``
(the teacher's logits ``t``, no gradient) and ``q = softmax(z)`` (the student's ``z``): ``H = L_z - sum_v p_v z_v``, ``L_z = logsumexp(z)``. Per TP rank and
chunk: the local log-sum-exps of ``z`` and ``t`` and ``a = sum_v exp(t_v - lse_t) z_v`` (the local teacher
softmax's mean of ``z``), one all-gather of ``[3, N]`` combines them: ``L_t = logsumexp_r lse_t,r``,
``sum_v p_v z_v = sum_r exp(lse_t,r - L_t) a_r``. Backward recomputes each chunk: ``dH/dz = q - p``. Beyond the
inputs and the gradient: ``O(N)`` values and a few ``[c, Vt]`` float32 chunks (the ``[N, Vt]`` float32 softmaxes
are never built).

Worked example (V 2, one position): t ``[0, 0]`` (p uniform), z ``[0, log 3]`` (q ``[1/4, 3/4]``) ->
``H = -(1/2 log 1/4 + 1/2 log 3/4) = 0.8370``; ``dH/dz = [1/4 - 1/2, 3/4 - 1/2]``."""

from __future__ import annotations

from typing import Optional

import torch

from nn_data.logprobs import head_outputs_local
from nn_data.extension import (
    checks as _checks, collectives, combine_topk, local_ids,
)
from nn_data.nemo_rl.logprob_steps import DEFAULT_CHUNK_TOKENS, grad_mode, groups, in_vocab, out_of_vocab_as_nemo_rl
from nn_data.nemo_rl.vocab_parallel import _get_tokens_on_this_cp_rank, _tp, allgather_cp_sharded_tensor


def _rows_chunk(logits: torch.Tensor, chunk_size) -> int:
    """Tokens per chunk of the flattened ``[B*S, Vt]`` logits: ``chunk_size`` positions of each of the ``B``
    rows (NeMo-RL's unit), or :data:`DEFAULT_CHUNK_TOKENS` for None."""
    if chunk_size is None:
        return DEFAULT_CHUNK_TOKENS
    return _checks.positive_int("chunk_size", chunk_size) * (logits.shape[0] if logits.dim() == 3 else 1)


class ChunkedDistributedEntropy:
    """``apply(vocab_parallel_logits [B, S, Vt], chunk_size, tp_group, inference_only=False) -> [B, S]``:
    ``sum_v p_v log p_v`` over the TP-split vocabulary (NeMo-RL's sign: the negative entropy),
    differentiable w.r.t. the logits (``p (log p + H)``), ``chunk_size`` positions per row at a time.

    Example: logits ``[[[0., 0., 0., 0.]]]`` -> ``[[-log 4]]``."""

    @staticmethod
    def apply(vocab_parallel_logits, chunk_size, tp_group, inference_only=False, *, pg_collection=None):
        tp = _tp(tp_group, pg_collection)
        _checks.check_min_dims("vocab_parallel_logits", vocab_parallel_logits, 1, "[B, S, V // TP]")
        chunk = _rows_chunk(vocab_parallel_logits, chunk_size)
        with grad_mode(inference_only):
            flat = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1])  # [B*S, Vt]
            out = head_outputs_local(flat, entropy=True, tp_group=tp.group, tp_size=tp.size, chunk_tokens=chunk)
            return out.entropy.neg().view(vocab_parallel_logits.shape[:-1])  # [B, S]


class ChunkedDistributedGatherLogprob:
    """``apply(vocab_parallel_logits [B, S, Vt], global_indices [B, S, K], vocab_start_index, vocab_end_index, chunk_size,
    tp_group, inference_only=False) -> [B, S, K]``: the log-probs at global ids (NeMo-RL's rule outside ``[0, V)``)."""

    @staticmethod
    def apply(vocab_parallel_logits, global_indices, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False, *, pg_collection=None):
        tp = _tp(tp_group, pg_collection)
        return _logprobs_at(vocab_parallel_logits, global_indices, vocab_start_index, vocab_end_index,
                            _rows_chunk(vocab_parallel_logits, chunk_size), tp, inference_only, entropy=False)[0]


def _logprobs_at(logits, indices, vocab_start_index, vocab_end_index, chunk: int, tp, inference_only: bool, *,
                 entropy: bool):
    """``(log-probs [B, S, K], negative entropy [B, S] or None)`` of ``logits [B, S, Vt]`` at ``indices``, one pass."""
    _checks.check_float_logits("vocab_parallel_logits", logits, "[B, S, V // TP]", 3)
    cols, k = logits.shape[-1], indices.shape[-1]
    _checks.check_vocab_range(vocab_start_index, vocab_end_index, cols, tp.rank)
    if indices.shape[:-1] != logits.shape[:-1] or indices.dtype.is_floating_point:
        raise _checks.PackingError(f"global_indices must be integer [B, S, K] with [B, S] = "
                                   f"{list(logits.shape[:-1])}, got shape {tuple(indices.shape)} and dtype {indices.dtype}")
    with grad_mode(inference_only):
        ids = indices.reshape(-1, k).to(torch.int64)  # [B*S, K]
        out = head_outputs_local(logits.reshape(-1, cols), ids=ids, entropy=entropy, vocab_start=vocab_start_index,
                                 tp_group=tp.group, tp_size=tp.size, chunk_tokens=chunk)
        values = out_of_vocab_as_nemo_rl(out.logprobs, in_vocab(ids, cols * tp.size)).view(indices.shape)
        neg_entropy = out.entropy.neg().view(logits.shape[:-1]) if entropy else None
        return values, neg_entropy


class _SoftCrossEntropy(torch.autograd.Function):
    """``H(softmax(teacher), softmax(student))`` per row of ``[N, Vt]`` (vocab-parallel): ``[N]``."""

    @staticmethod
    def forward(ctx, student, teacher, tp_group, tp_size: int, chunk: int):
        dtype = torch.promote_types(student.dtype, torch.float32)
        n = student.shape[0]
        stats = student.new_empty((3, n), dtype=dtype)  # [3, N] lse_z, lse_t, a
        for i in range(0, n, chunk):  # static: n and chunk are Python ints
            j = i + chunk
            z, t = student[i:j].to(dtype), teacher[i:j].to(dtype)  # [c, Vt] each
            stats[0, i:j] = torch.logsumexp(z, dim=-1)
            lse_t = torch.logsumexp(t, dim=-1)  # [c]
            stats[1, i:j] = lse_t
            stats[2, i:j] = (t.sub(lse_t[:, None]).exp_().mul_(z)).sum(dim=-1)  # [c]
            del z, t, lse_t  # one chunk's temporaries alive at a time
        every = stats[None] if tp_size == 1 else collectives.all_gather_dim0(stats[None], tp_group)  # [TP, 3, N]
        lse_z, lse_t = torch.logsumexp(every[:, 0], dim=0), torch.logsumexp(every[:, 1], dim=0)  # [N] each
        mean = ((every[:, 1] - lse_t).exp() * every[:, 2]).sum(0)  # [N] sum_v p_v z_v
        ctx.save_for_backward(student, teacher, lse_z, lse_t)
        ctx.chunk = chunk
        return lse_z - mean

    @staticmethod
    def backward(ctx, grad):
        student, teacher, lse_z, lse_t = ctx.saved_tensors
        g = grad.to(lse_z.dtype)  # [N]
        out = torch.empty_like(student)  # [N, Vt]
        for i in range(0, student.shape[0], ctx.chunk):
            j = i + ctx.chunk
            q = student[i:j].to(lse_z.dtype).sub(lse_z[i:j, None]).exp_()  # [c, Vt]
            p = teacher[i:j].to(lse_z.dtype).sub(lse_t[i:j, None]).exp_()  # [c, Vt]
            out[i:j] = q.sub_(p).mul_(g[i:j, None])
            del q, p
        return out, None, None, None, None


def soft_cross_entropy_local(student: torch.Tensor, teacher: torch.Tensor, *, tp_group=None, tp_size: int = 1,
                             chunk_tokens: int = 256) -> torch.Tensor:
    """``-sum_v softmax(teacher)_v log softmax(student)_v`` per row of this TP rank's vocabulary slices
    ``student [N, Vt]`` and ``teacher [N, Vt]``: ``[N]`` (float32 or wider), differentiable w.r.t. ``student``
    (``q - p``), ``chunk_tokens`` rows at a time; one ``[3, N]`` all-gather over ``tp_group``. No host sync.

    Example: teacher ``[[0., 0.]]``, student ``[[0., log 3]]`` -> ``[0.8370]``.
    """
    return _SoftCrossEntropy.apply(student, teacher.detach(), tp_group, int(tp_size), int(chunk_tokens))


class DistributedCrossEntropy:
    """``apply(student_logits [*, Vt], target_logits [*, Vt], group, inference_only=False) -> [*]``:
    ``H(softmax(target), softmax(student))`` over the TP-split vocabulary, differentiable w.r.t. the student's
    logits only (``q - p``), chunked (no ``[*, Vt]`` float32 softmax kept).

    Example: target ``[[0., 0.]]``, student ``[[0., log 3]]`` -> ``[0.8370]``."""

    @staticmethod
    def apply(student_logits, target_logits, group, inference_only=False, *, pg_collection=None):
        if student_logits.shape != target_logits.shape:
            raise _checks.PackingError(f"student_logits and target_logits must have the same shape, got "
                                       f"{tuple(student_logits.shape)} and {tuple(target_logits.shape)}")
        _checks.check_min_dims("student_logits", student_logits, 1, "[*, V // TP]")
        tp = _tp(group, pg_collection)
        cols = student_logits.shape[-1]
        with grad_mode(inference_only):
            out = soft_cross_entropy_local(student_logits.reshape(-1, cols), target_logits.reshape(-1, cols),
                                           tp_group=tp.group, tp_size=tp.size, chunk_tokens=DEFAULT_CHUNK_TOKENS)
            return out.view(student_logits.shape[:-1])


@torch.no_grad()
def distributed_vocab_topk(vocab_parallel_logits: torch.Tensor, k: int, tp_group, *, vocab_start_index: int,
                           vocab_end_index: int, chunk_size: Optional[int] = None, pg_collection=None):
    """The global top-``k`` logits ``[B, S, K]`` (``K = min(k, V)``) and their global ids of this rank's ``[B, S, Vt]``
    slice: one all-gather of values and one of ids over ``tp_group``. No gradient.

    Example (TP 1): ``[[[1., 5., 3.]]]``, k 2 -> ``[[[5., 3.]]]``, ``[[[1, 2]]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``k`` below 1, logits not ``[B, S, Vt]`` floating point, a vocabulary
    slice that is not this rank's, a bad ``chunk_size``."""
    tp = _tp(tp_group, pg_collection)
    _checks.check_float_logits("vocab_parallel_logits", vocab_parallel_logits, "[B, S, V // TP]", 3)
    k = _checks.positive_int("k", k)
    rows, seq, cols = vocab_parallel_logits.shape
    _checks.check_vocab_range(vocab_start_index, vocab_end_index, cols, tp.rank)
    chunk = _rows_chunk(vocab_parallel_logits, chunk_size)
    flat = vocab_parallel_logits.reshape(rows * seq, cols)  # [N, Vt]
    dtype, kk = torch.promote_types(flat.dtype, torch.float32), min(k, cols)
    cand = flat.new_empty((flat.shape[0], kk), dtype=dtype)  # [N, k'] this rank's candidates
    cand_ids = torch.empty((flat.shape[0], kk), dtype=torch.int64, device=flat.device)  # [N, k'] their global ids
    for i in range(0, flat.shape[0], chunk):
        top = torch.topk(flat[i : i + chunk].to(dtype), kk, dim=-1)  # [c, k'] each
        cand[i : i + chunk], cand_ids[i : i + chunk] = top.values, top.indices + vocab_start_index
    values, ids = combine_topk(cand, cand_ids, k, tp.group, tp.size)  # [N, K] each
    return values.view(rows, seq, -1), ids.view(rows, seq, -1)


def gather_logits_at_global_indices(vocab_parallel_logits: torch.Tensor, global_indices: torch.Tensor,
                                    tp_group=None, cp_group=None, *, vocab_start_index: int, vocab_end_index: int,
                                    chunk_size: Optional[int] = None, pg_collection=None) -> torch.Tensor:
    """The logits at global ids, ``[B, S_full, K]``, from this rank's ``[B, S_cp, Vt]`` (differentiable w.r.t. its columns).

    Each TP rank reads the ids it holds, one all-gather sums them, and under CP the zigzag shards are gathered back
    (NeMo-RL's ``C``-times gradient); ``chunk_size`` is accepted for NeMo-RL's signature (nothing is chunked).

    Example (TP 1, C 1): logits ``[[[1., 5., 3.]]]``, ids ``[[[2, 0]]]`` -> ``[[[3., 1.]]]``."""
    cp, tp = groups(cp_group, tp_group, pg_collection)
    _checks.check_float_logits("vocab_parallel_logits", vocab_parallel_logits, "[B, S // CP, V // TP]", 3)
    _checks.positive_int("chunk_size", chunk_size, allow_none=True)
    rows, local_len, cols = vocab_parallel_logits.shape
    pad = local_len * cp.size - global_indices.shape[1]
    if global_indices.dim() != 3 or global_indices.shape[0] != rows or pad < 0:
        raise _checks.PackingError(f"global_indices must be [B, S, K] with B={rows} and S <= {local_len * cp.size} "
                                   f"(the logits' {local_len} positions on cp_size={cp.size} ranks), got "
                                   f"{tuple(global_indices.shape)}")
    ids = torch.nn.functional.pad(global_indices, (0, 0, 0, pad)) if pad else global_indices  # [B, S_cp * C, K]
    if cp.size > 1:
        ids = _get_tokens_on_this_cp_rank(ids, cp.rank, cp.size, seq_dim=1)  # [B, S_cp, K]
    k = ids.shape[-1]
    local, owned = local_ids(ids.reshape(-1, k).to(torch.int64), vocab_start_index, cols)  # [N, K] each
    flat = vocab_parallel_logits.reshape(rows * local_len, cols)  # [N, Vt]
    dtype = torch.promote_types(flat.dtype, torch.float32)
    values = torch.where(owned, flat.gather(1, local).to(dtype), 0.0)  # [N, K]
    if tp.size > 1:  # the owner's value on every rank; the gradient of each rank's own columns
        values = values + (collectives.all_gather_dim0(values.detach()[None], tp.group).sum(0) - values.detach())
    out = values.view(rows, local_len, k)
    if cp.size > 1:
        out = allgather_cp_sharded_tensor(out, cp.group, seq_dim=1)  # [B, S_cp * C, K]
    return out[:, : out.shape[1] - pad]  # [B, S_full, K]


def vocab_parallel_gather_columns(logits: torch.Tensor, column_indices: torch.Tensor, *, tp_group=None,
                                  pg_collection=None) -> torch.Tensor:
    """The logits ``[B, T, K]`` (float32 or wider) at the global columns ``column_indices [K]`` shared by every
    position, from this rank's ``[B, T, Vt]``; differentiable (each rank's own columns). Example (TP 1):
    ``[[[1., 5., 3.]]]``, columns ``[2, 0]`` -> ``[[[3., 1.]]]``."""
    tp = _tp(tp_group, pg_collection)
    logits = logits.to_local() if type(logits).__name__ == "DTensor" else logits
    if tp.size == 1:
        return logits[..., column_indices].to(torch.promote_types(logits.dtype, torch.float32))
    rows, seq, cols = logits.shape
    ids = column_indices.view(1, 1, -1).expand(rows, seq, -1)  # [B, T, K]
    return gather_logits_at_global_indices(logits, ids, tp.group, vocab_start_index=tp.rank * cols,
                                           vocab_end_index=(tp.rank + 1) * cols)


def get_distillation_topk_logprobs_from_logits(student_logits: torch.Tensor, teacher_topk_logits: torch.Tensor,
                                               teacher_topk_indices: torch.Tensor, zero_outside_topk: bool,
                                               calculate_entropy: bool, vocab_parallel_rank: Optional[int] = None,
                                               vocab_parallel_group=None, context_parallel_group=None, *,
                                               pg_collection=None):
    """``(student [B, S-1, K], teacher [B, S-1, K], H_all [B, S-1] or None)``: the student's log-probs at the teacher's
    top-``K`` ids and the teacher's log-softmax over its ``K`` logits, next-token aligned.

    ``zero_outside_topk``: the student's log-probs over the whole vocabulary (with ``calculate_entropy``, ``H_all = sum p
    log p`` from the same read); else its log-softmax at the ``K`` ids. ``student_logits [B, S_cp, Vt]`` are this
    rank's vocabulary slice and zigzag shard, the teacher's tensors ``[B, S_full, K]``.

    Raises :class:`~nn_data.errors.PackingError`: ``K`` below 1, DTensor logits, a ``vocab_parallel_group`` without
    ``vocab_parallel_rank``, shapes as :func:`gather_logits_at_global_indices`."""
    k = teacher_topk_indices.shape[-1]
    if k <= 0:
        raise _checks.PackingError(f"topk must be positive, got {k}: teacher_topk_indices has shape "
                                   f"{tuple(teacher_topk_indices.shape)}")
    if type(student_logits).__name__ == "DTensor":
        raise _checks.PackingError("student_logits is a DTensor: nn_data.nemo_rl.model_utils covers the Megatron "
                                   "(vocab-parallel) and plain-tensor paths")
    cp, tp = groups(context_parallel_group, vocab_parallel_group, pg_collection)
    if vocab_parallel_group is not None and vocab_parallel_rank is None:
        raise _checks.PackingError("vocab_parallel_rank must be provided when vocab_parallel_group is provided")
    rank = tp.rank if vocab_parallel_rank is None else vocab_parallel_rank
    cols = student_logits.shape[-1]
    start, end = rank * cols, (rank + 1) * cols
    indices = teacher_topk_indices.to(student_logits.device)
    neg_entropy = None
    if zero_outside_topk or calculate_entropy:
        pad = student_logits.shape[1] * cp.size - indices.shape[1]
        local = torch.nn.functional.pad(indices, (0, 0, 0, pad)) if pad > 0 else indices
        local = _get_tokens_on_this_cp_rank(local, cp.rank, cp.size, seq_dim=1)  # [B, S_cp, K]
        chunk = max(1, min(student_logits.shape[1], 1024)) * student_logits.shape[0]  # NeMo-RL's 1024 positions
        student, neg_entropy = _logprobs_at(student_logits, local, start, end, chunk, tp, False,
                                            entropy=calculate_entropy)
        if cp.size > 1:
            student = allgather_cp_sharded_tensor(student, cp.group, seq_dim=1)
            if neg_entropy is not None:
                neg_entropy = allgather_cp_sharded_tensor(neg_entropy, cp.group, seq_dim=1)
        student = student[:, : indices.shape[1]]  # [B, S_full, K]
        neg_entropy = None if neg_entropy is None else neg_entropy[:, : indices.shape[1]]
    if not zero_outside_topk:
        at = gather_logits_at_global_indices(student_logits, indices, tp.group, cp.group, vocab_start_index=start,
                                             vocab_end_index=end)  # [B, S_full, K]
        student = torch.log_softmax(at, dim=-1)
    teacher = torch.log_softmax(teacher_topk_logits.to(student.device, dtype=student.dtype), dim=-1)
    return student[:, :-1], teacher[:, :-1], None if neg_entropy is None else neg_entropy[:, :-1]
