"""Token log-probs, in one home (``docs/logprobs.md``): the vocabulary-parallel kernels and the ops on them.

* :mod:`~nn_data.logprobs.kernels`: the one chunked, vocabulary-parallel head kernel, from logits or from
  hidden states and the output weight; :func:`token_logprobs_local` and :func:`hidden_logprobs_local` are
  it with only the target's log-prob asked;
* :mod:`~nn_data.logprobs.outputs`: the head's outputs in one chunked pass (:func:`head_outputs_local`:
  log-probs at given ids, entropy, top-k log-probs and ids, argmax, under an optional sampling filter;
  :class:`HeadOutputs`), behind ``TokenLogProbs.outputs`` and ``TokenLogProbsFromHidden.outputs``;
* :mod:`~nn_data.logprobs.filters`: top-k / top-p as one threshold per row (:class:`SamplingFilter`);
* :mod:`~nn_data.logprobs.from_logits`: :class:`TokenLogProbs`, and the steps every op here shares (the
  call's layout, each rank's targets, the rows from the gathered values);
* :mod:`~nn_data.logprobs.from_hidden`: :class:`TokenLogProbsFromHidden` (the LM head fused in);
* :mod:`~nn_data.logprobs.from_tree`: :class:`TreeLogProbs` and
  :class:`TreeLogProbsFromHidden`, per rollout of a shared-prefix microbatch.

The NeMo-RL functions (:mod:`nn_data.nemo_rl.model_utils`, :mod:`nn_data.nemo_rl.linear_ce`) call these. The
0.1.x path ``nn_data.sampling`` is :mod:`~nn_data.logprobs.filters` (``nn_data._alias.MOVED``, with a warning).
"""

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

