"""A tiny megatron-core ``GPTModel`` built with nn_data's packed attention, for tests and examples.

Nothing is downloaded: the model comes from a ``TransformerConfig``. Its parameters are set
from their *global* names (``decoder.layers.<global index>...``, one seeded generator per name),
so a pipeline stage (``pre_process`` / ``post_process``, a slice of the layers) holds exactly
the values the same parameters have in the whole model: PP = 2 and PP = 1 runs start equal.

RoPE's ``inv_freq`` stays as megatron-core keeps it, float32 in a plain attribute that
``Module.to(dtype)`` does not convert: a float64 or bf16 model computes its rotation angles in
float32, as megatron-core's own models do. This module imports megatron-core.
"""

from __future__ import annotations

import re
import warnings
import zlib

import torch
import torch.nn.functional as F

from nn_data.adapters.megatron_gpt import megatron_gpt_layer_spec

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def tiny_gpt_config(*, layers: int = 2, hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128,
                    dtype: torch.dtype = torch.float32, pipeline: int = 1) -> "TransformerConfig":
    """A small Llama-like ``TransformerConfig``: RMSNorm, SwiGLU, no biases, grouped-query attention,
    no dropout, CPU initialisation; ``pipeline`` stages (``pipeline_dtype = dtype``, no p2p sync)."""
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, use_cpu_initialization=True, normalization="RMSNorm", attention_dropout=0.0,
        hidden_dropout=0.0, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        params_dtype=dtype, pipeline_model_parallel_size=pipeline, pipeline_dtype=dtype,
        batch_p2p_sync=False, calculate_per_token_loss=True,
    )


def tiny_gpt_model(config: "TransformerConfig", *, vocab: int = 97, max_len: int = 4096, pre_process: bool = True,
                   post_process: bool = True, seed: int = 0) -> "GPTModel":
    """``GPTModel`` with :func:`~nn_data.adapters.megatron_gpt_layer_spec`, RoPE, untied output
    layer, in ``config.params_dtype``, parameters set by global name from ``seed``. Under pipeline
    parallelism (megatron-core's ``parallel_state``) it holds this stage's layers only."""
    model = GPTModel(
        config, megatron_gpt_layer_spec(normalization="RMSNorm"), vocab_size=vocab, max_sequence_length=max_len,
        pre_process=pre_process, post_process=post_process, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(config.params_dtype)
    init_by_global_name(model, seed)
    return model


def global_parameter_names(model: "GPTModel") -> dict:
    """``{local name: global name}``: a stage's ``decoder.layers.<i>`` is layer ``layer_number - 1``
    of the whole model (e.g. stage 2 of 2, 4 layers: ``decoder.layers.0.x`` -> ``decoder.layers.2.x``)."""
    out = {}
    for name, _ in model.named_parameters():
        match = _LAYER.match(name)
        if match:
            number = model.decoder.layers[int(match.group(1))].layer_number  # 1-based, global
            name_global = f"decoder.layers.{number - 1}." + name[match.end():]
        else:
            name_global = name
        out[name] = name_global
    return out


@torch.no_grad()
def init_by_global_name(model: "GPTModel", seed: int = 0) -> None:
    """Set every parameter from a generator seeded by ``seed`` and its global name: ``N(0, 0.05^2)``,
    ``1 + N(0, 0.05^2)`` for norm weights."""
    names = global_parameter_names(model)
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(names[name].encode()))
        values = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05
        if "norm" in names[name]:
            values += 1.0
        p.copy_(values.to(p.dtype))


def causal_attention_mask(length: int, device=None) -> torch.Tensor:
    """megatron-core's mask for one unpacked sequence: ``[1, 1, L, L]`` bool, True = masked out."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


class _NoContextParallel:
    """What megatron-core's unpacked rotary embedding asks of its CP group (``size()``): one rank."""

    @staticmethod
    def size() -> int:
        return 1

    @staticmethod
    def rank() -> int:
        return 0


def forward_alone(model: "GPTModel", input_ids: torch.Tensor) -> torch.Tensor:
    """One unpacked sequence ``[1, L]`` through megatron-core's stock path (no packing, the stock
    ``DotProductAttention`` forward with a causal mask): logits ``[1, L, V]``.

    The whole sequence runs on this rank even under CP: megatron-core's unpacked path would
    shard the rotary embedding over ``parallel_state``'s CP group, so for this call the rotary
    embedding sees a group of one rank (and its cache of embeddings is cleared around the call).
    """
    length = input_ids.shape[1]
    position_ids = torch.arange(length, device=input_ids.device)[None]
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return model(input_ids, position_ids, causal_attention_mask(length, input_ids.device))
    group, rope.cp_group = rope.cp_group, _NoContextParallel()
    type(rope).forward.cache_clear()
    try:
        return model(input_ids, position_ids, causal_attention_mask(length, input_ids.device))
    finally:
        rope.cp_group = group
        type(rope).forward.cache_clear()
