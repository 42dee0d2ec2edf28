"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py with ``cp=None``: the pool never touches parallel_state; every rank builds
its groups from a HyperCommGrid). Cases: tests/support/pg_collection_cases.py. Float64.

Explicit process-group collections, megatron-core's parallel_state never initialised: nn_data's entry
points take the CP and TP groups as ``pg_collection=`` (CP 2, TP 2; the NeMo-RL layer too), a tiny dense and a tiny MoE GPTModel
built on the collection match each sequence alone and the MoE routers are told every padding position, and
megatron-core's PP 2 schedules (1F1B and interleaved) run nn_data's packed microbatches exactly.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.multiprocess

CASES = "tests.support.pg_collection_cases:"


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def test_groups_come_from_the_collection_and_mistakes_are_named(rank_pool):
    results = rank_pool.run(CASES + "case_resolver", cp=None)
    assert all(r == results[0] for r in results) and len(results[0]) == 7


def test_context_parallel_ops_take_the_collection(rank_pool):
    assert rank_pool.run(CASES + "case_context_parallel_ops", cp=None) == [0, 1, 0, 1]  # CP groups {0,1}, {2,3}


def test_tensor_parallel_ops_take_the_collection(rank_pool):
    # grid order tp-cp-ep-dp-pp: TP groups {0,1}, {2,3}; CP groups {0,2}, {1,3}
    assert rank_pool.run(CASES + "case_tensor_parallel_ops", cp=None) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_linear_ce_functions_take_the_collection(rank_pool):
    assert rank_pool.run(CASES + "case_linear_ce", cp=None) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_staged_microbatches_under_context_parallelism(rank_pool):
    assert rank_pool.run(CASES + "case_staging", cp=None) == [0, 1, 0, 1]


def test_the_nemo_rl_layer_takes_the_collection(rank_pool):
    assert rank_pool.run(CASES + "case_compat_layer", cp=None) == [0, 1, 0, 1]


@needs_megatron_models
@pytest.mark.parametrize("cp", [1, 2], ids=lambda c: f"C{c}")
def test_models_on_the_collection_match_each_sequence_alone_and_routers_see_no_padding(rank_pool, cp):
    for r in rank_pool.run(CASES + "case_megatron_models", cp, cp=None):
        for name in ("dense", "moe"):
            assert r[name]["cp_size"] == cp and r[name]["out"] < 1e-12 and r[name]["grad"] < 1e-12, r
        told, control = r["router"]["with mask"], r["router"]["without mask"]
        assert told["calls"] == control["calls"] > 0 and told["padding_received"] > 0, r
        assert told["padding_seen_as_real"] == 0 and told["real_seen_as_padding"] == 0, r
        assert control["padding_seen_as_real"] == control["padding_received"], r  # the count can fail


@needs_megatron_models
@pytest.mark.parametrize("vpp,experts", [(1, 0), (2, 4)], ids=["1F1B", "interleaved-MoE"])
def test_pipeline_schedules_on_collections_equal_pp1_and_each_sequence(rank_pool, vpp, experts):
    results = rank_pool.run(CASES + "case_pipeline", vpp, experts, cp=None)
    lasts = [r for r in results if "pp2_losses" in r]
    assert len(lasts) == 2  # two pipelines, one last stage each
    for r in results:
        assert not r["parallel_state_initialised"] and r["groups"] == "collection", r
        assert r["grads_bitwise"] and r["grads_pp2_vs_pp1"] == 0.0, r
        assert r["grads_pp1_vs_alone"] < 1e-12 and r["losses_pp1_vs_alone"] < 1e-12, r
        want = "forward_backward_pipelining_with_interleaving" if vpp > 1 else "forward_backward_pipelining_without_interleaving"
        assert r["schedule"] == want, r
    for r in lasts:
        assert r["losses_bitwise"] and r["rows"][3] == 0 and r["pp2_losses"][3] == 0.0, r
