"""Adapters that make real model stacks :class:`~nn_data.packed_forward.PackedForward` models:
:class:`HFCausalLMAdapter` (transformers), :class:`MegatronGPTAdapter` and :func:`megatron_gpt_layer_spec`
(megatron-core), :func:`pipeline_forward_step` and :func:`dynamic_cp_forward_step` (megatron-core's
schedules), and the ``tree_kv`` module (a tree microbatch's separate query and key/value boundaries). Importing
this package imports neither transformers nor megatron-core: the names load their module on first use."""

from __future__ import annotations

import importlib

_WHERE = {
    "HFCausalLMAdapter": "nn_data.adapters.hf",
    "packed_attention": "nn_data.adapters.hf",
    "MegatronGPTAdapter": "nn_data.adapters.megatron_gpt",
    "PackedDotProductAttention": "nn_data.adapters.megatron_gpt",
    "megatron_gpt_layer_spec": "nn_data.adapters.megatron_gpt",
    "pipeline_forward_step": "nn_data.adapters.megatron_pipeline",
    "dynamic_cp_forward_step": "nn_data.adapters.megatron_pipeline",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'nn_data.adapters' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__():
    return sorted(list(globals()) + __all__)
