"""The cases every spawned rank runs (tests/support/cp_harness.py) for
tests/multiprocess/test_shared_prefix_multiprocess.py: a shared-prefix microbatch's rollout log-probs
under context and tensor parallelism.

Every rank builds the same float64 data from fixed seeds (the full packed logits ``[1, T, V]``, or hidden
states ``[1, T, H]`` and the output weight ``[V, H]``), feeds the op its part (the zigzag CP shard of the
slot layout, this TP rank's vocabulary columns or weight rows) and compares with each rollout run alone
through a plain log_softmax (tests/support/shared_prefix_reference.py): values on every rank; the local
logits' and hidden states' gradients against their part of the single-process ones; the weight's,
summed over the CP group, against its rows. With sequence parallelism the hidden states are further
split along tokens over the TP group (each TP rank's contiguous rows of the CP shard). Tolerance 1e-10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.logprobs.from_tree import TreeLogProbs, TreeLogProbsFromHidden
from tests.support.shared_prefix_reference import V, alone, alone_outputs, logprob_case

TOL = dict(rtol=0, atol=1e-10)
H = 6
# (groups, prefix lengths, lengths, S): groups of 3 and 1 (an empty response), no prompt, all prompt
BATCHES = [([0, 0, 0, 1], [5, 5, 5, 2], [9, 5, 12, 7], 12),
           ([3, 3, 8, 8, 8], [0, 0, 4, 4, 4], [6, 1, 4, 11, 8], 12)]


def _case(i: int, cp_size: int):
    groups, prefix, lengths, seq_len = BATCHES[i]
    sp, ids, token, weights, gen = logprob_case(groups, prefix, lengths, seq_len, m=2 * cp_size, seed=i)
    return sp, ids, token, weights, gen, (groups, prefix, lengths, seq_len)


def _columns(t: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """This TP rank's vocabulary slice of ``t`` along ``dim``."""
    return t.chunk(tp.size, dim=dim)[tp.rank]


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return grad
    out = grad.clone()
    dist.all_reduce(out, group=group)
    return out


def case_logits():
    cp, tp = context_parallel_info(), tensor_parallel_info()
    for i in range(len(BATCHES)):
        sp, ids, token, weights, gen, (groups, prefix, lengths, seq_len) = _case(i, cp.size)
        full = torch.randn(1, sp.total, V, generator=gen, dtype=torch.float64, requires_grad=True)
        want = alone(lambda k: full[0, k], groups, prefix, lengths, ids, token, seq_len)
        (want * weights).sum().backward()
        local = _columns(sp.shard(full.detach(), cp.size, cp.rank), tp, 2).clone().requires_grad_()
        op = TreeLogProbs(cp_group=cp.group, tp_group=tp.group, chunk_tokens=5)
        with HostSyncCounter() as syncs, CollectiveCounter() as forward:
            out = op(local, sp.pack(ids), sp)
        assert syncs.count == 0, syncs.calls
        # one CP all-gather of the values and the boundary values together; under TP one [2, N] combine each
        assert forward.calls.count("all_gather_into_tensor") == (cp.size > 1) + 2 * (tp.size > 1), forward.calls
        torch.testing.assert_close(out, want.detach(), **TOL)
        (out * weights).sum().backward()
        expected = _columns(sp.shard(full.grad, cp.size, cp.rank), tp, 2)
        torch.testing.assert_close(local.grad, expected, **TOL)
    return (cp.rank, tp.rank)


def case_hidden(sequence_parallel: bool = False):
    """With ``sequence_parallel`` each TP rank holds its ``[1, T/(C*TP), H]`` rows of the CP shard."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    for i in range(len(BATCHES)):
        sp, ids, token, weights, gen, (groups, prefix, lengths, seq_len) = _case(i, cp.size)
        hidden = torch.randn(1, sp.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
        want = alone(lambda k: hidden[0, k] @ weight.T / 0.8, groups, prefix, lengths, ids, token, seq_len)
        (want * weights).sum().backward()
        mine = (lambda t: _columns(t, tp, 1)) if sequence_parallel else (lambda t: t)  # this TP rank's token rows
        local_h = mine(sp.shard(hidden.detach(), cp.size, cp.rank)).clone().requires_grad_()
        local_w = _columns(weight.detach(), tp, 0).clone().requires_grad_()
        op = TreeLogProbsFromHidden(cp_group=cp.group, tp_group=tp.group, chunk_tokens=4, temperature=0.8,
                                            sequence_parallel=sequence_parallel)
        with CollectiveCounter() as forward:
            out = op(local_h, local_w, sp.pack(ids), sp)
        # one CP all-gather; under TP one [2, N] combine, and with sequence parallelism one gather of the rows
        # (the boundary rows with them)
        gathers = (cp.size > 1) + (tp.size > 1) * (1 + sequence_parallel)
        assert forward.calls.count("all_gather_into_tensor") == gathers, forward.calls
        torch.testing.assert_close(out, want.detach(), **TOL)
        (out * weights).sum().backward()
        torch.testing.assert_close(local_h.grad, mine(sp.shard(hidden.grad, cp.size, cp.rank)), **TOL)
        torch.testing.assert_close(_summed(local_w.grad, cp.group), _columns(weight.grad, tp, 0), **TOL)
    return (cp.rank, tp.rank)


def case_outputs(sequence_parallel: bool = False):
    """``TreeLogProbsFromHidden.outputs`` (entropy, top-3, argmax) and ``TreeLogProbs.outputs``
    (entropy) on this rank's part: each rollout alone's values on every rank, the single-process gradients."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    for i in range(len(BATCHES)):
        sp, ids, token, weights, gen, (groups, prefix, lengths, seq_len) = _case(i, cp.size)
        hidden = torch.randn(1, sp.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
        w_top = torch.randn(len(lengths), seq_len - 1, 3, generator=gen, dtype=torch.float64)
        ent, top, top_ids, arg = alone_outputs(lambda k: hidden[0, k] @ weight.T / 0.8, groups, prefix, lengths,
                                               seq_len, token, 3)
        ((ent * weights).sum() + (top * w_top).sum()).backward()
        mine = (lambda t: _columns(t, tp, 1)) if sequence_parallel else (lambda t: t)  # this TP rank's token rows
        local_h = mine(sp.shard(hidden.detach(), cp.size, cp.rank)).clone().requires_grad_()
        local_w = _columns(weight.detach(), tp, 0).clone().requires_grad_()
        op = TreeLogProbsFromHidden(cp_group=cp.group, tp_group=tp.group, chunk_tokens=4, temperature=0.8,
                                            sequence_parallel=sequence_parallel)
        got = op.outputs(local_h, local_w, sp.pack(ids), sp, logprobs=False, entropy=True, top_k=3, argmax=True)
        torch.testing.assert_close(got.entropy, ent.detach(), **TOL)
        torch.testing.assert_close(got.topk_logprobs, top.detach(), **TOL)
        assert torch.equal(got.topk_indices, top_ids) and torch.equal(got.argmax, arg)
        ((got.entropy * weights).sum() + (got.topk_logprobs * w_top).sum()).backward()
        torch.testing.assert_close(local_h.grad, mine(sp.shard(hidden.grad, cp.size, cp.rank)), **TOL)
        torch.testing.assert_close(_summed(local_w.grad, cp.group), _columns(weight.grad, tp, 0), **TOL)
        logits = hidden.detach() @ weight.detach().T / 0.8  # [1, T, V]
        local = _columns(sp.shard(logits, cp.size, cp.rank), tp, 2)
        got = TreeLogProbs(cp_group=cp.group, tp_group=tp.group, chunk_tokens=5).outputs(
            local, sp.pack(ids), sp, entropy=True)
        torch.testing.assert_close(got.entropy, ent.detach(), **TOL)
    return (cp.rank, tp.rank)
