"""Tier: pure CPU, single process (numpy planning on the host).

nn_data.planning.plan_step_dynamic_cp: the guarantees (property-tested against a re-derivation), the
worked examples, the cost models, pickling and every refusal.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.errors import PackingError
from nn_data.planning import AttentionOnlyCost, CPCost, DynamicCPPlan, Parallelism, plan_step_dynamic_cp
from nn_data.planning import cp_rounds, cp_tree
from nn_data.planning.dynamic_cp_plan import parallelism_for

PROPERTIES = settings(max_examples=80, deadline=None, derandomize=True)


def _multiple(parallelism: Parallelism, c: int) -> int:
    """The per-sequence multiple for CP size ``c``, written out (the reference for the planner's)."""
    base = (2 * c if c > 1 else 1) * (parallelism.tp if parallelism.tp > 1 and parallelism.sequence_parallel else 1)
    m = parallelism.make_sequence_length_divisible_by
    return base if m is None else math.lcm(m, base)


def check_plan(plan: DynamicCPPlan, lengths, parallelism: Parallelism, tpr: int, min_cp: int = 1, cost=None) -> None:
    """Every guarantee of the module docstring, re-derived from the plan's blocks alone."""
    ranks = parallelism.dp * parallelism.cp
    cost = cost or CPCost()
    assert plan.ranks == ranks and plan.tokens_per_rank == tpr and plan.lengths == tuple(int(n) for n in lengths)
    seen = []
    step = 0.0
    for blocks in plan.rounds:
        starts = [b.start for b in blocks]
        assert starts == sorted(starts) and starts[0] == 0
        assert [b.start + b.size for b in blocks[:-1]] == starts[1:] and blocks[-1].start + blocks[-1].size == ranks
        for b in blocks:
            assert b.size & (b.size - 1) == 0 or b.size == ranks, b
            assert b.start % b.size == 0, b
            padded = [-(-lengths[i] // _multiple(parallelism, b.size)) * _multiple(parallelism, b.size) for i in b.sequences]
            assert b.tokens == sum(padded) <= b.size * tpr, b
            if b.sequences:
                assert b.size >= min_cp
                for i, n in zip(b.sequences, padded):  # the block is one of the sizes that hold it
                    assert n <= b.size * tpr
                modelled = float(np.sum(cost.sequence(np.asarray([lengths[i] for i in b.sequences]), b.size)))
                assert b.cost == pytest.approx(modelled + cost.block(b.size, tpr), rel=1e-12)
            else:
                assert b.size == 1 and b.cost == 0.0
            seen += list(b.sequences)
        step += max(b.cost for b in blocks)
    assert sorted(seen) == list(range(len(lengths)))
    assert plan.step_cost == pytest.approx(step, rel=1e-12)
    assert plan.step_over_ideal >= 1 - 1e-12  # the ideal is a lower bound of every plan
    assert plan.critical_path_over_ideal >= 1 - 1e-12 and plan.critical_path_cost <= plan.step_cost * (1 + 1e-12)
    assert plan.token_lower_bound <= plan.rounds_per_rank
    for r in range(ranks):
        assert len(plan.blocks_of(r)) == plan.rounds_per_rank
        assert all(r in b.ranks for b in plan.blocks_of(r))


def test_worked_example_of_the_module():
    lengths = [30000, 9000, 7000, 3000, 2500, 1200, 800, 500]
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=8), tokens_per_rank=4096)
    check_plan(plan, lengths, Parallelism(dp=8), 4096)
    assert [[(b.start, b.size, b.sequences) for b in blocks if b.sequences] for blocks in plan.rounds] == [
        [(0, 8, (0,))], [(0, 4, (1, 4)), (4, 4, (2, 3, 5, 6, 7))]]
    assert plan.token_lower_bound == 2 and plan.step_over_ideal == pytest.approx(1.0219, abs=1e-4)
    assert plan.cp_sizes == [8, 4, 4, 4, 4, 4, 4, 4] and plan.group_sizes == [4, 8]
    assert plan.sequences_of(5) == [0, 2, 3, 5, 6, 7] and plan.block_of(5, 1).start == 4
    assert plan.cp_collective_rounds == 2 and plan.max_sequences == 5


def test_tree_worked_example():
    """cp_tree's docstring: L^2 / c, tpr 32, 4 ranks, lengths [48, 24, 16, 8]: one block (800) beats
    halves (1152)."""
    lengths = np.asarray([48, 24, 16, 8])
    costs = _costs(lengths, [1, 2, 4], 32, AttentionOnlyCost())
    assert cp_tree.balance(costs, [0, 1, 2, 3], 2) == (800.0, [(2, [0, 1, 2, 3])])
    assert cp_tree.balance(costs, [1, 2, 3], 1) == (448.0, [(1, [1, 2, 3])])  # 896 / 2 beats 576


def _costs(lengths, sizes, tpr, cost):
    from nn_data.planning.dynamic_cp_plan import _costs as build

    parallelism = Parallelism(dp=sizes[-1])
    return build(np.asarray(lengths), sizes, {c: parallelism_for(parallelism, c).pad_multiple for c in sizes}, tpr, cost,
                 sizes[-1])[0]


def test_rounds_helpers_worked_examples():
    costs = _costs([6, 4, 4, 2], [1, 2], 8, AttentionOnlyCost())
    assert cp_rounds.chunks(costs, 2) == [[0, 1], [2, 3]]
    assert cp_rounds.laid_out([1, 4, 2], 8) == [(0, 1), (4, 2), (6, 0), (7, -1)]
    alive = cp_rounds.Alive(4)
    alive.remove(1)
    alive.remove(2)
    assert alive.find(1) == 3 and alive.find(0) == 0 and alive.left == 2


@st.composite
def steps(draw):
    ranks = draw(st.sampled_from([1, 2, 4, 8]))
    cp = draw(st.sampled_from([c for c in (1, 2, 4) if ranks % c == 0]))
    tp, sp = draw(st.sampled_from([(1, False), (2, True)]))
    parallelism = Parallelism(dp=ranks // cp, cp=cp, tp=tp, sequence_parallel=sp)
    min_cp = draw(st.sampled_from([c for c in (1, 2, 4) if c <= ranks]))
    unit = 4 * tp
    tpr = unit * draw(st.integers(1, 16))
    longest = ranks * tpr - 2 * ranks * tp  # fits the pool after its padding
    lengths = draw(st.lists(st.integers(0, max(0, longest)), max_size=40))
    return parallelism, tpr, min_cp, lengths


@PROPERTIES
@given(steps(), st.sampled_from(["cp", "attention"]))
def test_every_plan_keeps_every_guarantee(step, model):
    parallelism, tpr, min_cp, lengths = step
    cost = CPCost(hidden_size=64) if model == "cp" else AttentionOnlyCost()
    plan = plan_step_dynamic_cp(lengths, parallelism, tokens_per_rank=tpr, min_cp=min_cp, cost=cost)
    check_plan(plan, lengths, parallelism, tpr, min_cp, cost)
    assert pickle.loads(pickle.dumps(plan)) == plan


def sample(distribution: str, n: int, row_len: int, seed: int = 0) -> np.ndarray:
    from profiling.bench.bench_dynamic_cp import sample as bench_sample

    return bench_sample(distribution, n, row_len, seed)


@pytest.mark.parametrize("ranks", [8, 16])
@pytest.mark.parametrize("distribution", ["lognormal", "bimodal", "uniform", "few_long"])
def test_benchmark_steps_take_at_most_one_round_more_than_their_tokens(distribution, ranks):
    """The issue's round target, on the benchmark's lengths (64 sequences; the figures:
    profiling/results/dynamic_cp.md)."""
    from profiling.bench.bench_dynamic_cp import ROW_LEN, TOKENS_PER_RANK

    lengths = sample(distribution, 64, ROW_LEN)
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=ranks), tokens_per_rank=TOKENS_PER_RANK)
    check_plan(plan, lengths, Parallelism(dp=ranks), TOKENS_PER_RANK)
    assert plan.rounds_per_rank <= plan.token_lower_bound + 1
    under_attention = plan_step_dynamic_cp(lengths, Parallelism(dp=ranks), tokens_per_rank=TOKENS_PER_RANK,
                                           cost=AttentionOnlyCost())
    assert under_attention.critical_path_over_ideal < 1.01  # CP costs nothing there: every round balances


def test_min_cp_shards_every_sequence_over_at_least_that_many_ranks():
    lengths = [100, 3000, 5000, 40, 0, 900]
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=4, cp=2), tokens_per_rank=1024, min_cp=2)
    check_plan(plan, lengths, Parallelism(dp=4, cp=2), 1024, min_cp=2)
    assert min(plan.cp_sizes) >= 2


def test_a_pool_that_is_not_a_power_of_two_runs_static_cp_with_min_cp_equal_to_it():
    lengths = [5000, 300, 2000, 7000, 10]
    parallelism = Parallelism(dp=3, cp=2)
    plan = plan_step_dynamic_cp(lengths, parallelism, tokens_per_rank=1200, min_cp=6)
    check_plan(plan, lengths, parallelism, 1200, min_cp=6)
    assert all(len(blocks) == 1 and blocks[0].size == 6 for blocks in plan.rounds)
    assert plan.sequence_multiples == {6: 12}


def test_sequences_pad_by_the_parallelism_rule_for_their_cp_size():
    parallelism = Parallelism(dp=2, cp=2, tp=2, sequence_parallel=True, make_sequence_length_divisible_by=24)
    plan = plan_step_dynamic_cp([1000, 50, 3000], parallelism, tokens_per_rank=2400)
    # c = 1: tp 2 with SP -> 2, with the run's 24 -> 24; c = 2: 8 -> lcm(24, 8) = 24; c = 4: 16 -> 48
    assert plan.sequence_multiples == {1: 24, 2: 24, 4: 48}
    assert plan.padded_length(1, 4) == 96 and plan.padded_length(1, 1) == 72


def test_an_empty_step_has_no_round():
    plan = plan_step_dynamic_cp([], Parallelism(dp=4), tokens_per_rank=64)
    assert plan.rounds == [] and plan.step_over_ideal == 1.0 and plan.padding_fraction == 0.0


def test_zero_length_sequences_are_planned_too():
    plan = plan_step_dynamic_cp([0, 0, 5], Parallelism(dp=2), tokens_per_rank=8)
    check_plan(plan, [0, 0, 5], Parallelism(dp=2), 8)


def test_a_custom_cost_model_is_used_as_given():
    class Linear:
        def sequence(self, lengths, c):
            return np.asarray(lengths, dtype=np.float64) / c

        def block(self, c, tokens_per_rank):
            return 0.0

    lengths = [700, 600, 500, 100]
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=2), tokens_per_rank=1024, cost=Linear())
    check_plan(plan, lengths, Parallelism(dp=2), 1024, cost=Linear())
    assert plan.ideal_cost == pytest.approx(1900 / 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_per_rank=100), r"lengths\[2\] = 900 .* longer than the pool holds in one round: 4 ranks x "
                                r"tokens_per_rank=100 = 400; raise tokens_per_rank to at least 226"),
    (dict(tokens_per_rank=0), r"tokens_per_rank=0 is invalid; expected an int >= 1"),
    (dict(tokens_per_rank=1001), r"tokens_per_rank=1001 is not a multiple of 2, the alignment of one rank's share "
                                 r"of a block for every CP size \[1, 2, 4\] .* e\.g\. 1002"),
    (dict(tokens_per_rank=1000, min_cp=3), r"min_cp=3 is invalid; expected a power of two"),
    (dict(tokens_per_rank=1000, min_cp=8), r"min_cp=8 is invalid; expected an int in \[1, 4\]"),
    (dict(tokens_per_rank=1000, cost=object()), r"cost=<object .*> is invalid; a cost model needs methods "
                                                r"sequence\(lengths, c\) and block\(c, tokens_per_rank\)"),
    (dict(tokens_per_rank=1000, hidden_size=0), r"hidden_size=0 is invalid"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(PackingError, match=match):
        plan_step_dynamic_cp([10, 20, 900], Parallelism(dp=2, cp=2), **kwargs)


def test_a_pool_that_is_not_a_power_of_two_is_refused_unless_min_cp_is_the_pool():
    with pytest.raises(PackingError, match=r"the pool has 6 ranks \(dp \* cp\), not a power of two: .* or min_cp=6"):
        plan_step_dynamic_cp([10], Parallelism(dp=3, cp=2), tokens_per_rank=64)


def test_bad_lengths_and_parallelism_are_refused():
    with pytest.raises(PackingError, match=r"lengths\[1\] = -3 is invalid"):
        plan_step_dynamic_cp([4, -3], Parallelism(dp=2), tokens_per_rank=64)
    with pytest.raises(PackingError, match="parallelism=.* is invalid; expected a nn_data.planning.Parallelism"):
        plan_step_dynamic_cp([4], {"dp": 2}, tokens_per_rank=64)


def test_the_cost_models_worked_example():
    """cp_cost's docstring: h 16, tpr 64, a 100-token sequence over 2 ranks."""
    assert CPCost(hidden_size=16).sequence([100], 2)[0] == 9800.0
    assert CPCost(hidden_size=16).block(2, 64) == 2**21 + 512 * 64 and CPCost().block(1, 64) == 0.0
    assert AttentionOnlyCost().sequence([100], 2)[0] == 5000.0 and AttentionOnlyCost().block(8, 64) == 0.0
    assert CPCost(hidden_size=16).padding(10) == 960.0
