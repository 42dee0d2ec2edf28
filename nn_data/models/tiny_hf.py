"""Tiny Hugging Face causal LMs built from a config (nothing is downloaded), for tests and examples."""

from __future__ import annotations

import torch


def tiny_hf_model(kind: str = "llama", *, vocab: int = 97, hidden: int = 64, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, ffn: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0,
                  attn_implementation: str = "sdpa"):
    """A randomly initialised ``LlamaForCausalLM`` (``kind="llama"``) or ``Qwen2ForCausalLM``
    (``"qwen2"``: biases on q/k/v) with grouped-query attention, in ``dtype``, eval mode.

    Raises ``ValueError`` for another ``kind``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if kind not in classes:
        raise ValueError(f"kind={kind!r} is invalid; expected one of {sorted(classes)}")
    config_cls, model_cls = classes[kind]
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, attention_dropout=0.0,
                        tie_word_embeddings=False, attn_implementation=attn_implementation)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        return model_cls(config).to(dtype).eval()
