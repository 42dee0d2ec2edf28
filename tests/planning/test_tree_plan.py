"""Tier: pure CPU, single process (numpy; tree_layout for the cross-check).

plan_step_rollout_tree: plan_step's guarantees over random trees (every rollout once, every microbatch at
most T, one microbatch count on every rank), each microbatch's tokens equal to the packed total of
tree_layout on subtree's tree of its rollouts, its real tokens and work those of its distinct tokens (trees split
as parts grow), trees kept whole where they fit, the docstring's split, rollouts sharing through an absent ancestor, a split GRPO star planned as plan_step_shared_prefix plans it (one planner), a
single tree halved rather than leave a rank idle; bad trees refused by field.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.errors import PackingError
from nn_data.layout import PackSpec, tree_layout
from nn_data.planning import Parallelism, plan_step_rollout_tree, plan_step_shared_prefix, subtree
from tests.support.hypothesis_profiles import examples
from tests.support.tree_reference import random_tree, token_ids


def test_the_docstring_example():
    plan = plan_step_rollout_tree([10, 12, 9], Parallelism(dp=1), parent=[-1, 0, 1], branch_at=[0, 6, 8],
                                  pad_full_seq_to=17)
    assert plan.ranks == [[[0, 1, 2]]] and plan.microbatch_tokens == [[17]]
    plan = plan_step_rollout_tree([10, 12, 9], Parallelism(dp=1), parent=[-1, 0, 1], branch_at=[0, 6, 8],
                                  pad_full_seq_to=16)
    assert sorted(map(tuple, plan.ranks[0])) == [(0, 1), (2,)] and sorted(plan.microbatch_tokens[0]) == [9, 16]
    assert [x.tolist() for x in subtree([-1, 0, 1], [0, 6, 8], [0, 2])] == [[-1, 0], [0, 6]]


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10 ** 6), dp=st.sampled_from([1, 2, 3]), cp=st.sampled_from([1, 2]))
def test_plan_step_guarantees_and_the_layouts_tokens(seed, dp, cp):
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(1, 6), 40) for _ in range(rng.randint(1, 5))]
    lengths, parent, branch_at = [], [], []
    for tree in trees:  # a forest: each tree's indices shifted after the ones before
        base = len(lengths)
        lengths += tree.lengths
        parent += [p + base if p >= 0 else -1 for p in tree.parent]
        branch_at += tree.branch_at
    parallelism = Parallelism(dp=dp, cp=cp)
    total = 2 * cp * 40
    plan = plan_step_rollout_tree(lengths, parallelism, parent=parent, branch_at=branch_at, pad_full_seq_to=total,
                                  hidden_size=8)
    assert sorted(b for rank in plan.ranks for mb in rank for b in mb) == list(range(len(lengths)))
    assert len({len(rank) for rank in plan.ranks}) == 1 and len(plan.ranks) == dp
    for rank, tokens in zip(plan.ranks, plan.microbatch_tokens):
        for rows, need in zip(rank, tokens):
            assert need <= total
            if not rows:
                continue
            sub_parent, sub_at = subtree(parent, branch_at, rows)
            layout = tree_layout(torch.tensor([lengths[b] for b in rows]), torch.from_numpy(sub_parent),
                                 torch.from_numpy(sub_at), row_len=40, spec=PackSpec(parallelism.pad_multiple))
            assert layout.total == need


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10 ** 6), dp=st.sampled_from([1, 2]), multiple=st.sampled_from([1, 4]))
def test_each_microbatch_costs_its_distinct_tokens(seed, dp, multiple):
    # a microbatch's real tokens are the distinct tokens of its rollouts (a unique code per own token), its work
    # (2s + 1 + 6h) per distinct token at position s, its tokens the layout's; a small T splits trees, so parts
    # are costed as they grow
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(1, 14), 40)
    ids = token_ids(tree, 40)
    plan = plan_step_rollout_tree(tree.lengths, Parallelism(dp=dp, make_sequence_length_divisible_by=multiple),
                                  parent=tree.parent, branch_at=tree.branch_at, pad_full_seq_to=48, hidden_size=8)
    total_real = 0
    for rank, works, needs in zip(plan.ranks, plan.microbatch_work, plan.microbatch_tokens):
        for rows, work, need in zip(rank, works, needs):
            codes = {int(ids[b, s]) for b in rows for s in range(tree.lengths[b])}
            assert work == sum(2 * (code % 1000) + 1 + 6 * 8 for code in codes)
            total_real += len(codes)
            if rows:
                sub_parent, sub_at = subtree(tree.parent, tree.branch_at, rows)
                layout = tree_layout(torch.tensor([tree.lengths[b] for b in rows]), torch.from_numpy(sub_parent),
                                     torch.from_numpy(sub_at), row_len=40, spec=PackSpec(multiple))
                assert layout.total == need <= 48
    assert plan.real_tokens == total_real


def test_the_shared_prompt_costs_what_plan_step_shared_prefix_counts():
    lengths, prefix, groups = [10, 12, 9, 6, 7], [8, 8, 8, 2, 2], [5, 5, 5, 3, 3]
    parent, branch_at = [-1, 0, 0, -1, 3], [0, 8, 8, 0, 2]
    shared = plan_step_shared_prefix(lengths, Parallelism(dp=1), group_ids=groups, prefix_lengths=prefix,
                                     pad_full_seq_to=64)
    tree = plan_step_rollout_tree(lengths, Parallelism(dp=1), parent=parent, branch_at=branch_at, pad_full_seq_to=64)
    assert sum(map(sum, tree.microbatch_tokens)) == sum(map(sum, shared.microbatch_tokens)) == 8 + 2 + 4 + 1 + 2 + 4 + 5
    assert tree.real_tokens == shared.real_tokens
    np.testing.assert_allclose(sum(map(sum, tree.microbatch_work)), sum(map(sum, shared.microbatch_work)), rtol=1e-12)


def test_rollouts_share_through_an_absent_ancestor_and_a_split_group_shares_its_prompt_in_each_part():
    # parent [-1, 0, 1, 0]: 2 and 3 share 4 tokens through 0 (2's path: 8 with 1, then 6 with 0)
    assert [x.tolist() for x in subtree([-1, 0, 1, 0], [0, 6, 8, 4], [2, 3])] == [[-1, 0], [0, 4]]
    assert [x.tolist() for x in subtree([-1, 0, 1, 0], [0, 6, 8, 4], [1, 2, 3])] == [[-1, 0, 0], [0, 8, 4]]
    # a GRPO star (prompt 8, responses 2, 4, 1) split at T 12: each part packs the prompt once, its rollouts share it
    plan = plan_step_rollout_tree([10, 12, 9], Parallelism(dp=1), parent=[-1, 0, 0], branch_at=[0, 8, 8],
                                  pad_full_seq_to=12)
    assert sorted(map(tuple, plan.ranks[0])) == [(0, 2), (1,)] and sorted(plan.microbatch_tokens[0]) == [11, 12]
    shared = plan_step_shared_prefix([10, 12, 9], Parallelism(dp=1), group_ids=[4, 4, 4], prefix_lengths=[8, 8, 8],
                                     pad_full_seq_to=12)
    assert shared.ranks == plan.ranks and shared.microbatch_tokens == plan.microbatch_tokens


def test_a_single_tree_is_halved_rather_than_leave_a_rank_idle():
    plan = plan_step_rollout_tree([10, 12, 9, 11], Parallelism(dp=2), parent=[-1, 0, 1, 0], branch_at=[0, 6, 8, 4],
                                  pad_full_seq_to=64)
    assert all(len(rank) == 1 and rank[0] for rank in plan.ranks)
    assert sorted(b for rank in plan.ranks for b in rank[0]) == [0, 1, 2, 3]


def test_bad_trees_are_refused():
    with pytest.raises(PackingError, match=r"parent\[1\] = 1 is invalid; rollout 1's parent must be an earlier"):
        plan_step_rollout_tree([4, 4], Parallelism(dp=1), parent=[-1, 1], branch_at=[0, 2], pad_full_seq_to=16)
    with pytest.raises(PackingError, match=r"branch_at\[1\] = 5 is invalid for parent\[1\] = 0"):
        plan_step_rollout_tree([4, 6], Parallelism(dp=1), parent=[-1, 0], branch_at=[0, 5], pad_full_seq_to=16)
    with pytest.raises(PackingError, match=r"parent has 1 entries for 2 rollouts"):
        plan_step_rollout_tree([4, 6], Parallelism(dp=1), parent=[-1], branch_at=[0, 5], pad_full_seq_to=16)
    with pytest.raises(PackingError, match=r"lengths\[0\] = 20 takes 20 tokens alone"):
        plan_step_rollout_tree([20], Parallelism(dp=1), parent=[-1], branch_at=[0], pad_full_seq_to=16)


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10 ** 6))
def test_a_tree_microbatch_costs_its_packed_tokens_in_the_per_token_layers_too(seed):
    # the work's per-token term (6h per token: linear layers, and a hybrid's recurrent and convolution layers,
    # which run each node once from its parent's state) charges the tree's packed tokens, the node lengths
    # tree_layout packs, not its rollouts' full paths: two hidden sizes differ by 6 dh per packed token
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(1, 10), 40)
    lengths = torch.tensor(tree.lengths)
    packed = tree_layout(lengths, torch.tensor(tree.parent), torch.tensor(tree.branch_at), row_len=40,
                         spec=PackSpec(1)).total  # every node once, no padding (m 1)
    works = [plan_step_rollout_tree(tree.lengths, Parallelism(dp=1), parent=tree.parent, branch_at=tree.branch_at,
                                    pad_full_seq_to=512, hidden_size=h) for h in (8, 72)]
    assert [p.ranks for p in works] == [[[list(range(len(tree.lengths)))]]] * 2  # one microbatch, the whole tree
    per_token = works[1].microbatch_work[0][0] - works[0].microbatch_work[0][0]
    assert per_token == 6 * 64 * packed == 6 * 64 * works[0].real_tokens
    if packed < int(lengths.sum()):  # a shared node: its full paths would cost more
        assert per_token < 6 * 64 * int(lengths.sum())
