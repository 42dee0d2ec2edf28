"""NeMo-RL's sampling parameters for its log-prob functions (the filter itself is the core's,
:func:`nn_data.logprobs.sampling_filter`, which reads ``top_k`` / ``top_p`` by attribute)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainingSamplingParams:
    """NeMo-RL's ``TrainingSamplingParams`` (same fields and defaults), for callers without NeMo-RL;
    nn_data reads ``top_k`` and ``top_p`` from NeMo-RL's own dataclass just as well. ``temperature``
    is applied by the caller (NeMo-RL divides the logits before calling the log-prob functions)."""

    top_k: Optional[int] = None
    top_p: float = 1.0
    temperature: float = 1.0

__all__ = [
    "TrainingSamplingParams",
]
