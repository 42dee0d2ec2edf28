"""Tier: pure CPU, single process (numpy planning on the host; no tensor op but reading a lengths tensor).

nn_data.planning.plan_step: the guarantees (property-tested), balance, complexity and every refusal.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.errors import PackingError
from nn_data.planning import BALANCE_MODES, Parallelism, StepPlan, evaluate_plan, plan_step, sequence_work
from nn_data.planning.balance import bins_to_ranks, greedy_assignment, spread
from nn_data.planning.ffd import adjust_bin_count, ffd_ties_last, first_fit_decreasing
from nn_data.planning.step import imbalance_bound

PROPERTIES = settings(max_examples=120, deadline=None, derandomize=True)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def test_worked_example_of_the_module():
    plan = plan_step([300, 20, 200, 100, 40, 250], Parallelism(dp=2), pad_full_seq_to=512, hidden_size=16)
    assert plan.ranks == [[[0, 3, 4, 1]], [[5, 2]]]
    assert plan.microbatch_tokens == [[460], [450]] and plan.rank_work == [146160.0, 145700.0]
    assert plan.work_imbalance == pytest.approx(146160 / 145930)
    assert plan.padding_fraction == pytest.approx(1 - 910 / 1024)
    nemo = plan_step([300, 20, 200, 100, 40, 250], Parallelism(dp=2), pad_full_seq_to=512, hidden_size=16,
                     balance="nemo-rl")
    assert nemo.ranks == [[[0, 2]], [[5, 3, 4, 1]]] and nemo.work_imbalance == pytest.approx(1.2198, abs=1e-4)


def test_balance_worked_example():
    assert greedy_assignment([0, 1, 2, 3, 4], [6, 5, 4, 3, 2], [6, 5, 4, 3, 2], 8, 2, 1)[::2] == (None, 2)
    found = greedy_assignment([0, 1, 2, 3, 4], [6, 5, 4, 3, 2], [6, 5, 4, 3, 2], 8, 2, 2)
    assert found.ranks == [[[0, 4], [3]], [[1], [2]]]
    assert spread([[0, 1, 2], []], 3) == [[0], [2], [1]] and spread([[0]], 3) == [[0], [], []]
    assert bins_to_ranks([[0], [1], [2], [3]], [5, 4, 3, 1], 2, 2) == [[[0], [3]], [[1], [2]]]


@st.composite
def steps(draw):
    cp = draw(st.sampled_from([1, 2]))
    tp, sp = draw(st.sampled_from([(1, False), (2, True), (2, False)]))
    recipe = draw(st.sampled_from([None, None, "tensorwise"]))
    parallelism = Parallelism(dp=draw(st.integers(1, 6)), tp=tp, sequence_parallel=sp, cp=cp, fp8_recipe=recipe)
    m = parallelism.sequence_multiple * draw(st.sampled_from([1, 2]))
    parallelism = Parallelism(dp=parallelism.dp, tp=tp, sequence_parallel=sp, cp=cp, fp8_recipe=recipe,
                            make_sequence_length_divisible_by=m)
    total = parallelism.total_multiple * draw(st.integers(1, 8)) * max(1, 64 // parallelism.total_multiple)
    lengths = draw(st.lists(st.integers(0, total - (m - 1) if total >= m else 0), max_size=60))
    lengths = [n for n in lengths if _round_up(n, m) <= total]
    return parallelism, total, lengths


def _check_guarantees(plan: StepPlan, parallelism: Parallelism, total: int, lengths: list) -> None:
    assert plan.pad_full_seq_to == total and total % parallelism.total_multiple == 0
    assert len(plan.ranks) == parallelism.dp
    k = plan.microbatches_per_rank
    assert all(len(rank) == k for rank in plan.ranks)  # the same count on every rank
    seen = sorted(i for rank in plan.ranks for mb in rank for i in mb)
    assert seen == list(range(len(lengths)))  # every sequence exactly once
    for rank, tokens, work in zip(plan.ranks, plan.microbatch_tokens, plan.microbatch_work):
        for mb, t, w in zip(rank, tokens, work):
            assert t == sum(_round_up(lengths[i], parallelism.pad_multiple) for i in mb) <= total  # hard capacity
            assert w == pytest.approx(sum(lengths[i] * (lengths[i] + 6 * 4096) for i in mb))
    slots = parallelism.dp * k * total
    assert plan.padding_fraction == pytest.approx(1 - sum(lengths) / slots if slots else 0.0)


@PROPERTIES
@given(case=steps(), balance=st.sampled_from(["work", "tokens"]))
def test_every_plan_keeps_the_guarantees_and_never_needs_more_microbatches_than_ffd(case, balance):
    parallelism, total, lengths = case
    plan = plan_step(lengths, parallelism, pad_full_seq_to=total, balance=balance)
    _check_guarantees(plan, parallelism, total, lengths)
    padded = [_round_up(n, parallelism.pad_multiple) for n in lengths]
    ffd_k = max(1, -(-len(first_fit_decreasing(padded, total).bins) // parallelism.dp)) if lengths else 0
    lower = max(1, -(-sum(padded) // (parallelism.dp * total))) if lengths else 0
    assert lower <= plan.microbatches_per_rank <= ffd_k  # never more than FFD over the whole step needs
    if lengths:  # padding never worse than NeMo-RL's plan at the same T
        try:
            nemo = plan_step(lengths, parallelism, pad_full_seq_to=total, balance="nemo-rl")
        except PackingError as err:  # NeMo-RL needs a sequence per bin; nn_data's modes do not
            assert "Cannot create" in str(err)
        else:
            _check_guarantees(nemo, parallelism, total, lengths)
            assert plan.padding_fraction <= nemo.padding_fraction + 1e-12


@PROPERTIES
@given(case=steps(), balance=st.sampled_from(list(BALANCE_MODES)), extra=st.integers(0, 3))
def test_a_given_microbatch_count_is_kept_on_every_rank(case, balance, extra):
    parallelism, total, lengths = case
    padded = [_round_up(n, parallelism.pad_multiple) for n in lengths]
    k = max(1, -(-len(first_fit_decreasing(padded, total).bins) // parallelism.dp)) + extra
    try:
        plan = plan_step(lengths, parallelism, pad_full_seq_to=total, microbatches_per_rank=k, balance=balance)
    except PackingError as err:
        assert balance == "nemo-rl" and "Cannot create" in str(err)  # fewer sequences than NeMo-RL's bins
        return
    _check_guarantees(plan, parallelism, total, lengths)
    assert plan.microbatches_per_rank == k
    if balance != "nemo-rl":  # empty microbatches only where a rank has fewer sequences than k
        for rank in plan.ranks:
            assert sum(1 for mb in rank if not mb) == max(0, k - sum(len(mb) for mb in rank))


def test_nemo_rl_mode_is_nemo_rls_bins_and_deal():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 900, size=200).tolist()
    plan = plan_step(lengths, Parallelism(dp=4, make_sequence_length_divisible_by=8), pad_full_seq_to=2048,
                     balance="nemo-rl")
    bins = adjust_bin_count(ffd_ties_last([_round_up(n, 8) for n in lengths], 2048).bins, 4)
    assert plan.ranks == [bins[r::4] for r in range(4)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n, dp, total", [(64, 8, 16384), (128, 8, 16384), (256, 16, 16384), (256, 4, 32768)])
def test_work_is_balanced_across_ranks_on_rl_like_lengths(seed, n, dp, total):
    """Lognormal lengths (median 1024, sigma 1, at most the row length 8192): the imbalance stays
    within 1.02 of what the longest sequence allows, and beats NeMo-RL's deal at the same padding."""
    lengths = np.clip(np.rint(np.random.default_rng(seed).lognormal(np.log(1024), 1.0, n)), 1, 8192).astype(int)
    parallelism = Parallelism(dp=dp, cp=2)
    plan = plan_step(lengths, parallelism, pad_full_seq_to=total)
    nemo = plan_step(lengths, parallelism, pad_full_seq_to=total, balance="nemo-rl")
    assert plan.imbalance_bound == imbalance_bound(sequence_work(lengths), dp)
    assert plan.work_imbalance <= max(1.02, plan.imbalance_bound * 1.02)
    assert plan.work_imbalance <= nemo.work_imbalance and plan.padding_fraction <= nemo.padding_fraction


def test_imbalance_bound_worked_example():
    assert imbalance_bound([9, 8, 5, 4, 2], 2) == 1.0 and imbalance_bound([9, 8, 5, 4, 2], 4) == pytest.approx(9 / 7)
    assert imbalance_bound([5, 5, 5], 2) == pytest.approx(10 / 7.5) and imbalance_bound([], 3) == 1.0


def test_fewer_sequences_than_ranks_and_an_empty_step():
    plan = plan_step([5, 3, 9], Parallelism(dp=8), pad_full_seq_to=16)
    assert plan.microbatches_per_rank == 1 and sorted(map(len, (r[0] for r in plan.ranks))) == [0] * 5 + [1] * 3
    assert plan.padding_fraction == pytest.approx(1 - 17 / 128)
    empty = plan_step([], Parallelism(dp=3), pad_full_seq_to=16)
    assert empty.ranks == [[], [], []] and empty.padding_fraction == 0.0 and empty.work_imbalance == 1.0
    empty = plan_step(np.zeros(0, dtype=np.int64), Parallelism(dp=2), pad_full_seq_to=16, microbatches_per_rank=2)
    assert empty.ranks == [[[], []], [[], []]] and empty.padding_fraction == 1.0


def test_lengths_may_be_a_tensor_and_zero_lengths_are_sequences():
    plan = plan_step(torch.tensor([4, 0, 8, 0]), Parallelism(dp=2), pad_full_seq_to=8)
    assert sorted(i for r in plan.ranks for mb in r for i in mb) == [0, 1, 2, 3]


def test_a_microbatch_count_that_ffd_needs_more_of_is_refused_naming_what_fits():
    # 4 x 5 tokens: the lower bound is 3 microbatches of 8, but no two fit together
    with pytest.raises(PackingError, match=r"^microbatches_per_rank=3 cannot hold the step: 20 padded tokens on dp=1 "
                                           r"ranks of pad_full_seq_to=8 need at least 4 microbatches per rank here; "
                                           r"pass microbatches_per_rank >= 4 \(or None"):
        plan_step([5, 5, 5, 5], Parallelism(dp=1), pad_full_seq_to=8, microbatches_per_rank=3)
    with pytest.raises(PackingError, match=r"^microbatches_per_rank=1 cannot hold the step: 40 padded tokens on dp=2 "
                                           r"ranks of pad_full_seq_to=16 need at least 2 microbatches"):
        plan_step([10] * 4, Parallelism(dp=2), pad_full_seq_to=16, microbatches_per_rank=1)
    with pytest.raises(PackingError, match=r"^microbatches_per_rank=1 cannot hold the step: .* need at least 2"):
        plan_step([10] * 4, Parallelism(dp=2), pad_full_seq_to=16, microbatches_per_rank=1, balance="nemo-rl")


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=[4, 17], pad_full_seq_to=16), r"^lengths\[1\] = 17 \(padded to 17, a multiple of 1\) is longer than "
                                               r"pad_full_seq_to=16; raise pad_full_seq_to to at least 17$"),
    (dict(lengths=[4, 13], pad_full_seq_to=12, parallelism=Parallelism(dp=2, cp=2, make_sequence_length_divisible_by=8)),
     r"^lengths\[1\] = 13 \(padded to 16, a multiple of 8\) is longer than pad_full_seq_to=12; raise pad_full_seq_to"
     r" to at least 16$"),
    (dict(pad_full_seq_to=18, parallelism=Parallelism(dp=2, cp=2)), r"^pad_full_seq_to=18 is not a multiple of 4, the "
                                                                   r"alignment of this parallelism .* e\.g\. 20$"),
    (dict(pad_full_seq_to=2**31), r"^pad_full_seq_to=2147483648 exceeds 2147483647 \(2\*\*31 - 1\)"),
    (dict(pad_full_seq_to=None), r"^pad_full_seq_to=None is invalid; expected an int >= 1"),
    (dict(microbatches_per_rank=0), r"^microbatches_per_rank=0 is invalid; expected None or an int >= 1"),
    (dict(balance="flops"), r"^balance='flops' is invalid; expected one of \['work', 'tokens', 'nemo-rl'\]"),
    (dict(hidden_size=0), r"^hidden_size=0 is invalid; expected an int >= 1"),
    (dict(parallelism={"dp": 2}), r"^parallelism=\{'dp': 2\} is invalid; expected a nn_data.planning.Parallelism"),
    (dict(lengths=[3, -1]), r"^lengths\[1\] = -1 is invalid; every length must be an int >= 0"),
    (dict(lengths=[3.0, 2.5]), r"^lengths=\[3.0, 2.5\] is invalid; expected a 1-D sequence of ints >= 0 \(nothing is "
                               r"rounded"),
    (dict(lengths=torch.tensor([1.5])), r"^lengths=\[1.5\] is invalid"),
    (dict(lengths=[[1, 2]]), r"^lengths=\[\[1, 2\]\] is invalid; expected a 1-D sequence"),
    (dict(lengths=[True, False]), r"^lengths=\[True, False\] is invalid"),
])
def test_refusals_name_the_argument(kwargs, match):
    args = dict(lengths=[4, 5], parallelism=Parallelism(dp=2), pad_full_seq_to=16)
    args.update(kwargs)
    lengths, parallelism = args.pop("lengths"), args.pop("parallelism")
    with pytest.raises(PackingError, match=match):
        plan_step(lengths, parallelism, **args)


@pytest.mark.parametrize("balance", ["work", "tokens"])
def test_planning_work_grows_as_n_log_n(balance):
    """Count the planner's heap pops and tree nodes (no timing): per sequence they grow with log2 n."""
    rng = np.random.default_rng(0)
    per_item = {}
    for n in (1 << 10, 1 << 14):
        lengths = np.clip(np.rint(rng.lognormal(np.log(1024), 1.0, n)), 1, 16384).astype(np.int64)
        plan = plan_step(lengths, Parallelism(dp=16, cp=2), pad_full_seq_to=16384, balance=balance)
        per_item[n] = plan.steps / n
        assert plan.steps <= 4 * n * math.log2(n)
    assert per_item[1 << 14] <= per_item[1 << 10] * 14 / 10 * 1.5  # ~log n per sequence, not ~n


def test_evaluate_plan_measures_another_planners_ranks_and_checks_the_guarantees():
    parallelism = Parallelism(dp=2)
    plan = evaluate_plan([[[0, 2]], [[1]]], [6, 5, 4], parallelism, pad_full_seq_to=10, hidden_size=1)
    assert plan.microbatch_tokens == [[10], [5]] and plan.rank_work == [6 * 12 + 4 * 10, 5 * 11]
    assert plan.padding_fraction == pytest.approx(1 - 15 / 20) and plan.balance == "given"
    with pytest.raises(PackingError, match=r"^a microbatch holds 11 padded tokens, more than pad_full_seq_to=10$"):
        evaluate_plan([[[0, 1]], [[2]]], [6, 5, 4], parallelism, pad_full_seq_to=10)
    with pytest.raises(PackingError, match=r"^the plan holds 2 sequence slots for 3 sequences; each must be in"):
        evaluate_plan([[[0]], [[1]]], [6, 5, 4], parallelism, pad_full_seq_to=10)
    with pytest.raises(PackingError, match=r"^the plan has 2 ranks with \[1, 2\] microbatches; expected dp=2 ranks"):
        evaluate_plan([[[0]], [[1], [2]]], [6, 5, 4], parallelism, pad_full_seq_to=10)


@pytest.mark.parametrize("page", ["docs/planning.md"])
def test_the_documented_example_runs_as_written_and_prints_what_the_page_says(page, capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / page).read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "plan_step(lengths, parallelism" in b)
    exec(compile(block, page, "exec"), {})
    printed = capsys.readouterr().out
    assert "[[[2, 4, 3]], [[12, 7, 13]], [[0, 14, 15, 1, 6, 9]], [[5, 8, 10, 11]]]" in printed
    assert "11.5% padding, work imbalance 1.003" in printed


def test_a_uint64_length_above_2_63_is_named_as_given():
    big = 2**63 + 5
    with pytest.raises(PackingError, match=rf"^lengths\[0\] = {big} is invalid; a length above 2147483647 cannot "
                                           r"fit the int32 boundaries"):
        plan_step(np.array([big, 3], dtype=np.uint64), Parallelism(dp=1), pad_full_seq_to=64)
