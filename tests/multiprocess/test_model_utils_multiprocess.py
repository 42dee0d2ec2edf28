"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port per pool).

``nn_data.nemo_rl.model_utils`` (NeMo-RL's log-prob functions) on 4 ranks under megatron-core's
``parallel_state``: CP 2 (two CP groups side by side, data parallel to each other) and TP 2 x CP 2.
Each rank's values equal the NeMo-RL-semantics loop oracle on every position and its local gradient
equals ``C`` times its shard of the single-process one, to 1e-10 in float64, chunked and not, with
and without top-k / top-p, targets rolled inside or pre-rolled; plus the host-sync and collective
counts and the errors that need a CP group. Cases: ``tests/support/model_utils_cases.py``. NeMo-RL's entropy,
distillation and vocabulary-parallel helpers against oracles of its semantics on the full logits: cases in
``tests/support/distillation_cases.py``.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool
from tests.support.model_utils_cases import SAMPLINGS

WORLD = 4
CASES = "tests.support.model_utils_cases:case_"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["C2", "TP2xC2"])
def layout(request):
    """Module-scoped: every test of one layout runs before parallel_state is re-initialised."""
    return request.param


def _run(ranks, case, *args, layout):
    cp, tp = layout
    return ranks.run(CASES + case, *args, cp=cp, tp=tp)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_packed_values_and_gradients_equal_nemo_rls_semantics(ranks, layout, sampling):
    results = _run(ranks, "packed", sampling, layout=layout)
    cp, tp = layout
    assert sorted({r[:2] for r in results}) == [(c, t) for c in range(cp) for t in range(tp)]
    assert all(r[2] == 12 for r in results)  # 3 layouts x chunked or not x pre-rolled or not


@pytest.mark.parametrize("sampling", ["none", "top-k+top-p"])
def test_unpacked_rows_values_and_gradients_equal_nemo_rls_semantics(ranks, layout, sampling):
    _run(ranks, "rows", sampling, layout=layout)


def test_out_of_vocabulary_targets_get_nemo_rls_gradient(ranks, layout):
    _run(ranks, "out_of_vocab", layout=layout)


def test_allgather_cp_sharded_tensor_gathers_and_sums_gradients(ranks, layout):
    _run(ranks, "allgather", layout=layout)


def test_no_host_sync_one_cp_all_gather_and_one_reduce_scatter(ranks, layout):
    calls = _run(ranks, "counts", layout=layout)
    assert calls[0][-1] == "all_gather_into_tensor"


def test_errors_that_need_a_cp_group(ranks, layout):
    _run(ranks, "errors", layout=layout)


HEAD = "tests.support.distillation_cases:case_"


@pytest.mark.parametrize("case", ["entropy_and_gather_logprob", "cross_entropy_and_topk",
                                  "gather_logits_and_distillation", "vocab_parallel_helpers", "errors"])
def test_entropy_distillation_and_vocab_parallel_helpers_equal_nemo_rls_semantics(ranks, layout, case):
    cp, tp = layout
    results = ranks.run(HEAD + case, cp=cp, tp=tp)
    assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]
