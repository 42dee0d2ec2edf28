"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py; C = 2 runs as two CP groups side by side, C = 4 as one), megatron-core
parallel_state for the groups. Cases: tests/models/shared_prefix_cases.py. Float64.

Shared-prefix packing through the adapters under context parallelism: the shared-prefix row sharded by
the zigzag rule (each slot in 2C chunks), attention over the gathered keys and values under the prefix
rule, the hybrids' rows (prompt + response) built from every rank's gathered tokens; equal to every
rollout run alone.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models
from tests.support.flex_release import needs_cpu_flex

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def _check(results, cp, out_tol, grad_tol):
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    for r in results:
        assert r["out"] < out_tol and r["grad"] < grad_tol, r


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_llama_shared_prefix_under_cp_equals_each_rollout_alone(rank_pool, cp):
    """Llama with its norms in float64 (shared_prefix_cases.norms_in_model_dtype): exact."""
    _check(rank_pool.run("tests.models.shared_prefix_cases:case_hf_exact_norms", "llama", cp=cp), cp,
           1e-10, 1e-10)


def test_sliding_window_shared_prefix_under_cp2(rank_pool):
    """Mistral (window 3, rollout positions) with its norms in float64, C = 2: exact."""
    _check(rank_pool.run("tests.models.shared_prefix_cases:case_hf_exact_norms", "mistral", cp=2), 2, 1e-10, 1e-10)


@needs_cpu_flex
def test_flex_block_mask_shared_prefix_under_cp2(rank_pool):
    """mask_kind="block" (flex attention's mask_mod with the prefix rule over the gathered keys), C = 2,
    forward only (a CPU's flex attention has no backward), float32."""
    for r in rank_pool.run("tests.models.shared_prefix_cases:case_hf_flex_forward", cp=2):
        assert r["worst"] < 2e-5, r


def test_hybrid_shared_prefix_under_cp2(rank_pool):
    """LFM2 (short convolution + attention), C = 2: each rank runs the rollout rows on the gathered tokens
    and keeps its places. Gradients: transformers' float32 norms (shared_prefix_cases)."""
    _check(rank_pool.run("tests.models.shared_prefix_cases:case_hf", "lfm2", cp=2), 2, 1e-10, 1e-4)


@needs_megatron_models
@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_megatron_shared_prefix_under_cp_equals_each_rollout_alone(rank_pool, cp):
    _check(rank_pool.run("tests.models.shared_prefix_cases:case_megatron", cp=cp), cp, 1e-10, 1e-10)


@pytest.mark.compile
def test_compiled_shared_prefix_packing_under_cp2(rank_pool):
    """compile_packing=True under C = 2: two graphs (packing, unpacking) over the stream, outputs equal to
    each rollout alone (float32)."""
    for r in rank_pool.run("tests.models.shared_prefix_cases:case_compiled_cp", cp=2):
        assert r["frames"] == [2] * len(r["frames"]) and r["worst"] < 2e-5, r


@needs_megatron_models
def test_pipeline_parallel_shared_prefix_equals_pp1_and_each_rollout_alone(rank_pool):
    """pipeline_forward_step over shared-prefix microbatches: PP = 2 (1F1B) == PP = 1 == each
    rollout alone, losses and parameter gradients, float64, at one constant T."""
    results = rank_pool.run("tests.models.shared_prefix_cases:case_pipeline", cp=1)
    lasts = [r for r in results if "pp2_losses" in r]
    assert len(lasts) == 2 and len({tuple(r["stage_parameters"]) for r in results}) == 2
    for r in results:
        assert r["end_to_end"] > r["T"], r  # the rollouts packed end to end would not fit T
        assert r["grads_pp2_vs_pp1"] < 1e-10 and r["grads_pp1_vs_alone"] < 1e-10, r
        assert r["losses_pp1_vs_alone"] < 1e-10, r
    for r in lasts:
        assert r["losses_pp2_vs_pp1"] < 1e-10 and len(r["pp2_losses"]) == 6 and r["rows"][2] == 0, r
        assert r["pp2_losses"][2] == 0.0 and min(r["pp2_losses"][:2] + r["pp2_losses"][3:]) > 0, r
