"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on the CPU with
tiny sizes (``scripts/gpu_check.sh --dry-run``), where ``forbid_syncs`` counts Python-level reads instead.
One process: a pool of one rank (CP size 1 rounds) and, without a group, RoundPack's shard for CP size 4
(the collectives need more GPUs than the check has).

The dynamic-CP round data path on a CUDA GPU: no host-device sync per step or round (the step's one
pinned, asynchronous copy included) under ``torch.cuda.set_sync_debug_mode("error")``, eager and
compiled; one compiled graph per CP size; compiled equal to eager.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.dynamic_cp import DynamicCPRunner, RoundPack, dynamic_cp_groups
from nn_data.planning import Parallelism, plan_step_dynamic_cp
from nn_data.diagnostics import forbid_syncs
from tests.cuda.stream import DEVICE, ON_CUDA, TIER

pytestmark = TIER
TPR = 4096 if ON_CUDA else 32
ROWS = 32 if ON_CUDA else 4


def steps(count: int = 3):
    """``count`` steps of seeded lengths up to ``TPR`` and their rows on the device (built outside any check)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        n = 24 + 8 * i if ON_CUDA else 5 + i
        lengths = torch.randint(0, TPR + 1, (n,), generator=gen).tolist()
        width = max(lengths) + i  # a new row length every step
        ids = torch.randint(1, 1000, (n, width), generator=gen).to(DEVICE)
        out.append((plan_step_dynamic_cp(lengths, Parallelism(dp=1), tokens_per_rank=TPR), ids))
    return out


def _rounds(runner, plan, ids) -> list:
    return [tuple(t.clone() for t in (r.input_ids, r.position_ids, r.targets, r.loss_mask,
                                      r.packed.cu_seqlens_padded)) for r in runner.step(plan, ids)]


def test_a_step_and_its_rounds_never_sync_eager_and_compiled():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    groups = dynamic_cp_groups()
    eager = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=ROWS)
    compiled = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=ROWS, compile=True,
                               compile_kwargs={"backend": counter})
    stream = steps()
    _rounds(compiled, *stream[0])  # compiles outside the sync check
    for plan, ids in stream:
        with forbid_syncs(DEVICE):
            got = _rounds(compiled, plan, ids)
            want = _rounds(eager, plan, ids)
        for g, w in zip(got, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(g, w))
    assert counter.frame_count == 1  # one graph (CP size 1) for every step, lengths and row length
    torch._dynamo.reset()


@pytest.mark.parametrize("c, cp_rank", [(4, 2)])
def test_a_round_shard_of_a_larger_block_never_syncs(c, cp_rank):
    torch._dynamo.reset()
    op = RoundPack(c, cp_rank, TPR, 2 * c)
    compiled = torch.compile(RoundPack(c, cp_rank, TPR, 2 * c), fullgraph=True)
    gen = torch.Generator().manual_seed(c)
    lengths = torch.randint(0, 2 * TPR // ROWS, (ROWS,), generator=gen).to(DEVICE)
    rows = torch.randint(1, 1000, (ROWS, 2 * TPR // ROWS), generator=gen).to(DEVICE)
    num = torch.tensor(ROWS, device=DEVICE)
    compiled(rows, lengths, num)
    with forbid_syncs(DEVICE):
        got, want = compiled(rows, lengths, num), op(rows, lengths, num)
    assert got.input_ids.shape == (1, TPR)
    for name in got._fields:  # the tensors, and the block's PackedInfo by its boundaries and segment ids
        a, b = getattr(got, name), getattr(want, name)
        if name == "packed":
            a, b = (a.cu_seqlens_padded, a.segment_ids), (b.cu_seqlens_padded, b.segment_ids)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), name
        else:
            assert torch.equal(a, b), name
    torch._dynamo.reset()
