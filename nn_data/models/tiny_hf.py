"""Tiny Hugging Face causal LMs built from a config (nothing is downloaded), for tests and examples: attention
only (``llama``, ``qwen2``), sliding-window attention (``mistral``), and hybrids whose non-attention layers carry
state across tokens: gated delta nets (``qwen3_next``, ``qwen3_5``), Mamba-2 (``mamba2``, ``bamba``) and short
convolutions (``lfm2``)."""

from __future__ import annotations

import torch

#: Every kind :func:`tiny_hf_model` builds; the hybrids (non-attention token mixers) among them.
KINDS = ("llama", "qwen2", "mistral", "qwen3_next", "qwen3_5", "mamba2", "bamba", "lfm2")
HYBRIDS = ("qwen3_next", "qwen3_5", "mamba2", "bamba", "lfm2")


def _config(kind: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, window: int,
            moe: bool):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, tie_word_embeddings=False)
    attention = dict(common, intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     attention_dropout=0.0)
    mixed = ["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
    delta = dict(attention, head_dim=hidden // heads, linear_num_value_heads=heads, linear_num_key_heads=kv_heads,
                 linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads, layer_types=mixed)
    builders = {
        "llama": lambda: (tf.LlamaConfig(**attention), tf.LlamaForCausalLM),
        "qwen2": lambda: (tf.Qwen2Config(**attention), tf.Qwen2ForCausalLM),
        "mistral": lambda: (tf.MistralConfig(**attention, sliding_window=window), tf.MistralForCausalLM),
        "qwen3_next": lambda: (tf.Qwen3NextConfig(**delta, num_experts=4 if moe else 0, num_experts_per_tok=2,
                                                  moe_intermediate_size=ffn // 4,
                                                  shared_expert_intermediate_size=ffn // 4), tf.Qwen3NextForCausalLM),
        "qwen3_5": lambda: (tf.Qwen3_5TextConfig(**delta), tf.Qwen3_5ForCausalLM),
        "mamba2": lambda: (tf.Mamba2Config(**common, state_size=16, num_heads=2 * hidden // 16, head_dim=16,
                                           n_groups=1, expand=2, chunk_size=8), tf.Mamba2ForCausalLM),
        "bamba": lambda: (tf.BambaConfig(**attention, mamba_n_heads=2 * hidden // 16, mamba_d_head=16,
                                         mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8,
                                         attn_layer_indices=list(range(1, layers, 2))), tf.BambaForCausalLM),
        "lfm2": lambda: (tf.Lfm2Config(**attention, layer_types=["conv", "full_attention"] * (layers // 2)
                                       + ["conv"] * (layers % 2)), tf.Lfm2ForCausalLM),
    }
    if kind not in builders:
        raise ValueError(f"kind={kind!r} is invalid; expected one of {sorted(builders)}")
    return builders[kind]()


def tiny_hf_model(kind: str = "llama", *, vocab: int = 97, hidden: int = 64, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, ffn: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0,
                  attn_implementation: str = "sdpa", window: int = 3, moe: bool = True):
    """A randomly initialised transformers causal LM of ``kind`` (one of :data:`KINDS`, else ``ValueError``) in
    ``dtype``, eval mode. ``window``: Mistral's sliding window; ``moe``: Qwen3-Next's sparse MoE (not in float64)."""
    config, model_cls = _config(kind, vocab, hidden, layers, heads, kv_heads, ffn, window, moe)
    if kind != "mamba2":  # attention only where the model has some
        config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        return model_cls(config).to(dtype).eval()
