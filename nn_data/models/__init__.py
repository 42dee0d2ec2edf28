"""Small models used to prove the packed layout end to end (tests, examples), and the document mask."""

from nn_data.models.masks import DocumentMask, document_attention, document_causal_mask, document_mask
from nn_data.models.tiny_transformer import TinyCausalLM, rope

__all__ = ["TinyCausalLM", "DocumentMask", "document_attention", "document_causal_mask", "document_mask", "rope"]
