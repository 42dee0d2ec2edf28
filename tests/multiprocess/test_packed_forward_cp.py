"""Tier: CPU multi-process over gloo (a pool of 4 spawned ranks on 127.0.0.1, tests/support/cp_harness.py;
C=2 runs as two CP groups side by side, C=4 as one), megatron-core parallel_state for the groups.

PackedForward under real context parallelism: outputs and gradients equal the single-process run.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("cp", [2, 4], ids=lambda c: f"C{c}")
def test_packed_forward_cp_matches_single_process(rank_pool, cp):
    results = rank_pool.run("tests.support.packed_forward_cases:case_equivalence", cp=cp)
    assert results == [(r % cp, 4) for r in range(4)]
