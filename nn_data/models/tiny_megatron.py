"""A tiny megatron-core ``GPTModel`` built with nn_data's packed attention, for tests and examples.

Its parameters are set from their *global* names (one seeded generator per name), so a pipeline stage holds
exactly the values the same parameters have in the whole model. RoPE's ``inv_freq`` stays float32, as
megatron-core keeps it. This module imports megatron-core."""

from __future__ import annotations

import contextlib
import re
from typing import Any
import warnings
import zlib

import torch
import torch.nn.functional as F

from nn_data.adapters.megatron_gpt import megatron_gpt_layer_spec
from nn_data.groups import OneRankGroup

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def tiny_gpt_config(*, layers: int = 2, hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128,
                    dtype: torch.dtype = torch.float32, pipeline: int = 1, virtual_stages: int = None,
                    experts: int = 0, topk: int = 2) -> "TransformerConfig":
    """A small Llama-like ``TransformerConfig`` (RMSNorm, SwiGLU, no biases, grouped-query attention, no dropout, CPU
    initialisation); ``pipeline`` stages and ``virtual_stages`` chunks per stage (``batch_p2p_comm=False``,
    docs/pipeline.md); ``experts > 0``: dropless MoE MLPs of ``experts`` experts (top-``topk``, no auxiliary loss,
    no expert bias) with megatron-core's ``allgather`` dispatcher (the one that runs on a CPU over gloo)."""
    moe = {}
    if experts:
        moe = dict(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn // 2,
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
    interleaved = {}
    if virtual_stages is not None:
        interleaved = dict(virtual_pipeline_model_parallel_size=virtual_stages, batch_p2p_comm=False)
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, use_cpu_initialization=True, normalization="RMSNorm", attention_dropout=0.0,
        hidden_dropout=0.0, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        params_dtype=dtype, pipeline_model_parallel_size=pipeline, pipeline_dtype=dtype,
        batch_p2p_sync=False, calculate_per_token_loss=True, **moe, **interleaved,
    )


def tiny_gpt_model(config: "TransformerConfig", *, vocab: int = 97, max_len: int = 4096, pre_process: bool = True,
                   post_process: bool = True, seed: int = 0, pg_collection=None, vp_stage=None,
                   position_embedding: str = "rope") -> "GPTModel":
    """``GPTModel`` with :func:`~nn_data.adapters.megatron_gpt_layer_spec`, RoPE, an untied output layer, in
    ``config.params_dtype``, parameters set by global name from ``seed``; under pipeline parallelism this stage's
    layers only (of virtual stage ``vp_stage``). ``position_embedding="none"``: no rotary embedding (megatron-core's
    THD rotary embedding reads the boundaries on the host, which a CUDA-graph capture refuses)."""
    spec = megatron_gpt_layer_spec(normalization="RMSNorm", num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    extra = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = GPTModel(
        config, spec, vocab_size=vocab, max_sequence_length=max_len,
        pre_process=pre_process, post_process=post_process, position_embedding_type=position_embedding,
        share_embeddings_and_output_weights=False, pg_collection=pg_collection, **extra,
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


def forward_alone(model: "GPTModel", input_ids: torch.Tensor) -> torch.Tensor:
    """One unpacked sequence ``[1, L]`` through megatron-core's stock path (the stock ``DotProductAttention`` with a
    causal mask): logits ``[1, L, V]``. The whole sequence runs on this rank even under CP (the rotary embedding
    sees a group of one rank for the call), and a global memory buffer is set for the call where
    ``parallel_state`` has none."""
    length = input_ids.shape[1]
    position_ids = torch.arange(length, device=input_ids.device)[None]
    rope = getattr(model, "rotary_pos_emb", None)
    with _score_buffer():
        if rope is None:
            return model(input_ids, position_ids, causal_attention_mask(length, input_ids.device))
        group, rope.cp_group = rope.cp_group, OneRankGroup()
        type(rope).forward.cache_clear()
        try:
            return model(input_ids, position_ids, causal_attention_mask(length, input_ids.device))
        finally:
            rope.cp_group = group
            type(rope).forward.cache_clear()


@contextlib.contextmanager
def _score_buffer():
    """megatron-core's global memory buffer for the duration, when ``parallel_state`` has none."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        yield
        return
    parallel_state._set_global_memory_buffer()
    try:
        yield
    finally:
        parallel_state.destroy_global_memory_buffer()


#: The grid's dimensions, fastest-varying first: megatron-core's default order ``tp-cp-ep-dp-pp``.
GRID_DIMS = ("tp", "cp", "ep", "dp", "pp")


def grid_process_groups(*, tp: int = 1, cp: int = 1, pp: int = 1) -> Any:
    """The process groups of a ``tp x cp x dp x pp`` layout over the whole world (``dp`` the rest), built as
    Megatron-Bridge builds them without ``parallel_state``: a ``HyperCommGrid`` and a ``ProcessGroupCollection``
    of its groups. Every rank calls it with the same sizes (a collective); undo with :func:`destroy_process_groups`.

    Example (4 ranks): ``grid_process_groups(cp=2)`` -> CP groups ``{0, 1}`` and ``{2, 3}``, DP
    groups ``{0, 2}`` and ``{1, 3}``; ``parallel_state`` stays uninitialised."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.hyper_comm_grid import HyperCommGrid
        from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"tp={tp} x cp={cp} x pp={pp} does not divide the world of {world} ranks")
    grid = HyperCommGrid([tp, cp, 1, world // (tp * cp * pp), pp], list(GRID_DIMS))
    made = {key: grid.create_pg(dims) for key, dims in (
        ("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("ep", "ep"), ("dp_cp", ["cp", "dp"]),
        ("tp_cp", ["tp", "cp"]), ("tp_dp_cp", ["tp", "cp", "dp"]), ("mp", ["tp", "pp"]),
        ("tp_ep", ["tp", "ep"]), ("tp_ep_pp", ["tp", "ep", "pp"]))}
    made.update(expt_tp=made["tp"], expt_dp=made["dp_cp"])  # expert parallel size 1: the dense groups
    stages = grid.get_rank_enum("pp")  # every pipeline's ranks, first stage first
    made["embd"], _ = dist.new_subgroups_by_enumeration([sorted({r[0], r[-1]}) for r in stages])
    made["pos_embd"], _ = dist.new_subgroups_by_enumeration([[r[0]] for r in stages])
    return ProcessGroupCollection(**made)


def destroy_process_groups(pg_collection) -> None:
    """Destroy every process group ``pg_collection`` holds (each once; the world group never)."""
    import torch.distributed as dist

    seen = set()
    for group in vars(pg_collection).values():
        if isinstance(group, dist.ProcessGroup) and id(group) not in seen and group is not dist.group.WORLD:
            seen.add(id(group))
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # gone already
                pass
