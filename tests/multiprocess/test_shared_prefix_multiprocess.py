"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port per pool).

A shared-prefix microbatch's rollout log-probs under megatron-core's ``parallel_state`` on 4 ranks:
CP 2 (two CP groups side by side), TP 2, TP 2 x CP 2, CP 4, and from hidden states with sequence
parallelism at TP 2 and TP 2 x CP 2. From packed logits and from hidden states + the output weight, every rank's rows equal each rollout run alone and its gradients are its part of
the single-process ones (float64, 1e-10); from logits, no host sync and one CP all-gather per call; the entropy,
top-k and argmax (``outputs()``) equal each rollout alone's. Cases:
``tests/support/shared_prefix_cases.py``.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool

WORLD = 4
CASES = "tests.support.shared_prefix_cases:case_"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


@pytest.mark.parametrize("cp, tp", [(2, 1), (1, 2), (2, 2), (4, 1)], ids=["C2", "TP2", "TP2xC2", "C4"])
def test_rollout_log_probs_equal_every_rollout_alone(ranks, cp, tp):
    for case in ("logits", "hidden"):
        results = ranks.run(CASES + case, cp=cp, tp=tp)
        assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]


@pytest.mark.parametrize("cp, tp", [(1, 2), (2, 2)], ids=["TP2", "TP2xC2"])
def test_sequence_parallel_hidden_log_probs_equal_every_rollout_alone(ranks, cp, tp):
    results = ranks.run(CASES + "hidden", True, cp=cp, tp=tp)
    assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]


@pytest.mark.parametrize("cp, tp, sequence_parallel", [(2, 1, False), (1, 2, True), (2, 2, False), (4, 1, False)],
                         ids=["C2", "TP2-SP", "TP2xC2", "C4"])
def test_entropy_top_k_and_argmax_equal_every_rollout_alone(ranks, cp, tp, sequence_parallel):
    results = ranks.run(CASES + "outputs", sequence_parallel, cp=cp, tp=tp)
    assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]
