"""megatron-core style config dicts for the nn_data.nemo_rl.megatron_data tests."""

from __future__ import annotations


def megatron_cfg(tp=1, sp=False, pp=1, cp=1, fp8=None, dispatcher=None, backend=None) -> dict:
    cfg = {"tensor_model_parallel_size": tp, "sequence_parallel": sp, "pipeline_model_parallel_size": pp,
           "context_parallel_size": cp}
    if fp8 is not None:
        cfg["fp8_cfg"] = {"enabled": True, "fp8_recipe": fp8}
    if dispatcher is not None:
        cfg["moe_token_dispatcher_type"] = dispatcher
    if backend is not None:
        cfg["moe_flex_dispatcher_backend"] = backend
    return cfg
