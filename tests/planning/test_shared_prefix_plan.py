"""Tier: pure CPU, single process (numpy planning on the host; one test builds the shared-prefix layout on the CPU).

nn_data.planning.plan_step_shared_prefix: plan_step's guarantees over GRPO groups (property-tested against a
small reference of the shared-prefix layout's slots), groups kept together, prompts charged once, the split
of a group too large for a microbatch, and every refusal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.errors import PackingError
from nn_data.planning import Parallelism, plan_step, plan_step_shared_prefix, sequence_work

PROPERTIES = settings(max_examples=80, deadline=None, derandomize=True)
H = 16  # hidden size of the work model in these tests


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def reference_microbatch(rollouts, lengths, prefix, groups, m):
    """(packed tokens, real tokens, work) of one microbatch by the contract's slots: rollout b's prompt slot
    holds its prompt when b is the first of its group in the microbatch (else nothing), then its response
    slot; every slot rounded up to m. Work: each prompt P(P + 6H) once, each response (L-P)(L+P+6H)."""
    seen, tokens, real, work = set(), 0, 0, 0.0
    for b in rollouts:
        L, P = lengths[b], prefix[b]
        if groups[b] not in seen:
            seen.add(groups[b])
            tokens, real, work = tokens + _round_up(P, m), real + P, work + P * (P + 6 * H)
        tokens, real, work = tokens + _round_up(L - P, m), real + L - P, work + (L - P) * (L + P + 6 * H)
    return tokens, real, work


@st.composite
def grpo_steps(draw):
    dp = draw(st.integers(1, 4))
    m = draw(st.sampled_from([1, 2, 4, 8]))
    parallelism = Parallelism(dp=dp, make_sequence_length_divisible_by=m)
    total = m * draw(st.integers(4, 24))
    lengths, prefix, groups = [], [], []
    ids = draw(st.permutations(list(range(draw(st.integers(0, 10))))))
    for gid in ids:
        p = draw(st.integers(0, total - m))
        size = draw(st.integers(1, 8))
        for _ in range(size):
            lengths.append(p + draw(st.integers(0, total - _round_up(p, m))))
            prefix.append(p)
            groups.append(gid * 7 - 20)  # any int is an id, negative ones too
    if draw(st.booleans()):  # interleave the groups' rollouts
        perm = draw(st.permutations(list(range(len(lengths)))))
        lengths, prefix, groups = ([v[i] for i in perm] for v in (lengths, prefix, groups))
    return parallelism, total, lengths, prefix, groups


def _check(plan, parallelism, total, lengths, prefix, groups):
    m, n = parallelism.pad_multiple, len(lengths)
    assert len(plan.ranks) == parallelism.dp and len({len(rank) for rank in plan.ranks}) <= 1
    assert sorted(b for rank in plan.ranks for mb in rank for b in mb) == list(range(n))  # each exactly once
    real = 0
    for rank, tokens, work in zip(plan.ranks, plan.microbatch_tokens, plan.microbatch_work):
        for mb, t, w in zip(rank, tokens, work):
            ref_t, ref_real, ref_w = reference_microbatch(mb, lengths, prefix, groups, m)
            assert t == ref_t <= total  # the hard cap, on the layout's own token count
            assert w == pytest.approx(ref_w, rel=1e-12)
            real += ref_real
            firsts = {}
            for pos, b in enumerate(mb):  # a group's rollouts contiguous, in index order
                firsts.setdefault(groups[b], pos)
            for g, pos in firsts.items():
                run = [b for b in mb if groups[b] == g]
                assert mb[pos:pos + len(run)] == run == sorted(run)
    assert plan.real_tokens == real
    return real


@PROPERTIES
@given(case=grpo_steps(), balance=st.sampled_from(["work", "tokens", "nemo-rl"]))
def test_every_plan_keeps_plan_steps_guarantees_with_each_prompt_once_per_microbatch(case, balance):
    parallelism, total, lengths, prefix, groups = case
    try:
        plan = plan_step_shared_prefix(lengths, parallelism, group_ids=groups, prefix_lengths=prefix,
                                       pad_full_seq_to=total, balance=balance, hidden_size=H)
    except PackingError as err:  # NeMo-RL's deal needs an item per bin
        assert balance == "nemo-rl" and "Cannot create" in str(err)
        return
    _check(plan, parallelism, total, lengths, prefix, groups)
    m = parallelism.pad_multiple
    shared = {g for g, p in zip(groups, prefix) if p > 0}  # a group without a prompt shares nothing: planned one
    items = len(shared) + sum(1 for g, p in zip(groups, prefix) if p == 0)  # by one, as plan_step plans sequences
    for g in shared:  # a group that fits one microbatch is in one microbatch, unless a rank would idle
        rows = [b for b in range(len(lengths)) if groups[b] == g]
        need = _round_up(prefix[rows[0]], m) + sum(_round_up(lengths[b] - prefix[b], m) for b in rows)
        holding = [mb for rank in plan.ranks for mb in rank if set(mb) & set(rows)]
        if need <= total and items >= parallelism.dp:
            assert len(holding) == 1
        if len(holding) > 1:  # split: each part alone would not have fit with another
            assert need > total or items < parallelism.dp


@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=grpo_steps())
def test_each_planned_microbatch_is_what_the_shared_prefix_layout_packs(case):
    """nn_data.layout's shared_prefix_layout over each planned microbatch's rollouts (in the plan's order) packs
    exactly the planned tokens, and within pad_full_seq_to."""
    from nn_data.layout import PackSpec, shared_prefix_layout

    parallelism, total, lengths, prefix, groups = case
    plan = plan_step_shared_prefix(lengths, parallelism, group_ids=groups, prefix_lengths=prefix,
                                   pad_full_seq_to=total, hidden_size=H)
    spec = PackSpec(parallelism.pad_multiple)
    for rank, tokens in zip(plan.ranks, plan.microbatch_tokens):
        for mb, t in zip(rank, tokens):
            if not mb:
                continue
            rows = [torch.tensor([values[b] for b in mb]) for values in (lengths, prefix, groups)]
            layout = shared_prefix_layout(*rows, row_len=max(lengths), spec=spec)
            assert layout.total == t <= total
            fixed = shared_prefix_layout(*rows, row_len=max(lengths),
                                         spec=PackSpec(parallelism.pad_multiple, fixed_total=total))
            assert fixed.total == total


@PROPERTIES
@given(case=grpo_steps(), extra=st.integers(0, 2))
def test_a_given_microbatch_count_is_kept_on_every_rank(case, extra):
    parallelism, total, lengths, prefix, groups = case
    free = plan_step_shared_prefix(lengths, parallelism, group_ids=groups, prefix_lengths=prefix,
                                   pad_full_seq_to=total, hidden_size=H)
    k = max(1, free.microbatches_per_rank) + extra
    plan = plan_step_shared_prefix(lengths, parallelism, group_ids=groups, prefix_lengths=prefix,
                                   pad_full_seq_to=total, microbatches_per_rank=k, hidden_size=H)
    _check(plan, parallelism, total, lengths, prefix, groups)
    assert plan.microbatches_per_rank == k


@PROPERTIES
@given(case=grpo_steps())
def test_groups_of_one_plan_exactly_as_plan_step(case):
    """Every rollout its own group and m = 1: an item is a sequence of the same need and work, so the plan is
    plan_step's, rank for rank."""
    parallelism, total, lengths, prefix, _ = case
    parallelism = Parallelism(dp=parallelism.dp)
    plan = plan_step_shared_prefix(lengths, parallelism, group_ids=list(range(len(lengths))), prefix_lengths=prefix,
                                   pad_full_seq_to=total, hidden_size=H)
    alone = plan_step(lengths, parallelism, pad_full_seq_to=total, hidden_size=H)
    assert plan.ranks == alone.ranks and plan.microbatch_tokens == alone.microbatch_tokens
    assert plan.microbatch_work == alone.microbatch_work  # integers below 2**53: exact


def test_worked_example_of_the_module():
    kw = dict(group_ids=[5, 5, 5, 3], prefix_lengths=[8, 8, 8, 2])
    plan = plan_step_shared_prefix([10, 12, 9, 6], Parallelism(dp=1), pad_full_seq_to=16, **kw)
    assert plan.ranks == [[[0, 1, 2], [3]]] and plan.microbatch_tokens == [[15, 6]] and plan.real_tokens == 21
    split = plan_step_shared_prefix([10, 12, 9, 6], Parallelism(dp=1), pad_full_seq_to=12, **kw)
    assert sorted(map(sorted, split.ranks[0])) == [[0, 2], [1], [3]]
    assert sorted(split.microbatch_tokens[0]) == [6, 11, 12] and split.real_tokens == 29  # the prompt twice


def test_the_grpo_target_case_packs_over_three_times_fewer_tokens():
    """Prompt 2,048, G 8, responses 512: end to end 8 x 2,560 = 20,480 tokens; shared 2,048 + 8 x 512 = 6,144."""
    lengths, kw = [2560] * 8, dict(group_ids=[0] * 8, prefix_lengths=[2048] * 8)
    plan = plan_step_shared_prefix(lengths, Parallelism(dp=1), pad_full_seq_to=8192, **kw)
    assert plan.ranks == [[list(range(8))]] and plan.real_tokens == plan.microbatch_tokens[0][0] == 6144
    alone = plan_step(lengths, Parallelism(dp=1), pad_full_seq_to=8192)
    assert alone.real_tokens == 20480 and alone.real_tokens / plan.real_tokens > 3.3
    assert plan.rank_work[0] == pytest.approx(float(sequence_work([2048])[0] + 8 * 512 * (2560 + 2048 + 6 * 4096)))


def test_fewer_groups_than_ranks_are_halved_rather_than_leave_ranks_idle():
    plan = plan_step_shared_prefix([10, 12, 9, 6], Parallelism(dp=4), group_ids=[5, 5, 5, 3],
                                   prefix_lengths=[8, 8, 8, 2], pad_full_seq_to=16)
    assert sorted(mb for rank in plan.ranks for mb in rank) == [[0], [1], [2], [3]]
    one = plan_step_shared_prefix([3], Parallelism(dp=2), group_ids=[1], prefix_lengths=[2], pad_full_seq_to=4)
    assert one.ranks == [[[0]], [[]]]  # a single rollout cannot be halved


@pytest.mark.parametrize("seed", range(3))
def test_work_is_balanced_on_grpo_like_steps(seed):
    """64 groups of 8 (prompts 256-2,048, lognormal responses) on 8 ranks: within 2 % of the bound."""
    rng = np.random.default_rng(seed)
    lengths, prefix, groups = [], [], []
    for g in range(64):
        p = int(rng.integers(256, 2049))
        for r in np.clip(np.rint(rng.lognormal(np.log(512), 0.8, 8)), 128, 4096).astype(int).tolist():
            lengths.append(p + r)
            prefix.append(p)
            groups.append(g)
    plan = plan_step_shared_prefix(lengths, Parallelism(dp=8, cp=2), group_ids=groups, prefix_lengths=prefix,
                                   pad_full_seq_to=16384)
    assert plan.work_imbalance <= max(1.02, plan.imbalance_bound * 1.02)


def test_tensors_are_read_once_and_an_empty_step_plans_empty():
    plan = plan_step_shared_prefix(torch.tensor([4, 5]), Parallelism(dp=1), group_ids=torch.tensor([0, 0]),
                                   prefix_lengths=torch.tensor([3, 3]), pad_full_seq_to=8)
    assert plan.ranks == [[[0, 1]]] and plan.microbatch_tokens == [[6]]
    empty = plan_step_shared_prefix([], Parallelism(dp=2), group_ids=[], prefix_lengths=[], pad_full_seq_to=8)
    assert empty.ranks == [[], []] and empty.real_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(prefix_lengths=[3, 6]),
     r"^prefix_lengths\[1\] = 6 is invalid; it is past the rollout's length lengths\[1\] = 5"),
    (dict(prefix_lengths=[3, 2]), r"^prefix_lengths\[1\] = 2 differs from prefix_lengths\[0\] = 3 of the same group"),
    (dict(prefix_lengths=[3, -1]), r"^prefix_lengths\[1\] = -1 is invalid; every length must be an int >= 0"),
    (dict(prefix_lengths=[3]), r"^prefix_lengths has 1 entries for 2 rollouts"),
    (dict(group_ids=[0]), r"^group_ids has 1 entries for 2 rollouts"),
    (dict(group_ids=[0.5, 1.0]), r"^group_ids=\[0.5, 1.0\] is invalid; expected a 1-D sequence of ints"),
    (dict(group_ids=[[0, 0]]), r"^group_ids=\[\[0, 0\]\] is invalid"),
    (dict(lengths=[4, 9], prefix_lengths=[3, 3], group_ids=[0, 1]),
     r"^lengths\[1\] = 9 with prefix_lengths\[1\] = 3 takes 12 tokens alone \(prompt and response each padded to a "
     r"multiple of 4\), more than pad_full_seq_to=8"),
    (dict(pad_full_seq_to=6), r"^pad_full_seq_to=6 is not a multiple of 4"),
    (dict(balance="fair"), r"^balance='fair' is invalid"),
])
def test_refusals_name_the_argument(kwargs, match):
    args = dict(lengths=[4, 5], group_ids=[0, 0], prefix_lengths=[3, 3], pad_full_seq_to=8)
    args.update(kwargs)
    parallelism = Parallelism(dp=1, cp=2)  # sequences pad to multiples of 4
    with pytest.raises(PackingError, match=match):
        plan_step_shared_prefix(args.pop("lengths"), parallelism, **args)


def test_the_documented_example_runs_as_written_and_prints_what_the_page_says(capsys):
    import re
    from pathlib import Path

    page = "docs/planning.md"
    text = (Path(__file__).resolve().parents[2] / page).read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "plan_step_shared_prefix(lengths" in b)
    exec(compile(block, page, "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["[[[8, 9, 10, 11, 12, 13, 14, 15]], [[0, 1, 2, 3, 4, 5, 6, 7]]]", "[[6340], [8136]] 14464",
                       "34216 2.37x"]
