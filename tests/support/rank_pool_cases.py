"""Cases for tests/multiprocess/test_rank_pool.py: what a spawned rank of tests/support/cp_harness.py
does when a case fails, hangs or dies, and one that works (to show the pool after them is fresh)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def case_sum_and_pid(value: int) -> tuple:
    """``(sum of value over the ranks, this rank's pid)``: a working collective, and which process ran it."""
    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t), os.getpid()


def case_fails_on(bad_rank: int) -> None:
    """``bad_rank`` raises; every other rank then waits in a collective that rank never joins."""
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {bad_rank}")
    dist.all_reduce(torch.zeros(1))


def case_hangs_on(bad_rank: int) -> int:
    """``bad_rank`` sleeps far past any budget (in ``_stuck_here``, which its stack must name)."""
    if dist.get_rank() == bad_rank:
        _stuck_here()
    return dist.get_rank()


def _stuck_here() -> None:
    time.sleep(3600)


def case_dies_on(bad_rank: int) -> int:
    """``bad_rank`` leaves at once with exit code 3, without reporting."""
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()
