"""Small models used to prove the packed layout end to end (tests, examples)."""

from nn_data.models.tiny_transformer import TinyCausalLM, document_causal_mask, rope

__all__ = ["TinyCausalLM", "document_causal_mask", "rope"]
