"""Tier: helper (no tests). Every causal-LM family of the installed transformers, built tiny from its config class (nothing downloaded).

The families are read from transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and built at the sizes of
:data:`TINY` under whatever names their config gives them; a family that cannot be is reported with the reason
(:class:`Unbuilt`). :data:`VARIANTS` adds configurations of one family that change how attention is shaped."""

from __future__ import annotations

import inspect
import re
from typing import NamedTuple, Optional

import torch

#: The tiny sizes, by the names transformers' configs use (or map to through ``attribute_map``).
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, head_dim=16, max_position_embeddings=128,
            # MoE: 4 experts, top 2
            num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
            moe_topk=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1,
            # multi-latent attention, partial rotary, other feed-forward names
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8,
            n_inner=128, ffn_dim=128, pad_token_id=0)
#: Sizes under names of one family's own (state-space heads and chunks), on top of :data:`TINY`.
OWN_SIZES = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, chunk_size=8, expand=2),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
}
#: A sliding window small enough to matter at the matrix's lengths (set where the config's default is a window).
WINDOW = 3
#: Most parameters a family may have at the tiny sizes (larger: a size the generic names miss).
MAX_PARAMS = 3_000_000


class Family(NamedTuple):
    """One matrix entry: a name (the model type, or ``type:variant``), the model type, the model class
    name and the config overrides of a variant (``{}`` for the family as shipped, at the tiny sizes)."""

    name: str
    model_type: str
    model_class: str
    overrides: dict


class Unbuilt(Exception):
    """A family that cannot be built tiny on this CPU; the message says why."""


#: Configurations of one family that change how attention is shaped, each once in the matrix.
VARIANTS = {
    "qwen2_moe:sliding": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "phimoe:sliding": ("phimoe", dict(sliding_window=WINDOW)),
    "doge:dynamic_mask": ("doge", dict(keep_window_size=WINDOW)),
    "llama:rope_dynamic": ("llama", dict(max_position_embeddings=8,
                                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    "llama:rope_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0))),
    "phi3:longrope": ("phi3", dict(max_position_embeddings=32, original_max_position_embeddings=8,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                                        original_max_position_embeddings=8))),
    "gemma3_text:bidirectional": ("gemma3_text", dict(use_bidirectional_attention=True)),
}


def families() -> list:
    """Every causal-LM family of the installed transformers (sorted by model type), then :data:`VARIANTS`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = [Family(t, t, cls, {}) for t, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]
    out += [Family(name, t, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t], dict(o)) for name, (t, o) in VARIANTS.items()]
    return out


def tiny_config(family: Family):
    """The family's config at the tiny sizes (with its variant's overrides); raises :class:`Unbuilt`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[family.model_type]
    if getattr(config_cls, "sub_configs", None):
        raise Unbuilt(f"composite config ({', '.join(sorted(config_cls.sub_configs))}): not a text-only decoder")
    params = inspect.signature(config_cls.__init__).parameters
    aliases = getattr(config_cls, "attribute_map", None) or {}
    kwargs = {}
    for key, value in TINY.items():
        name = key if key in params else aliases.get(key)
        if name in params:
            kwargs[name] = value
    if "sliding_window" in params and isinstance(params["sliding_window"].default, int):
        kwargs["sliding_window"] = WINDOW
    if "is_decoder" in params:  # encoders shipped with a causal-LM head: the head's own setting
        kwargs["is_decoder"] = True
    kwargs.update(OWN_SIZES.get(family.model_type, {}))
    kwargs.update(family.overrides)
    try:
        config = config_cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - any rejection of the sizes is the reason reported
        raise Unbuilt(f"config rejects the tiny sizes: {_first_line(e)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise Unbuilt("encoder-decoder: not a decoder-only causal LM")
    return config


def build(family: Family, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The family's model at the tiny sizes, eval mode, SDPA attention where it has a choice; raises
    :class:`Unbuilt` (with the reason) when it cannot be built, is not tiny at these sizes, or its own
    forward fails on one sequence of 6 tokens."""
    import transformers

    config = tiny_config(family)
    model_cls = getattr(transformers, family.model_class)
    # The size is counted on the meta device first (no memory). A meta build can also fail for a reason of
    # the meta kernels alone (after a torch.compile in the same process, torch's prims check devices on
    # meta: "Tensor on device meta is not on the expected device cpu" for Phi-3's longrope), so a failed
    # meta build falls through to the real build, which is counted instead.
    params = _meta_params(model_cls, config)
    if params is not None and params > MAX_PARAMS:
        raise Unbuilt(f"not tiny at the generic sizes ({params / 1e6:.0f}M parameters)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = model_cls(config).to(dtype).eval()
        except Exception as e:  # noqa: BLE001
            raise Unbuilt(f"does not build: {_first_line(e)}") from None
    params = sum(p.numel() for p in model.parameters()) if params is None else params
    if params > MAX_PARAMS:
        raise Unbuilt(f"not tiny at the generic sizes ({params / 1e6:.0f}M parameters)")
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(1, 7)[None], use_cache=False)
    except Exception as e:  # noqa: BLE001
        raise Unbuilt(f"its own forward fails on one sequence: {_first_line(e)}") from None
    return model


def _meta_params(model_cls, config) -> Optional[int]:
    """The model's parameter count from a build on the meta device, None when that build fails."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in model_cls(config).parameters())
    except Exception:  # noqa: BLE001 - the real build then reports (or succeeds)
        return None


def _first_line(error: BaseException, limit: int = 90) -> str:
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = f"{type(error).__name__}: {lines[-1] if 'validation error' in text and lines else (lines or [''])[0]}"
    line = re.sub(r"0x[0-9a-fA-F]+", "0x...", line.replace("|", "/"))
    return line if len(line) <= limit else line[: limit - 3] + "..."


def find(name: str) -> Optional[Family]:
    """The family (or variant) called ``name``, None if there is none."""
    return next((f for f in families() if f.name == name), None)
