"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py; C = 2 runs as two CP groups side by side, C = 4 as one), megatron-core
parallel_state for the groups. Cases: tests/models/tree_cases.py. Float64.

Rollout trees through the adapters under context parallelism: the tree row sharded by the zigzag rule
(each node slot in 2C chunks), attention over the gathered keys and values under the path rule; logits
and parameter gradients equal to every rollout run alone, trees of depth 1 to 4.
"""

from __future__ import annotations

import pytest

from tests.models.adapter_cases import FLOAT32_STEP_TOL
from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def _check(results, cp):
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    for r in results:
        assert r["out"] < 1e-10 and r["grad"] < 1e-10, r


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_llama_tree_under_cp_equals_each_rollout_alone(rank_pool, cp):
    _check(rank_pool.run("tests.models.tree_cases:case_hf", "llama", cp=cp), cp)


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next", "mamba2"])
def test_hybrid_tree_under_cp(rank_pool, kind, cp):
    """Short convolution, gated delta net, Mamba-2 under CP: each rank runs its mixers over the gathered tree
    row, every node once from its parent's state, and keeps its own places. Tolerances as in one process
    (tests/models/test_tree_models.py): float32 steps inside the recurrences, transformers' float32 norms."""
    results = rank_pool.run("tests.models.tree_cases:case_hf", kind, False, cp=cp)
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    out_tol = 1e-10 if kind == "lfm2" else FLOAT32_STEP_TOL
    for r in results:
        assert r["out"] < out_tol and r["grad"] < 1e-4, r


@needs_megatron_models
@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_megatron_tree_under_cp_equals_each_rollout_alone(rank_pool, cp):
    _check(rank_pool.run("tests.models.tree_cases:case_megatron", cp=cp), cp)
