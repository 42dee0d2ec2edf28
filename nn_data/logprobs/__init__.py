"""Token log-probs, in one home (``docs/logprobs.md``): the vocabulary-parallel kernels and the ops on them.

``kernels`` is the one chunked head kernel (from logits, or hidden states and the output weight); ``outputs``
the head's outputs in one pass (:func:`head_outputs_local`, :class:`HeadOutputs`); ``filters`` top-k / top-p
as one threshold per row (:class:`SamplingFilter`); ``from_logits`` :class:`TokenLogProbs` and the steps every
op shares; ``from_hidden`` :class:`TokenLogProbsFromHidden`; ``from_tree`` :class:`TreeLogProbs` and
:class:`TreeLogProbsFromHidden`. The NeMo-RL functions call these."""

from __future__ import annotations

from nn_data.logprobs.filters import SamplingFilter, sampling_filter
from nn_data.logprobs.from_hidden import TokenLogProbsFromHidden
from nn_data.logprobs.from_logits import TokenLogProbs
from nn_data.logprobs.from_tree import TreeLogProbs, TreeLogProbsFromHidden
from nn_data.logprobs.kernels import hidden_logprobs_local, token_logprobs_local
from nn_data.logprobs.outputs import HeadOutputs, head_outputs_local

__all__ = [
    "HeadOutputs",
    "SamplingFilter",
    "TreeLogProbs",
    "TreeLogProbsFromHidden",
    "TokenLogProbs",
    "TokenLogProbsFromHidden",
    "head_outputs_local",
    "hidden_logprobs_local",
    "sampling_filter",
    "token_logprobs_local",
]

