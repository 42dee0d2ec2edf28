"""Small models that prove the packed layout end to end (tests, examples, the profiler): the tiny
transformer that follows ``PackedForward``'s contract, and builders of tiny HF and megatron-core
models. The document mask the adapters use is :mod:`nn_data.masks`."""

from nn_data.models.tiny_transformer import TinyCausalLM, rope

__all__ = ["TinyCausalLM", "rope"]
