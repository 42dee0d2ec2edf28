"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py; C = 2 runs as two CP groups side by side), megatron-core parallel_state for
the groups. Case: tests/megatron_data/shared_prefix_dropin_cases.py. Float64.

A planned shared-prefix GRPO step (and a step of rollout trees) through the NeMo-RL megatron drop-in under
context parallelism: the iterator packs and zigzag-shards each microbatch for this rank (get_context_parallel_rank /
_world_size),
forward_shared_prefix gathers keys and values over the CP group under the prefix rule, and the log-prob
sibling combines the ranks' scores: logits, log-probs and gradients equal every rollout run alone.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@needs_megatron_models
def test_dropin_shared_prefix_step_under_cp2_equals_each_rollout_alone(rank_pool):
    results = rank_pool.run("tests.megatron_data.shared_prefix_dropin_cases:case_dropin_step", cp=2)
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % 2, 2) for i in range(4)]
    for r in results:
        assert r["logits"] < 1e-10 and r["logprobs"] < 1e-10 and r["grad"] < 1e-10, r


@needs_megatron_models
def test_dropin_rollout_tree_step_under_cp2_equals_each_rollout_alone(rank_pool):
    """The trees of depth 1 to 3 of tests/megatron_data/test_rollout_tree_dropin.py (cfg["nn_data"]["rollout_tree"])
    through the same drop-in path under CP 2."""
    results = rank_pool.run("tests.megatron_data.shared_prefix_dropin_cases:case_dropin_step",
                            "tests.megatron_data.test_rollout_tree_dropin", cp=2)
    assert [(r["cp_rank"], r["cp_size"], r["kinds"]) for r in results] == [(i % 2, 2, ["rollout-tree"]) for i in range(4)]
    for r in results:
        assert r["logits"] < 1e-10 and r["logprobs"] < 1e-10 and r["grad"] < 1e-10, r
