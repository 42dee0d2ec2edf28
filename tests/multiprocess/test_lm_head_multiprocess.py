"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port per pool).

Log-probs from hidden states under context and tensor parallelism, 4 ranks under megatron-core's
``parallel_state``: CP 2 (two CP groups side by side), TP 2 (two TP groups side by side), TP 2 x CP 2;
with and without sequence parallelism. ``TokenLogProbsFromHidden``: every rank's rows equal the
single-process oracle's, its hidden-state gradient is its part of the single-process one and its weight
gradient, summed over the CP group, its rows of the single-process one (1e-10, float64); the host syncs
and collectives of one call. The NeMo-RL drop-in from hidden states, packed and unpacked: NeMo-RL's
values and ``C``-times gradients. Every output of the head (log-probs, entropy, top-k, argmax), also under a
top-k / top-p sampling filter. Cases: ``tests/support/lm_head_cases.py``.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool

WORLD = 4
CASES = "tests.support.lm_head_cases:case_"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=[(2, 1, False), (1, 2, False), (1, 2, True), (2, 2, False), (2, 2, True)],
                ids=["C2", "TP2", "TP2-SP", "TP2xC2", "TP2xC2-SP"])
def split(request):
    """``(cp, tp, sequence_parallel)``; module-scoped: every test of one split runs before parallel_state
    is re-initialised."""
    return request.param


def _run(ranks, case, *args, split):
    cp, tp, _ = split
    return ranks.run(CASES + case, *args, cp=cp, tp=tp)


def test_rows_and_gradients_equal_the_single_process_ones(ranks, split):
    cp, tp, sequence_parallel = split
    results = _run(ranks, "core", sequence_parallel, split=split)
    assert sorted({r[:2] for r in results}) == [(c, t) for c in range(cp) for t in range(tp)]
    assert all(r[2] == 12 for r in results)  # 3 microbatches x 2 temperatures / chunks x the layout or the boundaries


def test_no_host_sync_and_the_collectives_of_one_call(ranks, split):
    _run(ranks, "counts", split[2], split=split)


def test_nemo_rl_drop_in_from_hidden_states_packed_and_rows(ranks, split):
    _run(ranks, "dropin_packed", split[2], split=split)
    _run(ranks, "dropin_rows", split[2], split=split)


def test_hidden_states_that_are_not_this_ranks_share_are_refused(ranks, split):
    _run(ranks, "errors", split=split)


def test_every_output_equals_the_oracle_from_hidden_states_and_from_logits(ranks, split):
    _run(ranks, "outputs", split[2], split=split)


def test_every_output_equals_the_oracle_at_cp_4(ranks):
    assert sorted(ranks.run(CASES + "outputs", False, cp=4, tp=1)) == [(r, 0) for r in range(4)]


def test_every_output_under_a_top_k_top_p_filter_equals_the_oracle(ranks, split):
    results = _run(ranks, "filtered_outputs", split[2], split=split)
    assert all(r[2] > 0 and r[3] > 0 for r in results)  # some top-k entries and some targets filtered out
