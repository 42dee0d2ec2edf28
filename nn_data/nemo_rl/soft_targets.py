"""Cross entropy against a soft target distribution over the vocabulary-parallel logits, chunked.

Shape legend
    N   positions this rank holds
    Vt  this tensor-parallel rank's vocabulary slice (``V/TP``)
    c   positions per chunk (``chunk_tokens``)

``H(p, q) = -sum_v p_v log q_v`` with ``p = softmax(t)`` (the teacher's logits ``t``, no gradient) and
``q = softmax(z)`` (the student's ``z``): ``H = L_z - sum_v p_v z_v``, ``L_z = logsumexp(z)``. Per TP rank and
chunk: the local log-sum-exps of ``z`` and ``t`` and ``a = sum_v exp(t_v - lse_t) z_v`` (the local teacher
softmax's mean of ``z``), one all-gather of ``[3, N]`` combines them: ``L_t = logsumexp_r lse_t,r``,
``sum_v p_v z_v = sum_r exp(lse_t,r - L_t) a_r``. Backward recomputes each chunk: ``dH/dz = q - p``. Beyond the
inputs and the gradient: ``O(N)`` values and a few ``[c, Vt]`` float32 chunks (the ``[N, Vt]`` float32 softmaxes
are never built).

Worked example (V 2, one position): t ``[0, 0]`` (p uniform), z ``[0, log 3]`` (q ``[1/4, 3/4]``) ->
``H = -(1/2 log 1/4 + 1/2 log 3/4) = 0.8370``; ``dH/dz = [1/4 - 1/2, 3/4 - 1/2]``.
"""

from __future__ import annotations

import torch

from nn_data.extension import collectives


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
