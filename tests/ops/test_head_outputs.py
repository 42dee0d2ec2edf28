"""Tier: pure CPU, single process (C = 1, no tensor parallelism; CP 2 / 4, TP 2, SP and TP 2 x CP 2 run in
tests/multiprocess/test_lm_head_multiprocess.py, ``case_outputs``).

The head's outputs in one chunked pass (``nn_data.logprobs.outputs``; ``TokenLogProbsFromHidden.outputs``,
``TokenLogProbs.outputs``): the log-probs, the entropy, the top-k log-probs and ids, the argmax against a float64
oracle on the full logits, values and every gradient (hidden states, weight, logits) at 1e-10, chunked and with
a temperature; tied input / output embeddings; float32 within its rounding; no logits-sized tensor with every
output on; no host sync; one compiled graph; every error message. Under a top-k / top-p sampling filter: every
output against the oracle on the filtered full logits (float64, values and gradients), from hidden states and
from logits, one compiled graph.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

from nn_data import PackingError, TokenLogProbs, TokenLogProbsFromHidden
from nn_data.diagnostics import Allocations, HostSyncCounter
from nn_data.logprobs import HeadOutputs, head_outputs_local, sampling_filter
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.testing.nemo_reference import reference_filter
from tests.support.lm_head_cases import (
    FILTERS, SEQ_LEN, TOP_K, assert_filtered_outputs_equal, assert_outputs_equal, case_filtered_outputs, case_outputs,
    head_inputs, output_weights, outputs_loss, reference_outputs,
)

TOL = dict(rtol=0, atol=1e-10)
ALL = dict(entropy=True, top_k=TOP_K, argmax=True)


def test_module_worked_example():
    z = torch.tensor([[0.0, 0.0, math.log(2), math.log(4)]], dtype=torch.float64)
    out = head_outputs_local(z, ids=torch.tensor([3]), entropy=True, top_k=2, argmax=True)
    p = torch.tensor([1 / 8, 1 / 8, 2 / 8, 4 / 8], dtype=torch.float64)
    assert math.isclose(out.logprobs.item(), math.log(0.5))
    assert math.isclose(out.entropy.item(), float(-(p * p.log()).sum())) and abs(out.entropy.item() - 1.2130) < 1e-4
    assert out.topk_indices.tolist() == [[3, 2]] and torch.allclose(out.topk_logprobs, p[[3, 2]].log()[None])
    assert out.argmax.tolist() == [3] and math.isclose(out.lse.item(), math.log(8))


def test_op_docstring_examples():
    ids, cu, cu_pad = torch.tensor([[0, 1, 2, 0]]), torch.tensor([0, 3]), torch.tensor([0, 4])
    want = torch.tensor([[0.0, math.log(3), math.log(3), 0.0]])
    got = TokenLogProbs(4).outputs(torch.zeros(1, 4, 3), ids, cu, cu_pad, entropy=True)
    assert torch.allclose(got.entropy, want) and got.argmax is None and got.lse is None
    got = TokenLogProbsFromHidden(4).outputs(torch.randn(1, 4, 5), torch.zeros(3, 5), ids, cu, cu_pad,
                                             entropy=True, logprobs=False)
    assert torch.allclose(got.entropy, want) and got.logprobs is None


def test_every_output_and_gradient_equal_the_oracle_from_hidden_states_and_from_logits():
    """The multi-process case in one process: every output, the entropy alone, chunked, temperature 0.7."""
    assert case_outputs(False) == (0, 0)


@pytest.mark.parametrize("asked", [dict(entropy=True), dict(top_k=1), dict(argmax=True, logprobs=False),
                                   dict(top_k=3, logprobs=False)], ids=str)
def test_each_output_alone_equals_the_oracle(asked):
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=2)
    top_k = asked.get("top_k", TOP_K)
    weights = output_weights(4, top_k=top_k)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    got = TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=7).outputs(h, w, inp.ids, inp.cu_seqlens,
                                                                   inp.cu_seqlens_padded, **asked)
    hr, wr = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    want = reference_outputs(hr @ wr.T, inp, top_k)
    want = {k: v for k, v in want.items() if getattr(got, k) is not None}
    assert_outputs_equal(got, want, str(asked))
    if any(k in want for k in ("logprobs", "entropy", "topk_logprobs")):
        outputs_loss(got, weights).backward()
        outputs_loss(want, weights).backward()
        torch.testing.assert_close(h.grad, hr.grad, **TOL)
        torch.testing.assert_close(w.grad, wr.grad, **TOL)


def test_tied_input_and_output_embeddings_get_both_gradients():
    """A weight that embeds the ids and scores the hidden states: its gradient sums both uses, as the float64
    unfused model's."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=3)
    mix = torch.randn(inp.hidden.shape[-1], inp.hidden.shape[-1], dtype=torch.float64,
                      generator=torch.Generator().manual_seed(4))
    weights = output_weights(4)

    def model(embedding, head):
        hidden = torch.tanh(embedding[inp.ids] @ mix)  # [1, T, H]
        return head(hidden, embedding)

    e1 = inp.weight.clone().requires_grad_()
    got = model(e1, lambda h, e: TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=5).outputs(
        h, e, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded, **ALL))
    outputs_loss(got, weights).backward()
    e2 = inp.weight.clone().requires_grad_()
    want = model(e2, lambda h, e: reference_outputs(h @ e.T, inp))
    outputs_loss(want, weights).backward()
    assert_outputs_equal(got, want, "tied")
    torch.testing.assert_close(e1.grad, e2.grad, **TOL)


def test_float32_inputs_are_within_float32_rounding_of_the_float64_oracle():
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=5)
    got = TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=8).outputs(inp.hidden.float(), inp.weight.float(), inp.ids,
                                                                   inp.cu_seqlens, inp.cu_seqlens_padded, **ALL)
    want = reference_outputs(inp.hidden @ inp.weight.T, inp)
    for name in ("logprobs", "entropy", "topk_logprobs"):
        assert getattr(got, name).dtype == torch.float32
        torch.testing.assert_close(getattr(got, name).double(), want[name], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax, want["argmax"]) and torch.equal(got.topk_indices, want["topk_indices"])


def test_no_logits_sized_tensor_with_every_output_on():
    """Forward and backward allocate ``[chunk, V]`` blocks (a few at a time), never ``[T, V]``; backward's only
    larger tensor is the weight's gradient."""
    vocab = 97
    inp = head_inputs([16, 16, 9], 1, pad_full_seq_to=48, seed=7, dtype=torch.float32, vocab=vocab)
    chunk, total = 4, inp.ids.shape[1]
    op = TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=chunk, validate=False)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    with Allocations() as fwd:
        out = op.outputs(h, w, inp.ids, layout=inp.layout, **ALL)
    assert max(fwd.sizes) <= chunk * vocab < total * vocab
    with Allocations() as bwd:
        outputs_loss(out, {k: v.float() for k, v in output_weights(3).items()}).backward()
    assert sorted(n for n in bwd.sizes if n > chunk * vocab) == [w.numel()]


def test_no_host_sync_without_validation():
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    with HostSyncCounter() as syncs:
        out = TokenLogProbsFromHidden(SEQ_LEN, validate=False).outputs(h, w, inp.ids, layout=inp.layout, **ALL)
        outputs_loss(out, output_weights(4)).backward()
        TokenLogProbs(SEQ_LEN, validate=False).outputs((inp.hidden @ inp.weight.T), inp.ids, layout=inp.layout, **ALL)
    assert syncs.calls == []


@pytest.mark.compile
def test_compiled_outputs_forward_and_backward_is_one_graph_and_equals_eager():
    op = TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=16, validate=False)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda *a, **k: op.outputs(*a, **k), fullgraph=True, backend=counter)
    for i, lengths in enumerate(([5, 0, 16, 3], [16, 16, 2, 9])):
        inp = head_inputs(lengths, 1, pad_full_seq_to=64, seed=20 + i, dtype=torch.float32)
        weights = {k: v.float() for k, v in output_weights(4).items()}
        results = []
        for fn in (compiled, op.outputs):
            h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
            out = fn(h, w, inp.ids, layout=inp.layout, **ALL)
            outputs_loss(out, weights).backward()
            results.append((out, h.grad, w.grad))
        (a, ah, aw), (b, bh, bw) = results
        for x, y in zip(a, b):
            if x is not None:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ah, bh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(aw, bw, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    torch._dynamo.reset()


def test_bad_arguments_name_the_argument_and_the_valid_values():
    inp = head_inputs([5, 3], 1, pad_full_seq_to=16)
    h, w, ids, cu, cu_pad = inp.hidden, inp.weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded
    op = TokenLogProbsFromHidden(SEQ_LEN)
    vocab = w.shape[0]
    cases = [
        (lambda: op.outputs(h, w, ids, cu, cu_pad, top_k=-1), "top_k must be an int >= 0 (0: no top-k output), got -1"),
        (lambda: op.outputs(h, w, ids, cu, cu_pad, top_k=vocab + 1),
         f"top_k={vocab + 1} is more than the vocabulary of {vocab} tokens"),
        (lambda: op.outputs(h, w, ids, cu, cu_pad, logprobs=False), "outputs() asked for nothing"),
        (lambda: TokenLogProbs(SEQ_LEN).outputs(h @ w.T, ids, cu, cu_pad, top_k=2.5), "top_k must be an int >= 0"),
        (lambda: head_outputs_local(h[0], w, ids=ids[0, :3]), "ids must be integer [N] or [N, J] with N=16"),
        (lambda: head_outputs_local(h[0], w, keep=torch.ones(16, dtype=torch.bool)), "keep selects which ids"),
        (lambda: head_outputs_local(h[0], w, top_k=-2), "top_k must be an int >= 0"),
        (lambda: head_outputs_local(h[0], w, chunk_tokens=0), "chunk_tokens=0 is invalid"),
        (lambda: head_outputs_local(h[0], w, temperature=0.0), "temperature"),
    ]
    for call, text in cases:
        with pytest.raises(PackingError) as e:
            call()
        assert text in str(e.value), (text, str(e.value))


def test_the_log_prob_alone_is_the_filtered_kernels_and_every_field_is_a_head_output():
    """``outputs()`` with the log-probs alone equals ``forward`` (top-k / top-p filter included)."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=9)
    op = TokenLogProbsFromHidden(SEQ_LEN, sampling_params=TrainingSamplingParams(top_k=6, top_p=0.8))
    got = op.outputs(inp.hidden, inp.weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded)
    assert isinstance(got, HeadOutputs) and got.entropy is None
    assert torch.equal(got.logprobs, op(inp.hidden, inp.weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded))


def test_every_output_under_a_top_k_top_p_filter_equals_the_oracle_on_the_filtered_logits():
    """The single-process split of the multi-process case: top-k, top-p, both; some top-k entries and some
    targets are filtered (``-inf``), their gradients still the autograd ones through the filtered
    log-softmax."""
    _, _, short, dropped = case_filtered_outputs(False)
    assert short > 0 and dropped > 0


@pytest.mark.parametrize("sampling", FILTERS, ids=["top-k", "top-p", "both"])
def test_filtered_outputs_from_logits_equal_those_from_hidden_states(sampling):
    """``head_outputs_local`` on the logits (read, not recomputed) with a filter: the same values and the
    logits' gradient the oracle's."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=10)
    filt = sampling_filter(sampling)
    ids = inp.ids[0].roll(-1)  # [T] the next token of each position (the last one wraps; still an id)
    ask = dict(ids=ids, entropy=True, top_k=TOP_K, argmax=True, chunk_tokens=6, sampling=filt)
    weights = {"logprobs": torch.randn(48, dtype=torch.float64), "entropy": torch.randn(48, dtype=torch.float64),
               "topk_logprobs": torch.randn(48, TOP_K, dtype=torch.float64)}
    z = (inp.hidden[0] @ inp.weight.T).requires_grad_()  # [T, V]
    got = head_outputs_local(z, **ask)
    outputs_loss(got, weights).backward()
    fused = head_outputs_local(inp.hidden[0], inp.weight, **ask)
    zr = z.detach().clone().requires_grad_()
    kept = torch.stack([reference_filter(row, sampling.top_k, sampling.top_p) for row in zr.detach()])  # [T, V]
    lp = torch.log_softmax(torch.where(kept, zr, float("-inf")), dim=-1)  # [T, V]
    top = torch.topk(lp, TOP_K)
    want = {"logprobs": lp.gather(1, ids[:, None]).squeeze(1), "entropy": -(lp.exp() * lp.masked_fill(~kept, 0)).sum(1),
            "topk_logprobs": top.values, "topk_indices": top.indices, "argmax": zr.argmax(1)}
    outputs_loss(want, weights).backward()
    for out in (got, fused):
        assert_filtered_outputs_equal(out._replace(lse=None), want, str(sampling))
    torch.testing.assert_close(z.grad, zr.grad, **TOL)


def test_compiled_filtered_outputs_are_one_graph_and_equal_eager():
    """Every output under a top-k / top-p filter, forward and backward, compiled with inductor: one graph,
    eager's values (``-inf`` included) and gradients."""
    op = TokenLogProbsFromHidden(SEQ_LEN, chunk_tokens=16, validate=False, sampling_params=FILTERS[2])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda *a, **k: op.outputs(*a, **k), fullgraph=True, backend=counter)
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=64, seed=22, dtype=torch.float32)
    weights = {k: v.float() for k, v in output_weights(4).items()}
    results = []
    for fn in (compiled, op.outputs):
        h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
        out = fn(h, w, inp.ids, layout=inp.layout, **ALL)
        outputs_loss(out, weights).backward()
        results.append((out, h.grad, w.grad))
    (a, ah, aw), (b, bh, bw) = results
    assert torch.isinf(b.topk_logprobs).any()
    for name in ("logprobs", "entropy", "topk_logprobs", "argmax"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ah, bh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aw, bw, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    torch._dynamo.reset()
