"""The cases every spawned rank runs (tests/support/cp_harness.py) for
tests/multiprocess/test_tree_multiprocess.py: a rollout tree's per-rollout log-probs under context and
tensor parallelism, from packed logits and from hidden states + the output weight.

Every rank builds the same float64 data from fixed seeds (random trees of depth up to 4, the full packed
logits or hidden states), feeds the op its part (the zigzag CP shard of the node slots, this TP rank's
vocabulary columns or weight rows) and compares with each rollout alone (a plain log_softmax at each
token's packed place, tests/support/tree_reference.py): values on every rank, the local input's gradient
against its part of the single-process one. Tolerance 1e-10.
"""

from __future__ import annotations

import random

import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.layout import PackSpec, tree_layout
from nn_data.logprobs import TreeLogProbs, TreeLogProbsFromHidden
from tests.support.tree_reference import BY_DEPTH, alone_outputs, path_place, random_tree, reference, token_ids

V, H, SEQ_LEN = 12, 6, 12
TOL = dict(rtol=0, atol=1e-10)


def _case(seed: int, cp_size: int, tree=None, seq_len: int = SEQ_LEN):
    """``(tree, layout, ref, ids, weights [B, S-1], gen)``: ``tree`` (a random one of ``seed`` when None)
    packed for ``cp_size`` ranks, every node slot rounded up to ``2C``, at a ``T`` with room to spare."""
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(2, 7), seq_len) if tree is None else tree
    rows = len(tree.lengths)
    capacity = max(3 * rows - 2, 2 * rows)
    total = 2 * cp_size * (capacity * (seq_len + 2) // 2 + 2)
    ids = token_ids(tree, seq_len).clamp(min=0) % V
    layout = tree_layout(torch.tensor(tree.lengths), torch.tensor(tree.parent), torch.tensor(tree.branch_at),
                         row_len=seq_len, spec=PackSpec(2 * cp_size, fixed_total=total), input_ids=ids)
    ref = reference(tree, capacity, 2 * cp_size, total)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(rows, seq_len - 1, generator=gen, dtype=torch.float64)
    return tree, layout, ref, ids, weights, gen


def _alone(tree, ref, ids, row) -> torch.Tensor:
    """``[B, S-1]``: each rollout alone, ``row(k) -> [V]`` the logits at packed position ``k``."""
    out = []
    for b, n in enumerate(tree.lengths):
        values = [row(path_place(tree, ref, b, s)).log_softmax(-1)[ids[b, s + 1]] for s in range(n - 1)]
        zero = torch.zeros((), dtype=torch.float64)
        out.append(torch.stack(values + [zero] * (SEQ_LEN - 1 - len(values))))
    return torch.stack(out)


def case_logits():
    cp, tp = context_parallel_info(), tensor_parallel_info()
    for seed in range(4):
        tree, layout, ref, ids, weights, gen = _case(seed, cp.size)
        full = torch.randn(1, layout.total, V, generator=gen, dtype=torch.float64, requires_grad=True)
        want = _alone(tree, ref, ids, lambda k: full[0, k])
        ((want * weights).sum() + 0 * full.sum()).backward()  # (a tree of 1-token rollouts scores nothing)
        local = layout.shard(full.detach(), cp.size, cp.rank).chunk(tp.size, dim=2)[tp.rank].clone().requires_grad_()
        op = TreeLogProbs(cp_group=cp.group, tp_group=tp.group, chunk_tokens=5)
        with HostSyncCounter() as syncs:
            out = op(local, layout.pack(ids), layout)
        assert syncs.count == 0, syncs.calls
        torch.testing.assert_close(out, want.detach(), **TOL)
        (out * weights).sum().backward()
        expected = layout.shard(full.grad, cp.size, cp.rank).chunk(tp.size, dim=2)[tp.rank]
        torch.testing.assert_close(local.grad, expected, **TOL)
    return (cp.rank, tp.rank)


def case_hidden():
    cp, tp = context_parallel_info(), tensor_parallel_info()
    for seed in range(4):
        tree, layout, ref, ids, weights, gen = _case(seed, cp.size)
        hidden = torch.randn(1, layout.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
        want = _alone(tree, ref, ids, lambda k: hidden[0, k] @ weight.T)
        ((want * weights).sum() + 0 * hidden.sum()).backward()
        local = layout.shard(hidden.detach(), cp.size, cp.rank).clone().requires_grad_()
        rows = weight.chunk(tp.size, dim=0)[tp.rank]
        op = TreeLogProbsFromHidden(cp_group=cp.group, tp_group=tp.group, chunk_tokens=5)
        out = op(local, rows, layout.pack(ids), layout)
        torch.testing.assert_close(out, want.detach(), **TOL)
        (out * weights).sum().backward()
        torch.testing.assert_close(local.grad, layout.shard(hidden.grad, cp.size, cp.rank), **TOL)
    return (cp.rank, tp.rank)


def case_outputs(sequence_parallel: bool = False):
    """``TreeLogProbsFromHidden.outputs`` (log-prob, entropy, top-3, argmax; temperature 0.8; with
    ``sequence_parallel`` this TP rank's rows of the CP shard) and ``TreeLogProbs.outputs`` on trees of
    depth 3 and 4: every rank's rows equal each rollout alone's, the hidden states' and the weight's gradients
    (of a loss on the log-prob, the entropy and the top-3 log-probs) its part of the single-process ones."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    seq_len = 19
    for seed, tree in enumerate(BY_DEPTH[2:]):
        tree, layout, ref, ids, weights, gen = _case(seed, cp.size, tree, seq_len)
        hidden = torch.randn(1, layout.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
        w_top = torch.randn(len(tree.lengths), seq_len - 1, 3, generator=gen, dtype=torch.float64)

        def loss(out):
            return (out["logprobs"] * weights).sum() + (out["entropy"] * weights.flip(0)).sum() + \
                (out["topk_logprobs"] * w_top).sum() + 0 * hidden.sum()

        want = alone_outputs(tree, ref, ids, lambda k: hidden[0, k] @ weight.T / 0.8, seq_len, 3)
        loss(want).backward()
        mine = (lambda t: t.chunk(tp.size, dim=1)[tp.rank]) if sequence_parallel else (lambda t: t)
        local_h = mine(layout.shard(hidden.detach(), cp.size, cp.rank)).clone().requires_grad_()
        local_w = weight.detach().chunk(tp.size, dim=0)[tp.rank].clone().requires_grad_()
        op = TreeLogProbsFromHidden(cp_group=cp.group, tp_group=tp.group, chunk_tokens=4, temperature=0.8,
                                            sequence_parallel=sequence_parallel)
        got = op.outputs(local_h, local_w, layout.pack(ids), layout, entropy=True, top_k=3, argmax=True)._asdict()
        for name in ("logprobs", "entropy", "topk_logprobs", "topk_indices", "argmax"):
            torch.testing.assert_close(got[name], want[name].detach(), **TOL, msg=name)
        loss(got).backward()
        torch.testing.assert_close(local_h.grad, mine(layout.shard(hidden.grad, cp.size, cp.rank)), **TOL)
        grad_w = local_w.grad.clone()
        if cp.group is not None:
            torch.distributed.all_reduce(grad_w, group=cp.group)  # each CP rank's tokens' part
        torch.testing.assert_close(grad_w, weight.grad.chunk(tp.size, dim=0)[tp.rank], **TOL)
        logits = hidden.detach() @ weight.detach().T / 0.8  # [1, T, V]
        local = layout.shard(logits, cp.size, cp.rank).chunk(tp.size, dim=2)[tp.rank]
        got = TreeLogProbs(cp_group=cp.group, tp_group=tp.group, chunk_tokens=5).outputs(
            local, layout.pack(ids), layout, entropy=True, top_k=3, argmax=True)._asdict()
        for name in ("logprobs", "entropy", "topk_logprobs", "topk_indices", "argmax"):
            torch.testing.assert_close(got[name], want[name].detach(), **TOL, msg=name)
    return (cp.rank, tp.rank)
