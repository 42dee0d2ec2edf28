"""Tier: CPU multi-process over gloo (one module-scoped pool of 2 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py, without megatron-core; cases: tests/support/rank_pool_cases.py).

The pool's own promise: one failure stays one failure. A case that raises on one rank (while the other
waits in a collective), hangs past its budget, or loses a rank fails alone, says which rank and where
(the traceback, or the hung rank's Python stack), and the next case runs on a fresh pool and passes.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.support import cp_harness
from tests.support.cp_harness import RankPool

CASES = "tests.support.rank_pool_cases"
BUDGET_S = 20.0  # each case here takes well under a second; the hang is the one that runs into it


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, megatron=False, timeout_s=BUDGET_S)
    yield ranks
    ranks.close()


def _works(pool) -> set:
    """The working case passes on every rank; returns the pids that ran it."""
    results = pool.run(f"{CASES}:case_sum_and_pid", 5, cp=None)
    assert [total for total, _ in results] == [10, 10]
    return {pid for _, pid in results}


def test_a_rank_that_raises_fails_its_case_alone(pool, monkeypatch):
    monkeypatch.setattr(cp_harness, "FAIL_GRACE_S", 5.0)  # rank 0 waits in gloo for the case budget: cut it short
    before = _works(pool)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)ranks \[1\].*deliberate failure on rank 1") as failure:
        pool.run(f"{CASES}:case_fails_on", 1, cp=None)
    # rank 0 waits in the all-reduce rank 1 never joins: it is named with its stack after the grace
    assert "rank 0 (still running" in str(failure.value) and "case_fails_on" in str(failure.value)
    assert time.monotonic() - started < BUDGET_S, "the grace after a failure, not the budget, must end the wait"
    assert _works(pool).isdisjoint(before), "the next case must run on freshly spawned ranks"


def test_a_hung_rank_is_named_with_its_stack_and_the_next_case_passes(pool):
    with pytest.raises(AssertionError, match=r"timed out after 20 s: ranks \[1\] still running") as failure:
        pool.run(f"{CASES}:case_hangs_on", 1, cp=None)
    assert "_stuck_here" in str(failure.value), str(failure.value)
    _works(pool)


def test_a_rank_that_dies_fails_fast_and_the_next_case_passes(pool):
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"on ranks \[1\]: rank\(s\) exited during the case .*\{1: 3\}"):
        pool.run(f"{CASES}:case_dies_on", 1, cp=None)
    assert time.monotonic() - started < BUDGET_S
    _works(pool)


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(cp_harness.TIMEOUT_ENV, raising=False)
    assert cp_harness.case_budget_s() == cp_harness.DEFAULT_BUDGET_S == 600.0
    monkeypatch.setenv(cp_harness.TIMEOUT_ENV, "1200")
    assert cp_harness.case_budget_s() == 1200.0
    monkeypatch.setenv(cp_harness.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"NN_DATA_RANK_TIMEOUT_S='soon' is invalid; expected a number of seconds > 0"):
        cp_harness.case_budget_s()


def test_a_port_taken_before_the_ranks_bind_it_is_retried_with_a_new_one(monkeypatch):
    """Another process may take free_port()'s port before rank 0 listens on it (two suites on one machine): the
    start-up spawns the ranks again on a new port instead of failing the case."""
    monkeypatch.setattr(cp_harness, "FAIL_GRACE_S", 5.0)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = cp_harness.free_port
    monkeypatch.setattr(cp_harness, "free_port", lambda: next(ports, None) or real())
    try:
        ranks = RankPool(2, megatron=False, timeout_s=BUDGET_S)
        try:
            assert [total for total, _ in ranks.run(f"{CASES}:case_sum_and_pid", 5, cp=None)] == [10, 10]
        finally:
            ranks.close()
    finally:
        taken.close()
