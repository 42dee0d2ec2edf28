"""Cases for NeMo-RL's entropy, distillation and vocabulary-parallel helpers in ``nn_data.nemo_rl.model_utils``,
run on every spawned rank (tests/multiprocess/test_model_utils_multiprocess.py: CP 2, TP 2 x CP 2) and in one
process (tests/ops/test_model_utils.py: C 1, no TP; the groups are then None).

Each case builds the same float64 full logits ``[B, S, V]`` on every rank from a fixed seed, gives the function
this rank's CP zigzag shard (``_get_tokens_on_this_cp_rank``) and vocabulary columns, and compares with an oracle
written from NeMo-RL's documented semantics on the full logits (``log_softmax`` over ``V``): values on every
position (ids exactly), and the gradient of the local logits against this rank's part of the single-process
gradient (``C`` times it where NeMo-RL gathers over CP). Tolerance 1e-10.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nn_data.errors import PackingError
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.nemo_rl import model_utils as mu

VOCAB, ROWS, SEQ, K = 24, 2, 8, 4  # SEQ: a multiple of 2C for C <= 4
TOL = dict(rtol=0, atol=1e-10)


def _groups():
    return context_parallel_info(), tensor_parallel_info()


def _full(seed: int, rows: int = ROWS, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(rows, seq, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _part(full: torch.Tensor, cp, tp) -> torch.Tensor:
    """This rank's zigzag shard (dim 1) and vocabulary columns of ``full [B, S, V]``, a fresh leaf."""
    cols = full.shape[-1] // tp.size
    shard = mu._get_tokens_on_this_cp_rank(full.detach(), cp.rank, cp.size, seq_dim=1)
    return shard[..., tp.rank * cols : (tp.rank + 1) * cols].clone().requires_grad_()


def _span(tp, cols: int) -> dict:
    return dict(vocab_start_index=tp.rank * cols, vocab_end_index=(tp.rank + 1) * cols)


def case_entropy_and_gather_logprob():
    """``ChunkedDistributedEntropy`` (``sum p log p``) and ``ChunkedDistributedGatherLogprob`` (an id outside
    ``[0, V)`` included: value 0, gradient ``-softmax``) on this rank's positions, chunked and not."""
    cp, tp = _groups()
    full = _full(1)
    cols = VOCAB // tp.size
    ids = torch.randint(0, VOCAB, (ROWS, SEQ, K), generator=torch.Generator().manual_seed(2))
    ids[0, 1, 2], ids[1, 5, 0] = VOCAB + 3, -1
    w_h = torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w_k = torch.randn(ROWS, SEQ, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    z = full.clone().requires_grad_()
    lp = torch.log_softmax(z, dim=-1)
    neg_h = (lp.exp() * lp).sum(-1)  # [B, S] NeMo-RL's sign
    lse = torch.logsumexp(z, dim=-1, keepdim=True).expand(-1, -1, K)
    inside = (ids >= 0) & (ids < VOCAB)
    at = torch.where(inside, lp.gather(2, ids.clamp(0, VOCAB - 1)), -(lse - lse.detach()))  # 0, gradient -softmax
    shard = lambda t: mu._get_tokens_on_this_cp_rank(t, cp.rank, cp.size, seq_dim=1)  # noqa: E731
    ((shard(neg_h) * shard(w_h)).sum() + (shard(at) * shard(w_k)).sum()).backward()
    want_grad = shard(z.grad)[..., tp.rank * cols : (tp.rank + 1) * cols]
    for chunk in (1, 3, SEQ):
        local = _part(full, cp, tp)
        h = mu.ChunkedDistributedEntropy.apply(local, chunk, tp.group)
        g = mu.ChunkedDistributedGatherLogprob.apply(local, shard(ids), tp.rank * cols, (tp.rank + 1) * cols, chunk,
                                                     tp.group)
        ((h * shard(w_h)).sum() + (g * shard(w_k)).sum()).backward()
        torch.testing.assert_close(h, shard(neg_h).detach(), **TOL)
        torch.testing.assert_close(g, shard(at).detach(), **TOL)
        torch.testing.assert_close(local.grad, want_grad, **TOL)
        with torch.no_grad():
            assert not mu.ChunkedDistributedEntropy.apply(local, chunk, tp.group, True).requires_grad
    return (cp.rank, tp.rank)


def case_cross_entropy_and_topk():
    """``DistributedCrossEntropy`` (value and the student's gradient ``q - p``), ``distributed_vocab_topk``
    (the global top-k logits and ids), ``vocab_parallel_argmax``, ``vocab_parallel_gather_columns``."""
    cp, tp = _groups()
    student, teacher = _full(5), _full(6)
    cols = VOCAB // tp.size
    w = torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    z = student.clone().requires_grad_()
    ce = -(torch.softmax(teacher, -1) * torch.log_softmax(z, -1)).sum(-1)
    shard = lambda t: mu._get_tokens_on_this_cp_rank(t, cp.rank, cp.size, seq_dim=1)  # noqa: E731
    (shard(ce) * shard(w)).sum().backward()
    local, local_t = _part(student, cp, tp), _part(teacher, cp, tp).detach()
    out = mu.DistributedCrossEntropy.apply(local, local_t, tp.group)
    (out * shard(w)).sum().backward()
    torch.testing.assert_close(out, shard(ce).detach(), **TOL)
    torch.testing.assert_close(local.grad, shard(z.grad)[..., tp.rank * cols : (tp.rank + 1) * cols], **TOL)
    top = torch.topk(shard(student), K, dim=-1)
    for chunk in (None, 3):
        vals, ids = mu.distributed_vocab_topk(local.detach(), K, tp.group, chunk_size=chunk, **_span(tp, cols))
        torch.testing.assert_close(vals, top.values, **TOL)
        assert torch.equal(ids, top.indices)
    whole = mu.distributed_vocab_topk(local.detach(), VOCAB + 5, tp.group, **_span(tp, cols))[1]
    assert whole.shape[-1] == VOCAB and torch.equal(whole, torch.topk(shard(student), VOCAB, dim=-1).indices)
    assert torch.equal(mu.vocab_parallel_argmax(local.detach(), tp_group=tp.group), shard(student).argmax(-1))
    columns = torch.tensor([3, VOCAB - 1, 0])
    picked = mu.vocab_parallel_gather_columns(local, columns, tp_group=tp.group)
    torch.testing.assert_close(picked, shard(student)[..., columns], **TOL)
    return (cp.rank, tp.rank)


def case_gather_logits_and_distillation():
    """``gather_logits_at_global_indices`` (CP-gathered ``[B, S_full, K]``, ``C``-times gradient; a row length
    shorter than the shards' padded one) and ``get_distillation_topk_logprobs_from_logits`` in both modes, the
    entropy included, against NeMo-RL's semantics on the full logits."""
    cp, tp = _groups()
    full = _full(8)
    cols = VOCAB // tp.size
    s_full = SEQ - 1  # padded to SEQ inside
    ids = torch.randint(0, VOCAB, (ROWS, s_full, K), generator=torch.Generator().manual_seed(9))
    teacher = torch.randn(ROWS, s_full, K, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    w = torch.randn(ROWS, s_full, K, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    w_h = torch.randn(ROWS, s_full - 1, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    shard = lambda t: mu._get_tokens_on_this_cp_rank(t, cp.rank, cp.size, seq_dim=1)  # noqa: E731
    # gather_logits_at_global_indices
    z = full.clone().requires_grad_()
    ref = z[:, :s_full].gather(2, ids)
    (ref * w).sum().backward()
    local = _part(full, cp, tp)
    got = mu.gather_logits_at_global_indices(local, ids, tp.group, cp.group, **_span(tp, cols))
    (got * w).sum().backward()
    torch.testing.assert_close(got, ref.detach(), **TOL)
    torch.testing.assert_close(local.grad, cp.size * shard(z.grad)[..., tp.rank * cols : (tp.rank + 1) * cols], **TOL)
    # the distillation helper, both modes
    for zero_outside in (True, False):
        z = full.clone().requires_grad_()
        lp = torch.log_softmax(z[:, :s_full], -1)
        ref_s = lp.gather(2, ids) if zero_outside else torch.log_softmax(z[:, :s_full].gather(2, ids), -1)
        ref_h = (lp.exp() * lp).sum(-1)
        ((ref_s[:, :-1] * w[:, :-1]).sum() + (ref_h[:, :-1] * w_h).sum()).backward()
        local = _part(full, cp, tp)
        s, t, h = mu.get_distillation_topk_logprobs_from_logits(local, teacher, ids, zero_outside, True, tp.rank,
                                                               tp.group, cp.group)
        ((s * w[:, :-1]).sum() + (h * w_h).sum()).backward()
        what = f"zero_outside_topk={zero_outside}"
        torch.testing.assert_close(s, ref_s[:, :-1].detach(), **TOL, msg=lambda m: f"{what} student: {m}")
        torch.testing.assert_close(t, torch.log_softmax(teacher, -1)[:, :-1], **TOL)
        torch.testing.assert_close(h, ref_h[:, :-1].detach(), **TOL, msg=lambda m: f"{what} H_all: {m}")
        want = cp.size * shard(z.grad)[..., tp.rank * cols : (tp.rank + 1) * cols]
        torch.testing.assert_close(local.grad, want, **TOL, msg=lambda m: f"{what} d logits: {m}")
        s2, _, h2 = mu.get_distillation_topk_logprobs_from_logits(local.detach(), teacher, ids, zero_outside, False,
                                                                 tp.rank, tp.group, cp.group)
        assert h2 is None and torch.allclose(s2, s.detach(), rtol=0, atol=1e-12)
    return (cp.rank, tp.rank)


def case_vocab_parallel_helpers():
    """``vocab_parallel_log_softmax`` (this rank's columns; the gradient of a loss summed over the ranks'
    shards), ``vocab_parallel_full_log_softmax`` (the whole vocabulary, a replicated loss), ``cp_shift_next``
    and ``cp_load_balanced_to_contiguous``, ``group_all_reduce_sum(_with_grad)``, ``all_to_all_vp2sq`` /
    ``sq2vp``, ``AllGatherCPTensor``."""
    cp, tp = _groups()
    full = _full(13)
    cols = VOCAB // tp.size
    w = torch.randn(ROWS, SEQ, VOCAB, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    z = full.clone().requires_grad_()
    (torch.log_softmax(z / 0.7, -1) * w).sum().backward()
    mine = slice(tp.rank * cols, (tp.rank + 1) * cols)
    local = full[..., mine].clone().requires_grad_()
    shard_lp = mu.vocab_parallel_log_softmax(local, 0.7, tp_group=tp.group)
    (shard_lp * w[..., mine]).sum().backward()  # summed over the TP ranks: the whole loss
    torch.testing.assert_close(shard_lp, torch.log_softmax(full / 0.7, -1)[..., mine], **TOL)
    torch.testing.assert_close(local.grad, z.grad[..., mine], **TOL)
    local = full[..., mine].clone().requires_grad_()
    whole = mu.vocab_parallel_full_log_softmax(local, 0.7, tp_group=tp.group)
    (whole * w).sum().backward()  # the same loss on every rank
    torch.testing.assert_close(whole, torch.log_softmax(full / 0.7, -1), **TOL)
    torch.testing.assert_close(local.grad, z.grad[..., mine], **TOL)
    # contiguous CP sharding: rank r holds positions [r*L, (r+1)*L)
    x = torch.arange(ROWS * SEQ, dtype=torch.float64).view(ROWS, SEQ)
    width = SEQ // cp.size
    window = x[:, cp.rank * width : (cp.rank + 1) * width]
    shifted = torch.cat([x[:, 1:], torch.full((ROWS, 1), -7.0)], 1)[:, cp.rank * width : (cp.rank + 1) * width]
    assert torch.equal(mu.cp_shift_next(window, cp.group, fill=-7.0), shifted)
    zig = mu._get_tokens_on_this_cp_rank(x, cp.rank, cp.size, seq_dim=1)
    assert torch.equal(mu.cp_load_balanced_to_contiguous(zig, cp_group=cp.group), window)
    assert torch.equal(mu.AllGatherCPTensor.apply(zig, cp.group, 1), x)
    v = torch.tensor([float(cp.rank + 1)], dtype=torch.float64, requires_grad=True)
    total = mu.group_all_reduce_sum_with_grad(v, cp.group)
    (3 * total).sum().backward()
    assert total.item() == cp.size * (cp.size + 1) / 2 and v.grad.item() == 3.0
    assert not mu.group_all_reduce_sum(v, cp.group).requires_grad
    flat = full.reshape(ROWS * SEQ, VOCAB)  # [BS, V]
    per = ROWS * SEQ // tp.size
    seq_split = mu.all_to_all_vp2sq(flat[:, mine].contiguous(), tp.group)
    assert torch.equal(seq_split, flat[tp.rank * per : (tp.rank + 1) * per])
    assert torch.equal(mu.all_to_all_sq2vp(seq_split, tp.group), flat[:, mine])
    return (cp.rank, tp.rank)


def case_errors():
    """Bad arguments name the argument and the valid values."""
    cp, tp = _groups()
    local = _part(_full(15), cp, tp).detach()
    cols = local.shape[-1]
    checks = [
        (lambda: mu.distributed_vocab_topk(local, 0, tp.group, **_span(tp, cols)), "k=0 is invalid; expected an int >= 1"),
        (lambda: mu.distributed_vocab_topk(local, 2, tp.group, vocab_start_index=1, vocab_end_index=cols + 1),
         "vocab_start_index=1"),
        (lambda: mu.DistributedCrossEntropy.apply(local, local[:, :1], tp.group), "must have the same shape"),
        (lambda: mu.get_distillation_topk_logprobs_from_logits(local, local[..., :0], torch.zeros(ROWS, SEQ, 0,
                                                               dtype=torch.int64), True, False), "topk must be positive"),
        (lambda: mu.ChunkedDistributedGatherLogprob.apply(local, torch.zeros(ROWS, 1, 2, dtype=torch.int64),
                                                          tp.rank * cols, (tp.rank + 1) * cols, 2, tp.group),
         "global_indices must be integer [B, S, K]"),
        (lambda: mu.gather_logits_at_global_indices(local, torch.zeros(ROWS, SEQ + 1, 2, dtype=torch.int64),
                                                    tp.group, cp.group, **_span(tp, cols)),
         "global_indices must be [B, S, K]"),
        (lambda: mu.all_to_all_vp2sq(local, tp.group), "needs 2D vocab_parallel_logits"),
        (lambda: mu.ChunkedDistributedEntropy.apply(local, 0, tp.group), "chunk_size"),
    ]
    if tp.size > 1:
        checks.append((lambda: mu.all_to_all_vp2sq(local.reshape(-1, cols)[:3], tp.group), "BS=3 must be divisible"))
        checks.append((lambda: mu.all_to_all_sq2vp(local.reshape(-1, cols)[:, :3], tp.group),
                       "Vocabulary size 3 must be divisible"))
    for call, text in checks:
        try:
            call()
        except PackingError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"no error for: {text}")
    return (cp.rank, tp.rank)


CASES = {
    "entropy_and_gather_logprob": case_entropy_and_gather_logprob,
    "cross_entropy_and_topk": case_cross_entropy_and_topk,
    "gather_logits_and_distillation": case_gather_logits_and_distillation,
    "vocab_parallel_helpers": case_vocab_parallel_helpers,
    "errors": case_errors,
}
