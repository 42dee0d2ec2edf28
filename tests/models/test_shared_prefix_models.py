"""Tier: pure CPU, single process (tiny models built from a config, nothing downloaded; a one-rank gloo
group on 127.0.0.1 for megatron-core's parallel_state). Under CP (C = 2 and 4, gloo):
tests/multiprocess/test_shared_prefix_models_multiprocess.py. Cases: tests/models/shared_prefix_cases.py.

Shared-prefix packing through the models: ``PackedForward(...)(ids, L, prefix_lengths=P, group_ids=g)``
(each group's prompt packed once, then its responses) equals every rollout run alone on its full row,
logits and parameter gradients, through the HF adapter (Llama, a sliding window, the hybrids) and the
megatron-core adapter (the tiny GPTModel); bf16; one compiled graph over a stream with no host sync.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.adapters import HFCausalLMAdapter
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models import shared_prefix_cases as cases
from tests.models.adapter_cases import FLOAT32_STEP_TOL
from tests.support.megatron_release import needs_megatron_models, one_rank_parallel_state
from tests.support.flex_release import needs_cpu_flex


def test_llama_shared_prefix_equals_each_rollout_alone_float64():
    """Logits and gradients to 1e-10 (float64) with the norms in float64; the model as transformers
    ships it: logits still exact, gradients at its float32 norms' rounding (cases.norms_in_model_dtype)."""
    model = tiny_hf_model("llama", dtype=torch.float64)
    alone = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    single = cases.context_parallel_info()
    with cases.norms_in_model_dtype(model):
        exact = cases.check_shared_equivalence(lambda m: HFCausalLMAdapter(m, mask_kind="dense"), model, alone, single)
    assert exact["out"] < 1e-10 and exact["grad"] < 1e-10, exact
    shipped = cases.check_shared_equivalence(HFCausalLMAdapter, model, alone, single)
    assert shipped["out"] < 1e-10 and shipped["grad"] < 1e-5, shipped


def test_sliding_window_counts_rollout_positions():
    """Mistral (window 3): a response's first tokens still see the prompt's last ones (rollout positions,
    not packed distance); its norms in float64 (cases.norms_in_model_dtype): exact gradients."""
    result = cases.case_hf("mistral", exact_norms=True)
    assert result["out"] < 1e-10 and result["grad"] < 1e-10, result


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next", "mamba2"])
def test_hybrids_run_the_prompt_once_and_each_response_from_its_state(kind):
    """Short convolution, gated delta net, Mamba-2: the prompt runs once, each response from the prompt's
    final state (nn_data.adapters.tree_state). LFM2: exact logits; the delta rule and Mamba-2's scan
    compute in float32 whatever the model's dtype and chunk the row at other places than the rollout alone
    does: float32 rounding (FLOAT32_STEP_TOL). Gradients: the float32 norms."""
    result = cases.case_hf(kind)
    out_tol = 1e-10 if kind == "lfm2" else FLOAT32_STEP_TOL
    assert result["out"] < out_tol and result["grad"] < 1e-4, result


@pytest.fixture(scope="module")
def megatron_state():
    with one_rank_parallel_state():
        yield


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_tiny_gpt_model_shared_prefix_equals_each_rollout_alone_float64(megatron_state):
    """megatron-core's GPTModel (its RMSNorm in the model's dtype): logits and gradients to 1e-10; the
    response's rotary positions continue from the prompt."""
    result = cases.case_megatron()
    assert result["out"] < 1e-10 and result["grad"] < 1e-10, result


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_megatron_logprob_output_is_refused_under_shared_prefix(megatron_state):
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_gpt_config())
    ids, lens, pre, gid = cases.rollouts(*cases.MICROBATCHES[0], torch.Generator().manual_seed(0))
    wrapped = PackedForward(MegatronGPTAdapter(model, output="logprobs"), pad_full_seq_to=64,
                            make_packed_seq_params=True)
    with pytest.raises(PackingError, match="output='logprobs' scores each packed segment"):
        wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)


def test_bf16_shared_prefix_is_within_bf16_noise_of_each_rollout_alone():
    """bf16 (8 mantissa bits): each logit is within a few bf16 ulps of the rollout alone; the packed and
    the alone computations round differently (another reduction order over the prompt's keys in one
    attention row of T keys instead of L), so the bound is 3e-2 on logits of magnitude ~1, as the plain
    path's bf16 tests allow."""
    model = tiny_hf_model("llama", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    worst = 0.0
    with torch.no_grad():
        for groups, prefix, lengths in cases.MICROBATCHES:
            ids, lens, pre, gid = cases.rollouts(groups, prefix, lengths, gen)
            wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4,
                                    pad_full_seq_to=cases.packed_length(groups, prefix, lengths, 4))
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n].float() - alone.float()).abs().max()))
    assert 0 < worst < 3e-2, worst


def test_prefix_lengths_without_group_ids_is_refused():
    model = tiny_hf_model("llama")
    ids, lens, pre, gid = cases.rollouts(*cases.MICROBATCHES[0], torch.Generator().manual_seed(0))
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_full_seq_to=64)
    with pytest.raises(PackingError, match="prefix_lengths was given without group_ids"):
        wrapped(ids, lens, prefix_lengths=pre)
    with pytest.raises(PackingError, match="group_ids"):
        wrapped(ids, lens, prefix_lengths=pre, group_ids=gid[:2])


STREAM = cases.STREAM + (([7, 7], [0, 0], [5, 6]),)  # G, prompt and response lengths vary; one T


@pytest.mark.compile
def test_compiled_packing_one_graph_each_side_and_no_host_sync_over_a_stream():
    """compile_packing=True with a fixed T and a row capacity: the shared-prefix packing and unpacking
    compile once each (2 frames) over microbatches whose group sizes, prompt and response lengths vary;
    no host read in a call after the first; every output equals the eager shared-prefix path."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = tiny_hf_model("llama")
    common = dict(pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=96)
    # verify=False: the packing check runs its own (plain) microbatch, which compiles the plain packing's two
    # graphs once more (docs/models.md); these are the shared-prefix side's
    compiled = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), row_capacity=6, compile_packing=True,
                             compile_kwargs={"backend": counter}, verify=False, **common)
    eager = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), **common)
    gen = torch.Generator().manual_seed(3)
    syncs = []
    with torch.no_grad():
        for step, (groups, prefix, lengths) in enumerate(STREAM):
            ids, lens, pre, gid = cases.rollouts(groups, prefix, lengths, gen)
            with HostSyncCounter() as counted:
                out = compiled(ids, lens, prefix_lengths=pre, group_ids=gid)
            syncs.append(counted.count)
            torch.testing.assert_close(out, eager(ids, lens, prefix_lengths=pre, group_ids=gid), rtol=0, atol=2e-6)
    assert counter.frame_count == 2, counter.frame_count
    assert syncs[1:] == [0] * (len(STREAM) - 1), syncs
    torch._dynamo.reset()


@needs_cpu_flex
def test_flex_block_mask_under_shared_prefix():
    """mask_kind="block": the prefix rule in flex attention's mask_mod (CPU: forward only, float32)."""
    model = tiny_hf_model("llama")
    gen = torch.Generator().manual_seed(4)
    worst = 0.0
    with torch.no_grad():
        for groups, prefix, lengths in cases.MICROBATCHES[:2]:
            ids, lens, pre, gid = cases.rollouts(groups, prefix, lengths, gen)
            wrapped = PackedForward(HFCausalLMAdapter(model, mask_kind="block"), pad_individual_seqs_to_multiple_of=4,
                                    pad_full_seq_to=cases.packed_length(groups, prefix, lengths, 4))
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n] - alone).abs().max()))
    assert worst < 2e-5, worst  # float32


@pytest.mark.parametrize("capacity", [None, 3])
def test_no_rollout_gives_no_rows(capacity):
    model = tiny_hf_model("llama", dtype=torch.float64)
    empty = torch.zeros(0, cases.SEQ_LEN, dtype=torch.long), *(torch.zeros(0, dtype=torch.long) for _ in range(3))
    ids, lens, pre, gid = empty
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=2, pad_full_seq_to=16,
                            row_capacity=capacity)
    out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
    assert tuple(out.shape) == (0, cases.SEQ_LEN, 97)
    out.sum().backward()  # nothing flows, nothing fails


@needs_megatron_models
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_megatron_adapter_under_compiled_shared_prefix_packing(megatron_state):
    """The tiny GPTModel behind compile_packing=True: the packing compiles on the first microbatch only;
    every output equals each rollout alone (float32)."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = tiny_gpt_model(tiny_gpt_config())
    wrapped = PackedForward(MegatronGPTAdapter(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=96,
                            row_capacity=6, compile_packing=True, compile_kwargs={"backend": counter},
                            make_packed_seq_params=True, verify=False)  # the shared-prefix side's graphs only
    gen = torch.Generator().manual_seed(5)
    frames, worst = [], 0.0
    with torch.no_grad():
        for groups, prefix, lengths in STREAM:
            ids, lens, pre, gid = cases.rollouts(groups, prefix, lengths, gen)
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                worst = max(worst, float((out[b, :n] - forward_alone(model, ids[b : b + 1, :n])[0]).abs().max()))
            frames.append(counter.frame_count)
    assert frames == [2] * len(STREAM), frames
    assert worst < 2e-5, worst
    torch._dynamo.reset()


def test_pipeline_step_refuses_a_microbatch_of_another_shape():
    """pipeline_forward_step reads ``(ids, L)`` or ``(ids, L, P, g)`` (run under PP: the multiprocess test);
    anything else is named, before any packing."""
    from nn_data.adapters import pipeline_forward_step

    step = pipeline_forward_step(PackedForward(lambda *a: None, pad_full_seq_to=8), lambda *a: None)
    ids, lengths = torch.ones(1, 4, dtype=torch.long), torch.tensor([4])
    for item, size in (((ids, lengths, torch.tensor([2])), "3 items"), ({"input_ids": ids}, "dict")):
        with pytest.raises(PackingError, match=f"microbatch of {size}; expected \\(input_ids, seq_lengths\\)"):
            step(iter([item]), None)
