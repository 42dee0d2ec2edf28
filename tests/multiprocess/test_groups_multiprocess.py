"""Tier: CPU multi-process over gloo (one module-scoped pool of 4 spawned ranks on 127.0.0.1,
tests/support/cp_harness.py). A 2-D ("dp", "cp") mesh [[0, 1], [2, 3]] and a 1-D mesh of the 4
ranks; cases: tests/support/groups_cases.py. Float64.

Process groups held as a DeviceMesh (torchtitan, the DTensor stacks): nn_data.groups resolves a 1-D
mesh, a (mesh, dim) pair and refuses the forms it cannot, and every op, adapter and drop-in function
that takes a CP or TP group gives the same result with a mesh as with its ProcessGroup.
"""

from __future__ import annotations

import pytest

from tests.support.cp_harness import RankPool

CASES = "tests.support.groups_cases:case_"


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(4)
    yield pool
    pool.close()


def test_every_mesh_form_resolves_to_the_meshs_process_group(ranks):
    results = ranks.run(CASES + "resolution", cp=1)
    assert [r["members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_members"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_forms_that_cannot_be_resolved_are_refused(ranks):
    messages = ranks.run(CASES + "refusals", cp=1)
    assert [len(m) for m in messages] == [5, 5, 6, 6]  # ranks 2 and 3 are outside new_group([0, 1])


def test_ops_adapters_and_drop_ins_take_a_mesh(ranks):
    results = ranks.run(CASES + "ops_with_a_mesh", cp=1)
    # sample_mask [1, rank]: the DP group {0, 2} sums 1 + 0 + 1 + 2 = 4, {1, 3} sums 1 + 1 + 1 + 3 = 6
    assert [r["dp_sums"]["valid_seqs"] for r in results] == [{"megatron": 4.0, "automodel": 4.0},
                                                             {"megatron": 6.0, "automodel": 6.0}] * 2
    # microbatch counts rank + 1: the largest over DP {0, 2} is 3, over {1, 3} is 4 (the world's would be 4)
    assert [r["dp_sums"]["most_microbatches"] for r in results] == [3, 4, 3, 4]


@pytest.mark.parametrize("kind", ["llama", "lfm2"])
def test_packed_forward_with_the_hf_adapter_takes_a_mesh(ranks, kind):
    for worst in ranks.run(CASES + "packed_forward_with_a_mesh", kind, cp=1):
        assert worst < 1e-12, worst
