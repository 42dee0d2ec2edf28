"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port per pool).

A rollout tree's per-rollout log-probs under megatron-core's ``parallel_state`` on 4 ranks: CP 2 (two CP
groups side by side), TP 2 x CP 2, CP 4; from packed logits and from hidden states + the output weight,
every rank's rows equal each rollout run alone and its input's gradient is its part of the single-process
one (float64, 1e-10); from logits, no host sync. The head's other outputs (entropy, top-k, argmax) on trees of
depth 3 and 4 at CP 2 and TP 2 x CP 2 with sequence parallelism, from hidden states and logits. Cases: ``tests/support/tree_logprob_cases.py``.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool

pytestmark = pytest.mark.multiprocess
CASES = "tests.support.tree_logprob_cases:case_"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("cp, tp", [(2, 1), (2, 2), (4, 1)], ids=["C2", "TP2xC2", "C4"])
def test_tree_log_probs_equal_every_rollout_alone(ranks, cp, tp):
    for case in ("logits", "hidden"):
        results = ranks.run(CASES + case, cp=cp, tp=tp)
        assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]


@pytest.mark.parametrize("cp, tp, sequence_parallel", [(2, 1, False), (2, 2, True)], ids=["C2", "TP2xC2-SP"])
def test_entropy_top_k_and_argmax_on_trees_equal_every_rollout_alone(ranks, cp, tp, sequence_parallel):
    results = ranks.run(CASES + "outputs", sequence_parallel, cp=cp, tp=tp)
    assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]
