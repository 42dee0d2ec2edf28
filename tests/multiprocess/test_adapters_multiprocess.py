"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py; C = 2 runs as two CP groups side by side, C = 4 as one; PP = 2 as two
pipelines side by side), megatron-core parallel_state for the groups. Cases:
tests/models/adapter_cases.py. Float64 unless stated.

The adapters under real context parallelism and a real pipeline schedule.
"""

from __future__ import annotations

import pytest

from tests.support.hf_matrix import CP_FAMILIES
from tests.models.adapter_cases import FLOAT32_STEP_TOL
from tests.support.cp_harness import RankPool
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_adapter_cp_matches_each_sequence_alone(rank_pool, kind, cp):
    results = rank_pool.run("tests.models.adapter_cases:case_hf", kind, cp=cp)
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    for r in results:
        assert r["out"] < 1e-12 and r["grad"] < 1e-12, r


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_hf_hidden_states_into_the_fused_head_under_cp_equal_each_sequence_alone(rank_pool, cp):
    """``HFCausalLMAdapter(output="hidden_states")``, this rank's hidden states into ``TokenLogProbsFromHidden``
    over the CP group: each sequence's log-probs alone, values and parameter gradients."""
    results = rank_pool.run("tests.models.adapter_cases:case_hf_hidden_states_logprobs", cp=cp)
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    for r in results:
        assert r["out"] < 1e-12 and r["grad"] < 1e-12, r


@pytest.mark.parametrize("kind", ["mistral", "qwen3_next", "mamba2", "lfm2"])
def test_hf_adapter_cp2_on_sliding_windows_and_hybrids(rank_pool, kind):
    """C = 2: the sliding-window mask under CP, and the hybrids' gated delta net / Mamba-2 / short conv
    layers run per sequence on every rank's gathered tokens (each rank keeps its own places)."""
    results = rank_pool.run("tests.models.adapter_cases:case_hf", kind, cp=2)
    # float32 steps inside the hybrids' layers: FLOAT32_STEP_TOL (tests/models/adapter_cases.py) says why
    out_tol = FLOAT32_STEP_TOL if kind == "mamba2" else 1e-12
    grad_tol = 1e-12 if kind == "mistral" else FLOAT32_STEP_TOL
    for r in results:
        assert r["out"] < out_tol and r["grad"] < grad_tol, r


@pytest.mark.parametrize("name", CP_FAMILIES)
def test_hf_families_cp2(rank_pool, name):
    """C = 2, float32: the conformance matrix's representative set (learned positions, MLA, windows known
    only from the config) under CP. Tolerances: a float32 sum over the gathered keys in another order (the
    matrix's are relative; these absolute, on logits of magnitude ~1 and gradients ~10)."""
    for r in rank_pool.run("tests.models.adapter_cases:case_hf_family", name, cp=2):
        assert r["out"] < 2e-5 and r["grad"] < 1e-4, r


@needs_megatron_models
@pytest.mark.parametrize("cp", [1, 2, 4], ids=lambda c: f"C{c}")
def test_megatron_adapter_matches_each_sequence_alone(rank_pool, cp):
    results = rank_pool.run("tests.models.adapter_cases:case_megatron", cp=cp)
    assert [(r["cp_rank"], r["cp_size"]) for r in results] == [(i % cp, cp) for i in range(4)]
    for r in results:
        assert r["out"] < 1e-12 and r["grad"] < 1e-12, r


@needs_megatron_models
@pytest.mark.parametrize("cp", [1, 2], ids=lambda c: f"C{c}")
def test_a_microbatch_of_no_sequence_gives_no_rows(rank_pool, cp):
    for shapes in rank_pool.run("tests.models.adapter_cases:case_empty_microbatch", cp=cp):
        assert len(shapes) == 4 and set(shapes.values()) == {(0, 12, 97)}, shapes


@needs_megatron_models
def test_megatron_config_may_say_context_parallel_size_c(rank_pool):
    assert rank_pool.run("tests.models.adapter_cases:case_megatron_config_cp", cp=2) == [0.0] * 4


@needs_megatron_models
def test_compiled_packing_with_both_adapters_never_recompiles(rank_pool):
    result = rank_pool.run("tests.models.adapter_cases:case_compiled_stream", cp=1)[0]
    # Compiled on the first microbatch (a prepare graph per wrapper; the unpack graph may be shared
    # by both), then nothing new over the stream.
    frames = result["frames"]
    assert frames[0] >= 2 and frames == [frames[0]] * 5, result
    for name, worst in result["worst"].items():
        assert worst < 1e-5, (name, worst)  # float32


@needs_megatron_models
def test_pipeline_parallel_1f1b_equals_pp1_and_each_sequence(rank_pool):
    results = rank_pool.run("tests.models.adapter_cases:case_pipeline", cp=1)
    lasts = [r for r in results if "pp2_losses" in r]
    assert len(lasts) == 2  # two pipelines, one last stage each
    for r in results:
        assert r["grads_bitwise"] and r["grads_pp2_vs_pp1"] == 0.0, r
        assert r["grads_pp1_vs_alone"] < 1e-12 and r["losses_pp1_vs_alone"] < 1e-12, r
    for r in lasts:
        assert r["losses_bitwise"] and len(r["pp2_losses"]) == 7 and r["rows"][3] == 0, r  # one empty microbatch
        assert r["pp2_losses"][3] == 0.0 and min(r["pp2_losses"][:3] + r["pp2_losses"][4:]) > 0, r
    stages = sorted(len(r["stage_parameters"]) for r in results)
    assert stages[0] > 0 and len({tuple(r["stage_parameters"]) for r in results}) == 2  # two different stages
    from scripts.pipeline_example import report

    text = report(results)  # what python -m scripts.pipeline_example prints
    assert "PP=2 vs PP=1: max |diff| 0.0e+00 (bit for bit: True)" in text


@needs_megatron_models
def test_pipeline_parallel_interleaved_equals_pp1_and_each_sequence(rank_pool):
    results = rank_pool.run("tests.models.adapter_cases:case_pipeline_interleaved", cp=1)
    lasts = [r for r in results if "pp2_losses" in r]
    assert len(lasts) == 2 and {r["schedule"] for r in results} == {"forward_backward_pipelining_with_interleaving"}
    for r in results:
        assert r["vpp"] == 2 and r["grads_bitwise"] and r["grads_pp2_vs_pp1"] == 0.0, r
        assert r["grads_pp1_vs_alone"] < 1e-12 and r["losses_pp1_vs_alone"] < 1e-12, r
    for r in lasts:
        assert r["losses_bitwise"] and len(r["pp2_losses"]) == 8 and r["rows"][3] == 0 and r["pp2_losses"][3] == 0.0
    # each rank holds two chunks: stage 0 the embedding, layers 0 and 2; stage 1 layers 1 and 3 and the output layer
    layers = {frozenset(n.split(".")[2] for n in r["stage_parameters"] if n.startswith("decoder.layers.")): r
              for r in results}
    assert set(layers) == {frozenset({"0", "2"}), frozenset({"1", "3"})}, list(layers)
    assert "embedding.word_embeddings.weight" in layers[frozenset({"0", "2"})]["stage_parameters"]
    assert "output_layer.weight" in layers[frozenset({"1", "3"})]["stage_parameters"]
    from scripts.pipeline_example import report

    text = report(results)
    assert "interleaved 1F1B, 2 virtual stages per rank" in text and "(bit for bit: True)" in text
@pytest.mark.parametrize("cp", [1, 2], ids=lambda c: f"C{c}")
def test_megatron_adapter_logprobs_equal_the_logits_path(rank_pool, cp):
    for r in rank_pool.run("tests.models.fused_head_cases:case_adapter_logprobs", cp=cp):
        assert r["cp_size"] == cp and r["values"] < 1e-10 and r["grads"] < 1e-10, r


@needs_megatron_models
@pytest.mark.parametrize("cp", [1, 2], ids=lambda c: f"C{c}")
def test_nemo_rl_patched_gpt_forward_returns_logprobs_under_cp(rank_pool, cp):
    for r in rank_pool.run("tests.models.fused_head_cases:case_patched_forward", cp=cp):
        assert r["cp_size"] == cp and r["values"] < 1e-10 and r["grads"] < 1e-10 and r["plain"] == 0.0, r


@needs_megatron_models
def test_pipeline_with_the_logprob_adapter_equals_pp1_with_logits(rank_pool):
    results = rank_pool.run("tests.models.fused_head_cases:case_pipeline_logprobs", cp=1)
    lasts = [r for r in results if "losses" in r]
    assert len(lasts) == 2 and all(r["count"] == 7 and r["losses"] < 1e-10 and r["positive"] for r in lasts), results
    assert all(r["grads"] < 1e-10 and r["parameters"] > 0 for r in results), results


@needs_megatron_models
def test_megatron_adapter_errors(rank_pool):
    results = rank_pool.run("tests.models.adapter_cases:case_megatron_errors", cp=2)
    assert all(len(r) == 5 for r in results)
