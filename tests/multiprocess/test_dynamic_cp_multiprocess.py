"""Tier: CPU multi-process over gloo (tests/support/cp_harness.py): one module-scoped pool of 4 ranks
(megatron-core's parallel_state for the hybrid groups and the schedule), and one test with 8 ranks that
never import megatron-core. Float64, 1e-12. Cases: tests/support/dynamic_cp_cases.py.

Dynamic context parallelism end to end: a plan over the whole pool, every rank its rounds of one static
shape, each round over its block's group; loss and gradients equal to every sequence run alone.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.multiprocess
CASES = "tests.support.dynamic_cp_cases"


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def _exact(results):
    for r in results:
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, r


@pytest.mark.parametrize("source", ["create", "megatron"])
def test_tiny_model_on_four_ranks_equals_every_sequence_alone(rank_pool, source):
    results = rank_pool.run(f"{CASES}:case_tiny_exact", 4, source, cp=1)
    _exact(results)
    assert results[0]["plan_sizes"] == [1, 2, 4]  # CP sizes 1, 2 and 4 in one step
    assert all(r["sizes"] == [4, 2, 1] and r["syncs"] == 0 for r in results), results  # 0 host reads per round
    assert {s for r in results for s in r["shapes"]} == {(1, 16)}  # one static shape on every rank


def test_compiled_rounds_compile_once_per_cp_size_and_equal_eager(rank_pool):
    results = rank_pool.run(f"{CASES}:case_compiled", 4, cp=1)
    for r in results:
        # two steps of different lengths: a graph for each CP size on the first, none new on the second
        assert r["sizes"] == [1, 2, 4] and r["frames"] == [3, 3], r
        assert r["equal"] and r["syncs"] == 0, r


@needs_megatron_models
@pytest.mark.parametrize("static_cp", [1, 2], ids=lambda c: f"static_cp{c}")
def test_megatron_schedule_with_the_rounds_groups_equals_every_sequence_alone(rank_pool, static_cp):
    """megatron-core's rotary embedding would use the static CP group (of ``static_cp`` ranks); the
    adapter hands it each round's group (1, 2 or 4 ranks)."""
    results = rank_pool.run(f"{CASES}:case_megatron_schedule", 4, static_cp, cp=1)
    _exact(results)
    for r in results:
        assert r["static"] == static_cp and r["rounds"] == 3, r
        assert r["local_cp_size"] == 4 and r["group_size"] == 4, r  # round 0: the block of all 4 ranks


def test_bad_groups_and_inputs_are_refused(rank_pool):
    assert all(len(r) == 6 for r in rank_pool.run(f"{CASES}:case_errors", 4, cp=1))


@needs_megatron_models
def test_the_adapter_refuses_what_it_cannot_run_over_a_rounds_group(rank_pool):
    results = rank_pool.run(f"{CASES}:case_adapter_errors", 4, cp=1)
    # the recompute refusal only where the release's rotary embedding takes the static group (0.16, 0.19)
    assert all(len(r["messages"]) == (1 if r["rope_takes_runtime_group"] else 2) for r in results), results


def test_eight_ranks_equal_every_sequence_alone():
    pool = RankPool(8, megatron=False)
    try:
        results = pool.run(f"{CASES}:case_tiny_exact", 8)
    finally:
        pool.close()
    _exact(results)
    assert results[0]["plan_sizes"] == [1, 2, 4, 8]
    assert all(r["syncs"] == 0 and r["sizes"][0] == 8 for r in results), results


def test_a_plan_that_does_not_fit_is_refused_on_every_rank():
    """``row_capacity=1`` on two ranks where only rank 1's block of round 1 holds two sequences: both refuse
    (before, rank 1 raised and rank 0 built its step, to wait for rank 1 in the round's first collective)."""
    pool = RankPool(2, megatron=False, timeout_s=300)
    try:
        results = pool.run(f"{CASES}:case_plan_refused_everywhere", 2)
    finally:
        pool.close()
    assert [r["raised"] for r in results] == [True, True], results
    assert results[0]["message"] == results[1]["message"], results
    assert "round 1's block of ranks 1..1 holds 2 sequences, more than row_capacity=1" in results[0]["message"], results

