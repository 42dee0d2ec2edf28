"""Tier: pure CPU, single process (numpy).

find_rollout_tree: each rollout's parent is the earliest rollout sharing its longest common prefix,
against a pairwise loop reference (hypothesis, several chunk sizes); the tree it finds is one
tree_layout accepts and packs every shared token once; bad arguments refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.errors import PackingError
from nn_data.layout import PackSpec, tree_layout
from nn_data.planning import find_rollout_tree
from tests.support.hypothesis_profiles import examples


def reference(ids, lengths):
    parent, branch_at = [], []
    for b in range(len(lengths)):
        best, where = 0, -1
        for j in range(b):
            n = 0
            while n < min(lengths[b], lengths[j]) and ids[b][n] == ids[j][n]:
                n += 1
            if n > best:
                best, where = n, j
        parent.append(where)
        branch_at.append(best)
    return parent, branch_at


def test_the_docstring_example():
    ids = np.array([[1, 2, 3, 4, 0], [1, 2, 9, 0, 0], [1, 2, 3, 7, 7], [5, 0, 0, 0, 0]])
    found = find_rollout_tree(ids, [4, 3, 5, 1])
    assert found.parent.tolist() == [-1, 0, 0, -1] and found.branch_at.tolist() == [0, 2, 3, 0]


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data(), rows=st.integers(1, 8), chunk=st.sampled_from([1, 2, 3, 512]))
def test_the_longest_common_prefix_with_an_earlier_rollout(data, rows, chunk):
    seq_len = 10
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, 2), min_size=seq_len, max_size=seq_len),
                                      min_size=rows, max_size=rows)))
    lengths = data.draw(st.lists(st.integers(0, seq_len), min_size=rows, max_size=rows))
    found = find_rollout_tree(torch.from_numpy(ids), torch.tensor(lengths), chunk=chunk)
    assert (found.parent.tolist(), found.branch_at.tolist()) == reference(ids.tolist(), lengths)
    layout = tree_layout(torch.tensor(lengths), torch.from_numpy(found.parent), torch.from_numpy(found.branch_at),
                         row_len=seq_len, spec=PackSpec(1), input_ids=torch.from_numpy(ids))  # a valid tree
    shared = sum(found.branch_at.tolist())
    assert int(layout.layout.cu_seqlens[-1]) == sum(lengths) - shared  # every shared token once


def test_bad_arguments_are_refused():
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 7 is invalid; a rollout's length lies in \[0, S\], S = 4"):
        find_rollout_tree(np.zeros((2, 4)), [1, 7])
    with pytest.raises(PackingError, match=r"input_ids must be \[B, S\] and seq_lengths \[B\]"):
        find_rollout_tree(np.zeros(4), [1])
    with pytest.raises(PackingError, match=r"chunk=0 is invalid"):
        find_rollout_tree(np.zeros((1, 4)), [1], chunk=0)
