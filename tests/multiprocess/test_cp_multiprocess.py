"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port per pool).

Context parallelism as users run it: 4 processes, megatron-core's
``parallel_state.initialize_model_parallel(context_parallel_size=C)`` for C in {2, 4}
(with C = 2 the other two ranks form a second CP group, data parallel to the first),
plus tensor-parallel layouts for vocab-parallel logits. One pool of ranks serves
every test of this module (spawning and importing megatron-core costs seconds per
process); the cases live in ``tests/support/cp_cases.py`` and compare each rank's result with the
single-process one and the loop references in ``nn_data.testing.reference``.
"""

from __future__ import annotations

import pytest

from tests.support.cp_cases import SHARD_PRODUCERS
from tests.support.cp_harness import RankPool

WORLD = 4


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda c: f"C{c}")
def cp(request):
    """Module-scoped so pytest runs every C=2 test, then every C=4 test: parallel_state is
    re-initialised once per layout rather than once per test."""
    return request.param


def _per_cp_rank(cp: int) -> list[int]:
    """What a case returning ``cp.rank`` gives on the 4 ranks (CP groups are consecutive ranks)."""
    return [r % cp for r in range(WORLD)]


@pytest.mark.parametrize("producer", sorted(SHARD_PRODUCERS))
def test_each_rank_shard_gathers_back_to_the_packed_tensor(ranks, cp, producer):
    # zero-length rows, pad_full_seq_to tails, row capacity, no rows; input ids and routed experts
    checked = ranks.run("shard_gather_roundtrip", producer, cp=cp)
    assert all(c == checked[0] for c in checked) and len(checked[0]) == 12


def test_cp_info_from_parallel_state_or_explicit_group(ranks, cp):
    assert ranks.run("resolver", cp=cp) == _per_cp_rank(cp)


@pytest.mark.parametrize("grad_mode", ["own", "sum"])
def test_gather_backward_hands_each_rank_its_shard_gradient(ranks, cp, grad_mode):
    ranks.run("gather_backward", grad_mode, cp=cp)


def test_sharded_positions_and_targets_match_single_process(ranks, cp):
    counts = ranks.run("positions_targets", cp=cp)
    assert len(set(counts)) == 1 and counts[0] > 0


def test_cp_logprobs_and_gradients_match_single_process(ranks, cp):
    assert ranks.run("logprobs", cp=cp) == _per_cp_rank(cp)


@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 2)], ids=["TP2", "TP2xC2"])
def test_vocab_parallel_and_cp_logprobs_match_single_process(ranks, cp, tp):
    results = ranks.run("logprobs_vocab_parallel", cp=cp, tp=tp)
    assert sorted(set(results)) == [(c, t) for c in range(cp) for t in range(tp)]
