"""Tier: pure CPU, single process (float64; the compiled stream: inductor for the logits, aot_eager for the
hidden states). The multi-process CP / TP cases are
tests/multiprocess/test_shared_prefix_multiprocess.py.

Rollout log-probs ``[B, S-1]`` of a shared-prefix microbatch (TreeLogProbs from packed logits,
TreeLogProbsFromHidden from hidden states and the output weight) against every rollout run
alone through a plain log_softmax: values and gradients (logits; hidden states and weight), 1e-10. The
CP shard of the shared-prefix row: every rank's shard equals the loop reference's zigzag shard of
each slot, and unsharding every rank's gives the row back (CP 1, 2, 4).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, shared_prefix_layout
from nn_data.logprobs.from_tree import TreeLogProbs, TreeLogProbsFromHidden
from nn_data.testing.reference import reference_shard
from tests.support.hypothesis_profiles import examples
from tests.support.shared_prefix_reference import V, alone, alone_outputs, logprob_case as _case, reference, rollouts

TOL = dict(rtol=0, atol=1e-10)
H = 5


CASES = [([0, 0, 0, 1], [3, 3, 3, 2], [7, 3, 5, 6], 8),  # a group of three (an empty response), a group of one
         ([4, 5, 4], [0, 0, 0], [5, 0, 1], 6),  # no prompt; an empty rollout; a rollout of one token
         ([], [], [], 5),  # B = 0
         ([2, 2], [4, 4], [4, 6], 6)]  # the whole first rollout is its prompt


@pytest.mark.parametrize("groups, prefix, lengths, seq_len", CASES)
@pytest.mark.parametrize("chunk", [256, 3])
def test_from_logits_equals_every_rollout_alone(groups, prefix, lengths, seq_len, chunk):
    sp, ids, token, weights, gen = _case(groups, prefix, lengths, seq_len)
    packed_logits = torch.randn(1, sp.total, V, generator=gen, dtype=torch.float64, requires_grad=True)
    want = alone(lambda i: packed_logits[0, i], groups, prefix, lengths, ids, token, seq_len)
    ((want * weights).sum() + 0 * packed_logits.sum()).backward()  # + 0: a gradient (zeros) when B = 0
    want_grad, packed_logits.grad = packed_logits.grad, None
    with HostSyncCounter() as syncs:
        got = TreeLogProbs(chunk_tokens=chunk)(packed_logits, sp.pack(ids), sp)
    assert syncs.count == 0, syncs.calls
    assert got.shape == (len(lengths), seq_len - 1) and got.dtype == torch.float64
    torch.testing.assert_close(got, want.detach(), **TOL)
    (got * weights).sum().backward()
    torch.testing.assert_close(packed_logits.grad, want_grad, **TOL)


@pytest.mark.parametrize("groups, prefix, lengths, seq_len", CASES)
def test_from_hidden_equals_every_rollout_alone(groups, prefix, lengths, seq_len):
    sp, ids, token, weights, gen = _case(groups, prefix, lengths, seq_len, seed=1)
    hidden = torch.randn(1, sp.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    temperature = 0.7
    want = alone(lambda i: hidden[0, i] @ weight.T / temperature, groups, prefix, lengths, ids, token, seq_len)
    ((want * weights).sum() + 0 * (hidden.sum() + weight.sum())).backward()
    want_h, want_w = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    op = TreeLogProbsFromHidden(chunk_tokens=4, temperature=temperature)
    got = op(hidden, weight, sp.pack(ids), sp)
    torch.testing.assert_close(got, want.detach(), **TOL)
    (got * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, want_h, **TOL)
    torch.testing.assert_close(weight.grad, want_w, **TOL)
    # megatron-core's sequence-first hidden states [T, 1, H] give the same rows
    torch.testing.assert_close(op(hidden.detach().transpose(0, 1), weight.detach(), sp.pack(ids), sp), got.detach(),
                               **TOL)


def test_errors_name_the_argument():
    sp, ids, *_ = _case(*CASES[0])
    logits = torch.zeros(1, sp.total, V, dtype=torch.float64)
    with pytest.raises(PackingError, match=r"layout must be a TreeLayout"):
        TreeLogProbs()(logits, sp.pack(ids), sp.layout)
    with pytest.raises(PackingError, match=r"packed_ids has shape \(1, 3\)"):
        TreeLogProbs()(logits, sp.pack(ids)[:, :3], sp)
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 7 is outside \[0, seq_len=5\]"):
        TreeLogProbs()(logits, sp.pack(ids), sp, seq_len=5)
    with pytest.raises(RuntimeError, match=r"token ids must be in \[0, vocab=4\)"):
        TreeLogProbs()(logits[..., :4], sp.pack(ids), sp)
    hidden, weight = torch.zeros(1, sp.total, H, dtype=torch.float64), torch.zeros(V, H, dtype=torch.float64)
    with pytest.raises(PackingError, match=rf"hidden hold 3 tokens but this rank's share of the T={sp.total} "):
        TreeLogProbsFromHidden()(hidden[:, :3], weight, sp.pack(ids), sp)


def test_sequence_parallel_is_accepted_and_without_a_tp_group_changes_nothing():
    # the TP 2 sequence-parallel cases (the rows sharded over TP ranks, gathered inside) run over gloo in
    # tests/multiprocess/test_shared_prefix_multiprocess.py; without a TP group there is nothing to gather
    groups, prefix, lengths, seq_len = CASES[0]
    sp, ids, token, weights, gen = _case(groups, prefix, lengths, seq_len, seed=2)
    hidden = torch.randn(1, sp.total, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    want = alone(lambda i: hidden[0, i] @ weight.T, groups, prefix, lengths, ids, token, seq_len)
    op = TreeLogProbsFromHidden(chunk_tokens=4, sequence_parallel=True)
    assert op.sequence_parallel
    torch.testing.assert_close(op(hidden, weight, sp.pack(ids), sp), want, **TOL)


# ---- the CP shard of the shared-prefix row -------------------------------------------------------

@settings(max_examples=examples(25), deadline=None)
@given(sizes=st.lists(st.integers(1, 3), max_size=4), seed=st.integers(0, 2**16), cp=st.sampled_from([1, 2, 4]),
       host_reads=st.booleans())
def test_cp_shard_is_the_zigzag_of_every_slot_and_unshards_back(sizes, seed, cp, host_reads):
    gen = torch.Generator().manual_seed(seed)
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    seq_len = 9
    plen = {g: int(torch.randint(0, seq_len + 1, (), generator=gen)) for g in range(len(sizes))}
    prefix = [plen[g] for g in groups]
    lengths = [int(torch.randint(p, seq_len + 1, (), generator=gen)) for p in prefix]
    x = rollouts(groups, prefix, lengths, seq_len, trailing=(2,))
    total = 2 * cp * 48
    sp = shared_prefix_layout(torch.tensor(lengths, dtype=torch.int64), torch.tensor(prefix, dtype=torch.int64),
                              torch.tensor(groups, dtype=torch.int64), row_len=seq_len,
                              spec=PackSpec(2 * cp, fixed_total=total), host_reads=host_reads)
    ref, *_ = reference(groups, prefix, lengths, x, 2 * cp, total)
    packed = sp.pack(x)
    assert torch.equal(packed, ref.packed)
    shards = [sp.shard(packed, cp, r) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, reference_shard(ref.packed, ref.cu_seqlens_padded, cp, r))
        assert torch.equal(packed[0, sp.local_places(cp, r).source], shard[0])
    assert torch.equal(sp.unshard(torch.cat(shards), cp), packed)
    for r in range(cp):  # every node's boundary lies on exactly one rank
        places = sp.boundary_places(cp, r)
        assert torch.equal(sp.shard(packed, cp, r)[0, places.local][places.owned], packed[0, places.last][places.owned])
    owners = torch.stack([sp.boundary_places(cp, r).owned for r in range(cp)]).sum(0) if cp > 1 else None
    assert owners is None or owners.tolist() == [1] * (2 * len(groups))  # one per node slot


# ---- compiled: layout and log-probs in one graph over a stream ----------------------------------

STREAM = [([0, 0, 0, 1], [3, 3, 3, 2], [7, 3, 5, 6]), ([0, 1, 2, 3], [0, 1, 2, 8], [8, 1, 5, 8]),
          ([5, 5, 5, 5], [4, 4, 4, 4], [8, 4, 6, 5])]


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_one_compiled_graph_forward_and_backward_over_a_stream(source):
    from torch._dynamo.testing import CompileCounterWithBackend

    seq_len, total = 8, 48
    head = TreeLogProbsFromHidden(chunk_tokens=8)
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    op = TreeLogProbs(chunk_tokens=8) if source == "logits" else lambda h, ids, sp: head(h, weight, ids, sp)
    per_position = (lambda x: lambda i: x[0, i]) if source == "logits" else (lambda x: lambda i: x[0, i] @ weight.T)

    def step(x, ids, lengths, prefix, groups):
        sp = shared_prefix_layout(lengths, prefix, groups, row_len=seq_len, spec=PackSpec(2, fixed_total=total),
                                  input_ids=ids)
        return op(x, sp.pack(ids), sp)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if source == "logits" else "aot_eager")  # inductor once
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for k, (groups, prefix, lengths) in enumerate(STREAM):
        sp, ids, token, weights, gen = _case(groups, prefix, lengths, seq_len, fixed_total=total, seed=k)
        logits = torch.randn(1, total, V if source == "logits" else H, generator=gen, dtype=torch.float64,
                             requires_grad=True)  # the logits, or the hidden states
        want = alone(per_position(logits), groups, prefix, lengths, ids, token, seq_len)
        (want * weights).sum().backward()
        want_grad, logits.grad = logits.grad, None
        args = (logits, ids, torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups))
        with HostSyncCounter() as syncs:
            got = compiled(*args)
        assert k == 0 or syncs.count == 0, syncs.calls
        torch.testing.assert_close(got, want.detach(), **TOL)
        (got * weights).sum().backward()
        torch.testing.assert_close(logits.grad, want_grad, **TOL)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(STREAM)} microbatches"
    torch._dynamo.reset()


@pytest.mark.parametrize("groups, prefix, lengths, seq_len", CASES[:2] + CASES[3:])
def test_entropy_top_k_and_argmax_equal_every_rollout_alone(groups, prefix, lengths, seq_len):
    """``outputs()`` of both ops: the distributions at each rollout's tokens (the prompt's last position shared by
    the group), values and gradients of the hidden states and the weight / the logits, 1e-10."""
    sp, ids, token, weights, gen = _case(groups, prefix, lengths, seq_len, seed=2)
    hidden = torch.randn(1, sp.total, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    w_top = torch.randn(len(lengths), seq_len - 1, 3, generator=gen, dtype=torch.float64)
    ent, top, top_ids, arg = alone_outputs(lambda i: hidden[0, i] @ weight.T / 0.7, groups, prefix, lengths,
                                            seq_len, token, 3)
    ((ent * weights).sum() + (top * w_top).sum() + 0 * hidden.sum()).backward()
    want_h, want_w = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    op = TreeLogProbsFromHidden(chunk_tokens=4, temperature=0.7)
    got = op.outputs(hidden, weight, sp.pack(ids), sp, entropy=True, top_k=3, argmax=True)
    torch.testing.assert_close(got.logprobs, op(hidden, weight, sp.pack(ids), sp))
    torch.testing.assert_close(got.entropy, ent.detach(), **TOL)
    torch.testing.assert_close(got.topk_logprobs, top.detach(), **TOL)
    assert torch.equal(got.topk_indices, top_ids) and torch.equal(got.argmax, arg)
    ((got.entropy * weights).sum() + (got.topk_logprobs * w_top).sum()).backward()
    torch.testing.assert_close(hidden.grad, want_h, **TOL)
    torch.testing.assert_close(weight.grad, want_w, **TOL)
    logits = (hidden.detach() @ weight.detach().T / 0.7).requires_grad_()
    from_logits = TreeLogProbs(chunk_tokens=5).outputs(logits, sp.pack(ids), sp, logprobs=False, entropy=True)
    assert from_logits.logprobs is None and from_logits.argmax is None
    torch.testing.assert_close(from_logits.entropy, ent.detach(), **TOL)
    with pytest.raises(PackingError, match="asked for nothing"):
        op.outputs(hidden, weight, sp.pack(ids), sp, logprobs=False)
