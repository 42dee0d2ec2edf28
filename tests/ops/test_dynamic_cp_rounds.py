"""Tier: pure CPU, single process (the rounds over 4 and 8 gloo ranks: tests/multiprocess/test_dynamic_cp_multiprocess.py).

nn_data.dynamic_cp's round data path in one process: RoundPack's shard (the module docstring's worked
example), no host read (on ``meta`` tensors), one graph for a stream of rounds, and the step's refusals.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.dynamic_cp import DynamicCPRunner, RoundPack, dynamic_cp_groups
from nn_data.errors import PackingError
from nn_data.planning import Parallelism, plan_step_dynamic_cp


def test_worked_example_rank_5_of_8_holds_chunks_5_and_10_of_the_long_sequence():
    """rounds.py's docstring: the 30000-token sequence over 8 ranks, tpr 4096: padded to 30000 (a multiple
    of 16), the last segment extended to T = 32768, 16 chunks of 2048; rank 5 holds chunks 5 and 10."""
    ids = torch.arange(1, 30001).view(1, 30000)
    local = RoundPack(8, 5, 4096, 16)(ids, torch.tensor([30000]), torch.tensor(1))
    expected = torch.cat([torch.arange(5 * 2048, 6 * 2048), torch.arange(10 * 2048, 11 * 2048)])
    assert torch.equal(local.packed.query_index, expected) and local.input_ids.shape == (1, 4096)
    assert torch.equal(local.position_ids[0], expected)  # one sequence: positions are packed positions
    real = expected < 30000
    assert torch.equal(local.input_ids[0], torch.where(real, expected + 1, 0))
    has_next = expected + 1 < 30000
    assert torch.equal(local.loss_mask[0].bool(), has_next)
    assert torch.equal(local.targets[0], torch.where(has_next, expected + 2, -100))
    assert local.packed.cu_seqlens_padded.tolist() == [0, 32768] and local.packed_ids.shape == (1, 32768)
    assert torch.equal(local.packed.padding_mask[0], ~real)


@pytest.mark.parametrize("c, cp_rank", [(1, 0), (2, 1), (4, 2)])
def test_a_round_reads_nothing_on_the_host(c, cp_rank):
    """On ``meta`` tensors every value-dependent op fails and every host read is counted: none."""
    op = RoundPack(c, cp_rank, 16, 2 * c if c > 1 else 1)
    rows = torch.zeros(4, 24, dtype=torch.long, device="meta")
    lengths = torch.zeros(4, dtype=torch.long, device="meta")
    with HostSyncCounter() as syncs:
        local = op(rows, lengths, torch.zeros((), dtype=torch.long, device="meta"))
    assert syncs.count == 0, syncs.calls
    assert local.input_ids.shape == local.targets.shape == (1, 16) and local.packed.segment_ids.shape == (c * 16,)
    assert local.packed.cu_seqlens_padded.shape == (5,)


def test_a_stream_of_rounds_compiles_once_whatever_the_lengths_and_row_length():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=32, row_capacity=8, compile=True,
                             compile_kwargs={"backend": counter})
    eager = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=32, row_capacity=8)
    for lengths, width in (([5, 9, 3, 4, 6], 12), ([20, 0, 7], 24), ([1, 2, 3, 4, 5, 6, 7], 9)):
        plan = plan_step_dynamic_cp(lengths, Parallelism(dp=1), tokens_per_rank=32)
        ids = torch.randint(1, 50, (len(lengths), width))
        for got, want in zip(runner.step(plan, ids), eager.step(plan, ids)):
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.targets, want.targets)
            assert torch.equal(got.position_ids, want.position_ids)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_the_step_refuses_inputs_that_do_not_hold_the_plan():
    plan = plan_step_dynamic_cp([5, 9, 3], Parallelism(dp=1), tokens_per_rank=16)
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=16)
    with pytest.raises(PackingError, match=r"input_ids must be a \[n, S\] tensor"):
        runner.step(plan, torch.zeros(3, dtype=torch.long))
    with pytest.raises(PackingError, match=r"sequence 1 has 9 tokens in the plan but the rows of input_ids hold S=6"):
        runner.step(plan, torch.zeros(3, 6, dtype=torch.long))
    with pytest.raises(PackingError, match=r"groups is a dict; pass nn_data.dynamic_cp.dynamic_cp_groups"):
        DynamicCPRunner({}, tokens_per_rank=16)
    subset = runner.step(plan, torch.ones(3, 9, dtype=torch.long), rows=[2, 0, 1])  # rows in another order
    assert sum(int(r.loss_mask.sum()) for r in subset) == 4 + 8 + 2
    assert subset.target_tokens == 14


def test_a_tree_microbatch_is_refused_by_name():
    """Dynamic CP shards each sequence alone over its rounds' blocks: a tree's keywords are refused by name."""
    plan = plan_step_dynamic_cp([5, 9, 3], Parallelism(dp=1), tokens_per_rank=16)
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=16)
    with pytest.raises(PackingError, match=r"DynamicCPRunner.step serves plain microbatches; \['branch_at', "
                                           r"'parent'\] make this a tree microbatch .* plan_step_rollout_tree"):
        runner.step(plan, torch.ones(3, 9, dtype=torch.long), parent=torch.tensor([-1, 0, 0]),
                    branch_at=torch.tensor([0, 2, 2]))
