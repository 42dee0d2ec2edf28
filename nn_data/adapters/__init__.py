"""Adapters that make real model stacks :class:`~nn_data.packed_forward.PackedForward` models.

* :class:`HFCausalLMAdapter` (``nn_data.adapters.hf``): a Hugging Face transformers causal LM;
* :class:`MegatronGPTAdapter` and :func:`megatron_gpt_layer_spec` (``nn_data.adapters.megatron_gpt``):
  a megatron-core ``GPTModel`` with nn_data's packed attention;
* :func:`pipeline_forward_step` (``nn_data.adapters.megatron_pipeline``): a ``forward_step_func``
  for megatron-core's pipeline schedules that packs every microbatch to one ``T``;
  :func:`dynamic_cp_forward_step` the same for the rounds of a dynamic-CP step;
* ``nn_data.adapters.tree_kv`` (a module, its ``__all__``): TransformerEngine's separate query and
  key/value boundaries of a shared-prefix microbatch.

Importing this package imports neither transformers nor megatron-core (each costs seconds);
the names load their module on first use. The CPU-only patches of megatron-core live in
``nn_data.adapters._megatron_cpu`` (documented there).
"""

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
