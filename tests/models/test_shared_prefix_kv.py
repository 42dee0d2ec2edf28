"""Tier: pure CPU, single process. The GPU half (the real variable-length kernels over the same
buffers): tests/cuda/test_cuda_shared_prefix.py, a step of the GPU check.

The distinct query and key/value boundaries for TransformerEngine / flash-attention's varlen kernel
(nn_data.adapters.tree_kv): the index maps on the worked examples, and attention sequence by
sequence over the gathered buffer (bottom-right causal) == the packed row under nn_data's prefix mask, for the
GRPO groups (the depth-1 tree) and for rollout trees of depth 1 to 4 (``tree_kv``).
"""

from __future__ import annotations

import pytest
import torch

from nn_data.adapters.tree_kv import tree_kv
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, shared_prefix_layout, tree_layout
from tests.support import shared_prefix_kv_cases as kv_cases
from tests.support.tree_reference import BY_DEPTH, Tree, depth
from tests.support.megatron_release import needs_megatron_models

def _groups(groups, prefix, lengths, total: int):
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return shared_prefix_layout(as_long(lengths), as_long(prefix), as_long(groups),
                                row_len=max(lengths, default=1), spec=PackSpec(1, fixed_total=total))


EXAMPLE = _groups([7, 7, 9], [2, 2, 1], [4, 3, 3], 8)  # slot bounds [0, 2, 4, 4, 5, 6, 8]


def test_worked_example_boundaries_and_index_maps():
    assert EXAMPLE.layout.cu_seqlens_padded.tolist() == [0, 2, 4, 4, 5, 6, 8]
    kv = tree_kv(EXAMPLE, kv_capacity=16)
    assert kv.cu_seqlens_q.tolist() == [0, 2, 4, 4, 5, 6, 8, 8] and kv.cu_seqlens_q.dtype == torch.int32
    assert kv.cu_seqlens_kv.tolist() == [0, 2, 6, 6, 9, 10, 13, 16]  # the slack: 3 unused keys
    assert kv.kv_source.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 5, 6, 7, 0, 0, 0]
    assert kv.kv_valid.tolist() == [True] * 13 + [False] * 3
    assert (kv.max_seqlen_q, kv.max_seqlen_kv) == (8, 16)
    assert tree_kv(EXAMPLE, kv_capacity=13).cu_seqlens_kv.tolist()[-2:] == [13, 13]


def test_no_rollout_is_one_padding_sequence():
    kv = tree_kv(_groups([], [], [], 8), kv_capacity=8)
    assert kv.cu_seqlens_q.tolist() == [0, 8, 8] and kv.cu_seqlens_kv.tolist() == [0, 8, 8]


def test_capacity_is_checked():
    with pytest.raises(RuntimeError, match="kv_capacity=12 is too small"):  # a device-side assert
        tree_kv(EXAMPLE, kv_capacity=12)
    with pytest.raises(PackingError, match=r"kv_capacity=7 is invalid; expected an int >= total=8"):
        tree_kv(EXAMPLE, kv_capacity=7)


@pytest.mark.parametrize("row", kv_cases.ROWS, ids=lambda r: f"P{r[1]}-m{r[3]}")
def test_varlen_attention_over_the_buffer_equals_the_prefix_mask(row):
    """Float64: every real query's attention through the buffer (its prompt's real tokens then its own
    slot, bottom-right causal) equals the packed row under the dense prefix mask, to 1e-12."""
    shared, kv, total = kv_cases.shared_row(*row)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), kv.cu_seqlens_q, kv.cu_seqlens_kv)
    want = kv_cases.dense_reference(q, k, v, shared)
    real = kv_cases.real_queries(shared)
    groups, prefix, lengths, _ = row
    repeated = sum(p for b, (g, p) in enumerate(zip(groups, prefix)) if groups.index(g) != b)  # non-leaders' prompts
    assert int(real.sum()) == sum(lengths) - repeated  # each group's prompt once
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)


def _tree(tree: Tree, m: int, total: int, **kw):
    return tree_layout(torch.tensor(tree.lengths), torch.tensor(tree.parent), torch.tensor(tree.branch_at),
                       row_len=max(tree.lengths), spec=PackSpec(m, fixed_total=total), **kw)


def test_tree_worked_example():
    kv = tree_kv(_tree(Tree([6, 5], [-1, 0], [0, 2]), 1, 9), kv_capacity=14)
    assert kv.cu_seqlens_q.tolist() == [0, 2, 6, 6, 9, 9]
    assert kv.cu_seqlens_kv.tolist() == [0, 2, 8, 8, 13, 14]
    assert kv.kv_source.tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 8, 0]
    assert kv.kv_valid.tolist() == [True] * 13 + [False]


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("tree", BY_DEPTH, ids=[f"depth{depth(t)}" for t in BY_DEPTH])
def test_varlen_attention_over_a_trees_buffer_equals_the_tree_mask(tree, m):
    """Float64: every real query of a tree of depth 1 to 4 (nodes padded to ``m``), through the buffer (its
    path's tokens before its node, then the node, bottom-right causal), equals the packed row under the dense
    tree mask (each rollout alone), to 1e-12; the buffer needs at most ``T + N * S`` keys."""
    layout, kv, total = kv_cases.tree_row(tree, m)
    gen = torch.Generator().manual_seed(m)
    q, k, v = (torch.randn(total, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), kv.cu_seqlens_q, kv.cu_seqlens_kv)
    want = kv_cases.dense_reference(q, k, v, layout)
    real = kv_cases.real_queries(layout)
    assert int(real.sum()) == sum(n - a for n, a in zip(tree.lengths, tree.branch_at))  # every shared token once
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)


def test_a_layout_that_is_not_a_trees_is_refused_and_the_capacity_checked():
    chain = Tree([6, 8, 10], [-1, 0, 1], [0, 2, 5])  # depth 2
    wide = _tree(chain, 1, 24)  # 3B - 2 slots
    with pytest.raises(PackingError, match=r"tree_kv: layout must be a TreeLayout \(tree_layout\(...\) or "
                                           r"shared_prefix_layout\(...\)\), got PackLayout"):
        tree_kv(wide.layout, kv_capacity=64)
    with pytest.raises(RuntimeError, match=r"tree_kv: kv_capacity=24 is too small for this row \(it needs T \+ "
                                           r"the path tokens before every non-empty node\)"):
        tree_kv(wide, kv_capacity=24)


@needs_megatron_models
def test_packed_seq_params_carry_the_distinct_boundaries():
    from nn_data.adapters.tree_kv import tree_packed_seq_params

    kv = tree_kv(EXAMPLE, kv_capacity=16)
    params = tree_packed_seq_params(kv)
    assert params.qkv_format == "thd" and params.cu_seqlens_q is kv.cu_seqlens_q
    assert params.cu_seqlens_kv is kv.cu_seqlens_kv and params.cu_seqlens_kv_padded is kv.cu_seqlens_kv
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (8, 16)
