"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port).

The CP log-prob path with its all-gather (a functional collective inside an autograd
Function) compiled with ``torch.compile(fullgraph=True)`` on 2 ranks under megatron-core's
``parallel_state`` (CP=2): one frame for a stream of microbatches whose row length S varies
(12 distinct S, 0 and 1 included) and whose row count varies under a row capacity (no rows too),
forward and backward equal to eager. Kept apart
from test_cp_multiprocess.py because compiling costs ~15-20 s per rank on the 2-core CPU.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(2)
    yield pool
    pool.close()


def test_compiled_cp_logprobs_one_frame_and_equal_to_eager(ranks):
    assert ranks.run("compiled_logprobs", cp=2) == [1, 1]
