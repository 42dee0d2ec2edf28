"""Tier: pure CPU, single process (a one-rank gloo group on 127.0.0.1 for megatron-core's parallel_state,
left afterwards). The oracle is the same model in float64 on the sequence alone (megatron-core's
stock unpacked path); the noise floor is the sequence alone in the tested dtype against it.
profiling/bench/bench_rope_precision.py measures the same at T = 512, 4096 and 32768.

MegatronGPTAdapter rotates every sequence from position 0, as when it runs alone, so a sequence late
in a long pack is as accurate as the same sequence alone: bf16 within 1.2x of bf16's noise floor at
T = 4096, and a float32 error that does not grow with T. RoPE's ``inv_freq`` stays float32, as
megatron-core keeps it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo
from profiling.bench.bench_rope_precision import VOCAB, alone, measure, packed_probe, probe_ids, report
from tests.support.megatron_release import needs_megatron_models

pytestmark = [needs_megatron_models, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROBE = 32


@pytest.fixture(scope="module")
def models():
    """``{dtype: tiny GPTModel}``, the same parameters in float64, float32 and bf16, under a one-rank
    parallel_state."""
    from megatron.core import parallel_state

    init_gloo(0, 1, free_port())
    try:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

        yield {d: tiny_gpt_model(tiny_gpt_config(dtype=d), vocab=VOCAB).eval()
               for d in (torch.float64, torch.float32, torch.bfloat16)}
    finally:
        destroy_model_parallel_groups(parallel_state)
        dist.destroy_process_group()


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt())


def test_bf16_sequence_late_in_a_pack_of_4096_is_within_1_2x_the_noise_floor(models):
    probe = probe_ids(PROBE)
    exact = alone(models[torch.float64], probe)
    floor = _rms(alone(models[torch.bfloat16], probe), exact)  # the same sequence alone in bf16
    packed = _rms(packed_probe(models[torch.bfloat16], 4096, probe), exact)
    assert floor > 0 and packed <= 1.2 * floor, (packed, floor)


def test_float32_error_does_not_grow_with_the_pack_length(models):
    probe = probe_ids(PROBE)
    exact = alone(models[torch.float64], probe)
    floor = float((alone(models[torch.float32], probe) - exact).abs().max())
    errors = {t: float((packed_probe(models[torch.float32], t, probe) - exact).abs().max()) for t in (256, 4096)}
    # Rotated by packed position (megatron-core's offset branch) the probe at T = 4096 was 3.9e-6
    # off, 7.7x the float32 floor of 5.1e-7; rotated from 0 it is as far off as at T = 256.
    assert errors[4096] <= 1.2 * errors[256] and errors[4096] <= 2 * floor, (errors, floor)


def test_the_rotary_table_is_longer_than_the_pack_and_nothing_else_changes(models):
    from nn_data.adapters.megatron_gpt import rotary_from_sequence_start
    from nn_data.megatron_parallel import make_packed_seq_params

    bounds = torch.tensor([0, 16, 40], dtype=torch.int32)
    params = make_packed_seq_params(bounds, 40, 40, total=40)
    rotary = rotary_from_sequence_start(params, 40)
    assert (rotary.max_seqlen_q, rotary.max_seqlen_kv) == (41, 41) and params.max_seqlen_q == 40
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(rotary, field) is bounds
    assert getattr(rotary, "seq_idx", None) is getattr(params, "seq_idx", None)  # not rebuilt


def test_inv_freq_stays_float32_as_megatron_core_keeps_it(models):
    for model in models.values():
        assert model.rotary_pos_emb.inv_freq.dtype == torch.float32


def test_the_precision_script_measures_both_rotations(models):
    rows = measure(models, [512], 8)  # what python -m profiling.bench.bench_rope_precision prints, small
    assert [(r["dtype"], r["rotation"]) for r in rows] == [(d, rot) for d in ("float32", "bfloat16")
                                                           for rot in ("from 0", "packed position")]
    assert all(r["floor_rms"] > 0 for r in rows)
    text = report(rows)
    assert len(text.splitlines()) == 5 and "rms / floor" in text
