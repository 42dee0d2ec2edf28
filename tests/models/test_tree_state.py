"""Tier: pure CPU, single process (no model).

The pieces of nn_data.adapters.tree_state on their own: each token's predecessor on its path and the chunk rows
of a tree row, the path convolution against a plain convolution of each rollout alone, and the doubling scan
against a loop over each chain.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.adapters.tree_state import tree_conv, tree_scan, tree_steps
from nn_data.layout.tree_nodes import EVERY
from nn_data.masks import PrefixRule


def _rule(owner, position, shared, visible=None) -> PrefixRule:
    owner, position = torch.tensor(owner), torch.tensor(position)
    visible = torch.ones_like(owner, dtype=torch.bool) if visible is None else torch.tensor(visible)
    return PrefixRule(owner, visible, position, torch.tensor(shared))


def test_the_worked_example():
    """Rollouts [p p r0 r0 r1] (rollout 1 branches from 0 at position 2), c 2, N 4."""
    rule = _rule([0, 0, 0, 0, 1], [0, 1, 2, 3, 2], [[EVERY, 0, 0], [2, EVERY, 0], [0, 0, 0]])
    steps = tree_steps(rule, 2, 4)
    assert steps.pred.tolist() == [5, 0, 1, 2, 1]
    assert steps.chunk_source[:3].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert steps.chunk_prev[:3].tolist() == [steps.chunk_source.shape[0], 0, 0]


def test_padding_is_in_no_chunk_and_a_chunk_never_spans_a_branch_point():
    """[p p p pad r0 r1]: rollout 1 and rollout 0's own token both continue the prompt (positions 3);
    a padding slot between them."""
    rule = _rule([0, 0, 0, 2, 0, 1], [0, 1, 2, 0, 3, 3], [[EVERY, 0, 0], [3, EVERY, 0], [0, 0, 0]],
                 [True, True, True, False, True, True])
    steps = tree_steps(rule, 4, 3)
    assert steps.pred.tolist() == [6, 0, 1, 6, 2, 2]
    rows = steps.chunk_source.shape[0]
    assert steps.chunk_source[:3].tolist() == [[0, 1, 2, 6], [4, 6, 6, 6], [5, 6, 6, 6]]
    assert steps.chunk_prev[:3].tolist() == [rows, 0, 0] and steps.packed_slot[3] == rows * 4


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.data())
def test_the_scan_equals_a_loop_down_each_chain(lengths, data):
    """Random forests of chunks (each chunk's predecessor an earlier one, or none): matrix and scalar maps."""
    rows = len(lengths)
    prev = [data.draw(st.integers(-1, j - 1)) for j in range(rows)]
    gen = torch.Generator().manual_seed(rows)
    matrix = torch.randn(rows, 2, 3, 3, generator=gen, dtype=torch.float64) / 2
    scalar = torch.rand(rows, 2, 1, 1, generator=gen, dtype=torch.float64)
    final = torch.randn(rows, 2, 3, 4, generator=gen, dtype=torch.float64)
    index = torch.tensor([p if p >= 0 else rows for p in prev])
    for m in (matrix, scalar):
        want = []
        for j in range(rows):  # F_j = M_j F_prev + U_j; the start of j is F_prev(j)
            start = torch.zeros(2, 3, 4, dtype=torch.float64) if prev[j] < 0 else \
                (m[prev[j]] @ want[prev[j]][0] if m.shape[-1] > 1 else m[prev[j]] * want[prev[j]][0]) + final[prev[j]]
            want.append((start,))
        got = tree_scan(m, final, index)
        torch.testing.assert_close(got, torch.stack([w[0] for w in want]), rtol=0, atol=1e-12)


def test_the_path_convolution_is_each_rollout_convolved_alone():
    """[p p p r0 r0 r1 r1] (rollout 1 branches after the prompt of 3), a 4-tap depthwise convolution."""
    rule = _rule([0, 0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 4, 3, 4], [[EVERY, 0, 0], [3, EVERY, 0], [0, 0, 0]])
    steps = tree_steps(rule, 2, 4)
    conv = torch.nn.Conv1d(5, 5, 4, groups=5, padding=3).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    got = tree_conv(x, conv, steps)
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):
        alone = conv(x[rows].t()[None])[0, :, : len(rows)].t()  # [n, C]
        torch.testing.assert_close(got[rows[3:]], alone[3:], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[:3], alone[:3], rtol=0, atol=1e-12)
