"""Tier: pure CPU, single process.

Rollout trees (nn_data.layout.tree_layout, nn_data.masks.PrefixRule): every rollout's own tokens packed
once as the nodes of the tree, against a loop reference built rollout by rollout (tests/support/
tree_reference.py): the packed row and slots, positions, unpack to every rollout's own row, the attention
rule equal to each rollout alone (dense and block), log-probs and the head's other outputs per rollout (also
compiled: one graph over a stream of trees, marker ``compile``); bad
trees refused naming the rollout and the field (one host read) or by a device assert; the shared-prompt
spelling is the depth-1 tree.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, TreeLayout, shared_prefix_layout, tree_layout
from nn_data.logprobs import TreeLogProbs, TreeLogProbsFromHidden
from nn_data.masks import document_causal_mask
from tests.support.hypothesis_profiles import examples
from tests.support.tree_reference import (BY_DEPTH, Tree, alone_outputs, depth, owner, path_place, random_tree,
                                         reference, token_ids)


def build(tree: Tree, seq_len: int, m: int = 1, total=None, **kw) -> TreeLayout:
    return tree_layout(torch.tensor(tree.lengths, dtype=torch.int64), torch.tensor(tree.parent, dtype=torch.int64),
                       torch.tensor(tree.branch_at, dtype=torch.int64), row_len=seq_len,
                       spec=PackSpec(m, fixed_total=total), **kw)


def reference_mask(tree: Tree, ref) -> torch.Tensor:
    """``[T, T]`` from each rollout alone: a real query, token ``s`` of its node's rollout ``r``, sees the
    packed places of ``r``'s tokens ``s' <= s`` (its path), nothing else; padding rows left False."""
    total = len(ref.packed)
    out = torch.zeros(total, total, dtype=torch.bool)
    for i, t in enumerate(ref.packed):
        if t is not None:
            for s in range(t[1] + 1):
                out[i, path_place(tree, ref, t[0], s)] = True
    return out


def test_the_docstring_example():
    tree = Tree([5, 4], [-1, 0], [0, 3])
    x = token_ids(tree, 5)
    layout = build(tree, 5, input_ids=x)
    assert layout.layout.cu_seqlens_padded.tolist() == [0, 3, 5, 5, 6]
    assert layout.pack(x).tolist() == [[1000, 1001, 1002, 1003, 1004, 2003]]
    assert layout.positions().tolist() == [0, 1, 2, 3, 4, 3]
    assert torch.equal(layout.unpack(layout.pack(x), fill=-1), x)


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10 ** 6), rows=st.integers(1, 7), m=st.sampled_from([1, 2, 3]),
       host_reads=st.booleans())
def test_pack_positions_unpack_and_mask_equal_each_rollout_alone(seed, rows, m, host_reads):
    seq_len = 9
    tree = random_tree(random.Random(seed), rows, seq_len)
    capacity = max(3 * rows - 2, 2 * rows)
    total = capacity * (seq_len + m) + 4
    ref = reference(tree, capacity, m, total)
    x = token_ids(tree, seq_len, trailing=(2,))
    layout = build(tree, seq_len, m, total, input_ids=x, host_reads=host_reads)
    assert layout.layout.cu_seqlens_padded.tolist() == ref.cu_seqlens_padded
    packed = layout.pack(x, fill=-5)
    want = [x[b, s].tolist() if (b, s) != (None, None) else [-5, -5]
            for b, s in ((t if t is not None else (None, None)) for t in ref.packed)]
    assert packed[0].tolist() == want
    real = [i for i, t in enumerate(ref.packed) if t is not None]
    assert layout.positions()[real].tolist() == [ref.packed[i][1] for i in real]
    assert torch.equal(layout.unpack(packed, fill=-5), torch.where(x >= 0, x, -5))
    mask = document_causal_mask(torch.arange(total), layout.segment_ids(), prefix=layout.prefix_rule())
    assert torch.equal(mask[real], reference_mask(tree, ref)[real])
    assert mask.diagonal().all()  # every query (padding too) sees itself: no empty softmax row


def test_the_block_mask_is_the_dense_one():
    from torch.nn.attention.flex_attention import create_mask

    tree = Tree([70, 50, 90, 60, 20], [-1, 0, 1, 0, -1], [0, 30, 40, 10, 0])
    layout = build(tree, 90, 4, 512)
    rule, seg = layout.prefix_rule(), layout.segment_ids()
    from nn_data.masks import sees

    block = create_mask(lambda b, h, q, kv: sees(q, kv, seg, 16, rule), None, None, 512, 512, device="cpu")
    assert torch.equal(block[0, 0], document_causal_mask(torch.arange(512), seg, 16, rule))


@pytest.mark.parametrize("from_hidden", [False, True])
def test_logprobs_per_rollout_equal_each_rollout_alone(from_hidden):
    vocab, hidden_size, seq_len = 13, 5, 12
    for seed in range(6):
        rng = random.Random(seed)
        tree = random_tree(rng, rng.randint(1, 7), seq_len)
        ids = token_ids(tree, seq_len) % vocab
        layout = build(tree, seq_len, 2, 160, input_ids=ids.clamp(min=0))
        packed_ids = layout.pack(ids.clamp(min=0))
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(1, 160, hidden_size, dtype=torch.float64, generator=gen)
        weight = torch.randn(vocab, hidden_size, dtype=torch.float64, generator=gen)
        logits = hidden @ weight.T  # [1, T, V]
        if from_hidden:
            got = TreeLogProbsFromHidden(chunk_tokens=7)(hidden, weight, packed_ids, layout)
        else:
            got = TreeLogProbs(chunk_tokens=7)(logits, packed_ids, layout)
        ref = reference(tree, layout.nodes.owner.shape[0] - 1, 2, 160)
        want = torch.zeros(len(tree.lengths), seq_len - 1, dtype=torch.float64)
        for b, n in enumerate(tree.lengths):
            for s in range(n - 1):
                row = logits[0, path_place(tree, ref, b, s)].log_softmax(-1)
                want[b, s] = row[ids[b, s + 1]]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


OUTPUTS = ("logprobs", "entropy", "topk_logprobs", "topk_indices", "argmax")


@pytest.mark.parametrize("tree", BY_DEPTH, ids=[f"depth{depth(t)}" for t in BY_DEPTH])
def test_every_head_output_per_rollout_equals_each_rollout_alone(tree):
    """``outputs()`` on trees of depth 1 to 4, from hidden states (temperature 0.7) and from logits: the
    log-prob, entropy, top-3 log-probs and ids and argmax of every rollout as ``[B, S-1]`` rows equal each
    rollout alone through the full logits; the gradients of a loss on the log-prob, the entropy and the top-3
    log-probs, of the hidden states and the weight (and of the logits), too (float64, 1e-10); no host sync."""
    vocab, hidden_size, seq_len, total = 11, 5, 19, 120
    ids = token_ids(tree, seq_len).clamp(min=0) % vocab
    layout = build(tree, seq_len, 2, total, input_ids=ids)
    ref = reference(tree, layout.nodes.owner.shape[0] - 1, 2, total)
    gen = torch.Generator().manual_seed(depth(tree))
    hidden = torch.randn(1, total, hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
    w = {k: torch.randn(len(tree.lengths), seq_len - 1, *([3] if k == "topk_logprobs" else []), dtype=torch.float64,
                        generator=gen) for k in ("logprobs", "entropy", "topk_logprobs")}

    def loss(out):
        return sum((out[k] * w[k]).sum() for k in w) + 0 * hidden.sum()

    want = alone_outputs(tree, ref, ids, lambda k: hidden[0, k] @ weight.T / 0.7, seq_len, 3)
    want_h, want_w = torch.autograd.grad(loss(want), (hidden, weight))
    op = TreeLogProbsFromHidden(chunk_tokens=7, temperature=0.7)
    packed_ids = layout.pack(ids)
    with HostSyncCounter() as syncs:
        got = op.outputs(hidden, weight, packed_ids, layout, entropy=True, top_k=3, argmax=True)._asdict()
    assert syncs.count == 0, syncs.calls
    for name in OUTPUTS:
        torch.testing.assert_close(got[name], want[name].detach(), rtol=0, atol=1e-10, msg=name)
    got_h, got_w = torch.autograd.grad(loss(got), (hidden, weight))
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-10)
    logits = (hidden.detach() @ weight.detach().T / 0.7).requires_grad_()  # [1, T, V]
    want = alone_outputs(tree, ref, ids, lambda k: logits[0, k], seq_len, 3)
    with HostSyncCounter() as syncs:
        got = TreeLogProbs(chunk_tokens=5).outputs(logits, packed_ids, layout, entropy=True, top_k=3,
                                                           argmax=True)._asdict()
    assert syncs.count == 0, syncs.calls
    for name in OUTPUTS:
        torch.testing.assert_close(got[name], want[name].detach(), rtol=0, atol=1e-10, msg=name)
    torch.testing.assert_close(torch.autograd.grad(loss(got), logits)[0], torch.autograd.grad(loss(want), logits)[0],
                               rtol=0, atol=1e-10)


#: Trees of six rollouts and depths 4, 3 and 1 (a forest with an empty rollout): one shape for the graph.
STREAM = (Tree([10, 12, 13, 14, 15, 11], [-1, 0, 1, 2, 3, 0], [0, 3, 6, 9, 12, 3]),
          Tree([9, 13, 15, 18, 6, 4], [-1, 0, 1, 2, 0, -1], [0, 4, 9, 15, 2, 0]),
          Tree([8, 5, 11, 0, 7, 9], [-1, 0, 0, -1, -1, 4], [0, 5, 5, 0, 0, 3]))


@pytest.mark.compile
def test_the_layout_and_every_head_output_compile_into_one_graph_over_a_stream_of_trees():
    """``tree_layout`` (no host read) and ``outputs()`` from hidden states in one ``fullgraph`` graph over trees
    whose depths and lengths vary: no host sync after the first call; values and the hidden states' gradient
    equal each rollout alone (float64, 1e-10)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    vocab, hidden_size, seq_len, total = 11, 5, 19, 120
    op = TreeLogProbsFromHidden(chunk_tokens=7)

    def step(hidden, weight, ids, lengths, parent, branch_at):
        layout = tree_layout(lengths, parent, branch_at, row_len=seq_len, spec=PackSpec(2, fixed_total=total),
                             input_ids=ids, host_reads=False)
        return op.outputs(hidden, weight, layout.pack(ids), layout, entropy=True, top_k=3, argmax=True)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for k, tree in enumerate(STREAM):
        ids = token_ids(tree, seq_len).clamp(min=0) % vocab
        ref = reference(tree, 3 * len(tree.lengths) - 2, 2, total)
        gen = torch.Generator().manual_seed(k)
        hidden = torch.randn(1, total, hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
        weight = torch.randn(vocab, hidden_size, dtype=torch.float64, generator=gen)
        want = alone_outputs(tree, ref, ids, lambda i: hidden[0, i] @ weight.T, seq_len, 3)
        want_h, = torch.autograd.grad(want["entropy"].sum() + want["topk_logprobs"].sum() + 0 * hidden.sum(), hidden)
        with HostSyncCounter() as syncs:
            got = compiled(hidden, weight, ids, *(torch.tensor(x) for x in tree))._asdict()
        assert k == 0 or syncs.count == 0, syncs.calls
        for name in OUTPUTS:
            torch.testing.assert_close(got[name], want[name].detach(), rtol=0, atol=1e-10, msg=name)
        got_h, = torch.autograd.grad(got["entropy"].sum() + got["topk_logprobs"].sum(), hidden)
        torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-10)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(STREAM)} trees"
    torch._dynamo.reset()


def test_the_shared_prompt_is_the_depth_1_tree():
    groups, prefix, lengths = [4, 4, 4, 8, 8], [3, 3, 3, 2, 2], [7, 3, 9, 5, 6]
    leader = [0, 0, 0, 3, 3]
    tree = Tree(lengths, [-1 if leader[b] == b else leader[b] for b in range(5)],
                [0 if leader[b] == b else prefix[b] for b in range(5)])
    x = token_ids(tree, 9)
    shared = shared_prefix_layout(torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups), row_len=9,
                                  spec=PackSpec(2, fixed_total=64), input_ids=x)
    as_tree = build(tree, 9, 2, 64, input_ids=x, node_capacity=10)
    assert torch.equal(shared.layout.cu_seqlens_padded, as_tree.layout.cu_seqlens_padded)
    assert torch.equal(shared.pack(x), as_tree.pack(x))
    assert torch.equal(shared.positions(), as_tree.positions())
    for a, b in zip(shared.prefix_rule(), as_tree.prefix_rule()):
        assert torch.equal(a, b)


# ---- bad trees ---------------------------------------------------------------------------------------

BAD = [
    (Tree([4, 4], [1, -1], [2, 0]), r"parent\[0\] = 1 is invalid; rollout 0's parent must be an earlier rollout"),
    (Tree([4, 4], [-1, 1], [0, 2]), r"parent\[1\] = 1 is invalid; rollout 1's parent must be an earlier rollout, "
                                    r"in \[0, 1\)"),
    (Tree([4, 4], [-1, -2], [0, 0]), r"parent\[1\] = -2 is invalid"),
    (Tree([4, 4], [-1, 2], [0, 2]), r"parent\[1\] = 2 is invalid; rollout 1's parent must be an earlier rollout, "
                                   r"in \[0, 1\)"),  # past the rollouts: refused, never read
    (Tree([4, 4], [5, -1], [2, 0]), r"parent\[0\] = 5 is invalid; rollout 0's parent must be an earlier rollout"),
    (Tree([4, 4], [-1, -1], [0, 2]), r"branch_at\[1\] = 2 but parent\[1\] = -1: a rollout without a parent"),
    (Tree([4, 6], [-1, 0], [0, 5]), r"branch_at\[1\] = 5 is outside \(branch_at\[0\] = 0, min\(seq_lengths\[0\], "
                                    r"seq_lengths\[1\]\) = 4\]"),
    (Tree([4, 6, 6], [-1, 0, 1], [0, 2, 2]), r"branch_at\[2\] = 2 is outside \(branch_at\[1\] = 2, "),
    (Tree([4, 6], [-1, 0], [0, 0]), r"branch_at\[1\] = 0 is outside \(branch_at\[0\] = 0, "),
]


@pytest.mark.parametrize("tree, message", BAD)
def test_bad_trees_are_refused_naming_the_rollout_and_the_field(tree, message):
    with pytest.raises(PackingError, match=message):
        build(tree, 6)
    with pytest.raises(RuntimeError, match=r"nn_data.tree_layout: every (parent|branch_at)"):
        build(tree, 6, host_reads=False)


def test_a_parent_past_the_rollouts_reads_in_range_without_validation():
    tree = Tree([4, 4, 3], [-1, 7, 0], [0, 2, 1])
    x = token_ids(Tree([4, 4, 3], [-1, 0, 0], [0, 2, 1]), 4)
    with pytest.raises(PackingError, match=r"parent\[1\] = 7 is invalid; rollout 1's parent must be an earlier"):
        build(tree, 4, input_ids=x)
    layout = build(tree, 4, input_ids=x, validate=False, host_reads=False, node_capacity=7)
    assert 0 <= int(layout.maps.source.min()) and int(layout.maps.source.max()) < 3 * 4
    assert int(layout.parent.max()) < 3 and layout.pack(x).shape[1] == layout.total


def test_shared_tokens_that_differ_are_refused():
    tree = Tree([4, 4], [-1, 0], [0, 2])
    x = token_ids(tree, 4)
    x[1, 1] = 7
    with pytest.raises(PackingError, match=r"input_ids\[1, :2\] differs from input_ids\[0, :2\]: rollout 1 must "
                                           r"share its first branch_at\[1\] = 2 tokens with its parent 0"):
        build(tree, 4, input_ids=x)
    with pytest.raises(RuntimeError, match=r"must share its first branch_at tokens of input_ids with its parent"):
        build(tree, 4, input_ids=x, host_reads=False)


def test_too_few_node_slots_are_refused():
    tree = Tree([6, 5, 4], [-1, 0, 0], [0, 2, 4])  # rollout 0 splits twice: 7 slots
    with pytest.raises(PackingError, match=r"node_capacity=6 is too small for this tree: it needs 7 node slots"):
        build(tree, 6, node_capacity=6)
    with pytest.raises(RuntimeError, match=r"node_capacity=6 is too small for this tree"):
        build(tree, 6, node_capacity=6, host_reads=False)
    with pytest.raises(PackingError, match=r"node_capacity=5 is invalid; expected an int >= 2B = 6"):
        build(tree, 6, node_capacity=5)
    assert build(tree, 6).nodes.owner.shape[0] == 8  # the default, 3B - 2 = 7 slots (+ 1 trailing entry)


def test_padding_rows_must_be_roots():
    tree = Tree([4, 0], [-1, 0], [0, 0])
    with pytest.raises(PackingError, match=r"parent\[1\] = 0 is invalid; rollout 1's parent must be -1 \(a padding row\)"):
        build(tree, 4, num_rows=torch.tensor(1))
