"""Tier: pure CPU, single process (C = 1, no tensor parallelism; CP 2, TP 2 and TP 2 x CP 2 run in
tests/multiprocess/test_lm_head_multiprocess.py).

``TokenLogProbsFromHidden`` (log-probs from hidden states and the output weight, no logits) against the
unfused path, ``TokenLogProbs`` on the logits ``hidden @ weight.T / temperature``, and the loop oracle:
values and the gradients of the hidden states and of the weight in float64 at 1e-10 (chunked, with a
temperature, both hidden layouts, both executors and a travelling layout, top-k / top-p against the
unfused kernel); float32 / bfloat16; what it allocates (no logits-sized tensor); host syncs; one compiled
graph over a stream of microbatches, forward and backward; meta tensors; every error message.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.testing

from nn_data import NextTokenTargets, PackingError, TokenLogProbs, TokenLogProbsFromHidden
from nn_data.diagnostics import HostSyncCounter
from nn_data.logprobs.kernels import hidden_logprobs_local
from nn_data.logprobs import token_logprobs_local
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.logprobs.filters import sampling_filter
from nn_data.diagnostics import Allocations
from tests.support.lm_head_cases import HIDDEN, BATCHES, SEQ_LEN, VOCAB, head_inputs, reference

TOL = dict(rtol=0, atol=1e-10)
S = SEQ_LEN


def _run(op, inp, hidden=None, weight=None, **kwargs):
    """``(rows, d hidden, d weight)`` of ``sum(rows * loss_weight)`` through ``op``."""
    h = (inp.hidden if hidden is None else hidden).clone().requires_grad_()
    w = (inp.weight if weight is None else weight).clone().requires_grad_()
    args = kwargs or dict(cu_seqlens=inp.cu_seqlens, cu_seqlens_padded=inp.cu_seqlens_padded)
    out = op(h, w, inp.ids, **args)
    (out * inp.loss_weight.to(out.dtype)).sum().backward()
    return out.detach(), h.grad, w.grad


def _unfused(inp, temperature=1.0):
    """The unfused path as users run it: the output layer's logits, then ``TokenLogProbs``."""
    return _run(lambda h, w, ids, **kw: TokenLogProbs(S)(h @ w.T / temperature, ids, **kw), inp)


def _assert_same(got, want, what):
    for name, a, b in zip(("values", "d hidden", "d weight"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


def test_docstring_example():
    out = TokenLogProbsFromHidden(4)(torch.zeros(1, 4, 2), torch.zeros(3, 2), torch.tensor([[1, 2, 0, 0]]),
                                     torch.tensor([0, 3]), torch.tensor([0, 4]))
    assert torch.allclose(out, torch.tensor([[0.0, math.log(1 / 3), math.log(1 / 3), 0.0]]))


@pytest.mark.parametrize("lengths", list(BATCHES) + [[0, 0], []], ids=str)
def test_values_and_both_gradients_equal_the_unfused_path_and_the_oracle(lengths):
    inp = head_inputs(lengths, 1, pad_full_seq_to=48, seed=len(lengths))
    for temperature in (1.0, 0.7):
        unfused, oracle = _unfused(inp, temperature), reference(inp, temperature)
        _assert_same(unfused, oracle, "unfused vs oracle")
        for chunk in (1, 5, 256):
            op = TokenLogProbsFromHidden(S, chunk_tokens=chunk, temperature=temperature)
            got = _run(op, inp)
            _assert_same(got, unfused, f"t {temperature} chunk {chunk}")
            assert got[0].shape == (len(lengths), S) and got[0].dtype == torch.float64
    assert unfused[2].abs().sum() > 0 or not sum(lengths)


def test_megatron_layout_and_executors_and_a_travelling_layout_agree():
    """Hidden states ``[T, 1, H]`` (megatron-core's sequence-first), the host and the device executor and
    the pack's layout (no host read) give the same values and gradients."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=3)
    want = _unfused(inp)
    seq_first = _run(TokenLogProbsFromHidden(S, chunk_tokens=7), inp, hidden=inp.hidden.transpose(0, 1))
    _assert_same((seq_first[0], seq_first[1].transpose(0, 1), seq_first[2]), want, "[T, 1, H]")
    _assert_same(_run(TokenLogProbsFromHidden(S, chunk_tokens=7, host_reads=False), inp), want, "device")
    op = TokenLogProbsFromHidden(S, chunk_tokens=7)
    with HostSyncCounter() as syncs:
        got = _run(op, inp, layout=inp.layout)
    assert syncs.calls == []
    _assert_same(got, want, "layout=")
    local = op.local(inp.hidden, inp.weight, inp.ids, layout=inp.layout)
    assert local.shape == (1, 48) and torch.equal(local[0, 0], got[0][0, 1])  # position 0 scores token 1


@pytest.mark.parametrize("sampling", [TrainingSamplingParams(top_k=6), TrainingSamplingParams(top_p=0.8),
                                      TrainingSamplingParams(top_k=12, top_p=0.7)], ids=["top-k", "top-p", "both"])
def test_top_k_top_p_from_hidden_states_equal_those_read_from_the_logits(sampling):
    """The filter is one threshold per token, computed from each chunk's logits: exact, values (``-inf`` for
    a filtered target) and gradients, from hidden states (recomputed in backward) against the same kernel
    reading the logits (``token_logprobs_local``); the oracle on the filtered full logits:
    ``tests/ops/test_head_outputs.py``."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=4)
    targets = NextTokenTargets()(inp.ids, layout=inp.layout)
    target, keep = targets.targets[0].clamp(min=0), targets.loss_mask[0].bool()
    w = inp.loss_weight.reshape(-1)[:48]
    results = []
    for fused in (True, False):
        h, wt = inp.hidden[0].clone().requires_grad_(), inp.weight.clone().requires_grad_()
        if fused:
            out = hidden_logprobs_local(h, wt, target, keep, chunk_tokens=5, sampling=sampling_filter(sampling))
        else:
            out = token_logprobs_local(h @ wt.T, target, keep, chunk_tokens=5, sampling=sampling_filter(sampling))
        (torch.where(torch.isinf(out), 0.0, out) * w).sum().backward()
        results.append((out.detach(), h.grad, wt.grad))
    (fused_out, *fused_grads), (plain_out, *plain_grads) = results
    assert torch.equal(torch.isinf(fused_out), torch.isinf(plain_out)) and torch.isinf(fused_out).any()
    torch.testing.assert_close(fused_out.nan_to_num(neginf=0), plain_out.nan_to_num(neginf=0), **TOL)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, **TOL)
    op = TokenLogProbsFromHidden(S, chunk_tokens=5, sampling_params=sampling)
    rows = op(inp.hidden, inp.weight, inp.ids, layout=inp.layout)
    assert torch.equal(torch.isinf(rows[:, 1:]).sum(), torch.isinf(fused_out[keep]).sum())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_inputs_compute_the_log_softmax_in_float32(dtype, tol):
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=5)
    want = reference(inp)
    low = inp._replace(hidden=inp.hidden.to(dtype), weight=inp.weight.to(dtype))
    got = _run(TokenLogProbsFromHidden(S, chunk_tokens=7), low)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_no_logits_sized_tensor_in_forward_or_backward():
    """Forward allocates one ``[chunk, V]`` block at a time; backward too, plus the two gradients (the
    weight's, accumulated in place, and the hidden states')."""
    vocab = 97
    inp = head_inputs([16, 16, 9], 1, pad_full_seq_to=48, seed=7, dtype=torch.float32, vocab=vocab)
    chunk, total = 4, inp.ids.shape[1]
    op = TokenLogProbsFromHidden(S, chunk_tokens=chunk, validate=False)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    with Allocations() as fwd:
        out = op(h, w, inp.ids, layout=inp.layout)
    assert max(fwd.sizes) <= chunk * vocab < total * vocab
    with Allocations() as bwd:
        (out * inp.loss_weight).sum().backward()
    big = sorted(n for n in bwd.sizes if n > chunk * vocab)
    assert big == [w.numel()], big  # the weight's gradient; the hidden states' [T, H] is smaller than a chunk
    assert h.numel() <= chunk * vocab


def test_groups_from_a_process_group_collection():
    """megatron-core's ``ProcessGroupCollection`` supplies ``cp`` / ``tp`` (here a stand-in of one rank each)."""
    op = TokenLogProbsFromHidden(S, pg_collection=SimpleNamespace(cp=None, tp=None))
    assert (op.cp_size, op.tp_size) == (1, 1)


def test_no_host_sync_on_the_device_plan_and_one_on_the_host_plan():
    """``host_reads`` picks the plan (and so the syncs); ``validate`` only checks."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    for validate, host_reads, expected in ((False, False, []), (True, False, []), (False, True, ["tolist"]),
                                           (True, True, ["tolist"])):
        op = TokenLogProbsFromHidden(S, validate=validate, host_reads=host_reads)
        with HostSyncCounter() as syncs:
            _run(op, inp)
        assert syncs.calls == expected, (validate, host_reads, syncs.calls)


def test_runs_on_meta_tensors_so_it_never_reads_values_on_the_host():
    h = torch.empty(1, 64, HIDDEN, device="meta", requires_grad=True)
    w = torch.empty(VOCAB, HIDDEN, device="meta", requires_grad=True)
    ids = torch.empty(1, 64, dtype=torch.int64, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    out = TokenLogProbsFromHidden(S, validate=False, host_reads=False, chunk_tokens=16)(h, w, ids, cu, cu)
    assert out.shape == (4, S)
    out.sum().backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_bad_arguments_name_the_argument_and_the_valid_values():
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    h, w, ids, cu, cu_pad = inp.hidden, inp.weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded
    op = TokenLogProbsFromHidden(S)
    cases = [
        (lambda: TokenLogProbsFromHidden(S, chunk_tokens=0), "chunk_tokens=0 is invalid; expected an int >= 1"),
        (lambda: TokenLogProbsFromHidden(S, temperature=0.0), r"temperature=0.0 is invalid; expected a number > 0"),
        (lambda: TokenLogProbsFromHidden(S, vocab_size=0), "vocab_size=0 is invalid"),
        (lambda: op(h, w[:, :5], ids, cu, cu_pad), r"weight has shape \(36, 5\) but hidden \(1, 48, 8\) have hidden "
                                                   r"size H=8; pass the output layer's weight \[V/TP, 8\]"),
        (lambda: op(h, w.float(), ids, cu, cu_pad), "weight is torch.float32 but hidden are torch.float64"),
        (lambda: op(h[0], w, ids, cu, cu_pad), r"hidden must be floating-point hidden states \[1, T/C, H\]"),
        (lambda: op(h.expand(2, -1, -1), w, ids, cu, cu_pad), r"hidden must be \[1, T/C, H\]"),
        (lambda: op(h, w[0], ids, cu, cu_pad), r"weight must be the output layer's floating-point weight \[V/TP, H\]"),
        (lambda: op(h[:, :40], w, ids, cu, cu_pad), r"hidden hold 40 tokens but this rank's share of the T=48 packed "
                                                    r"tokens is T/C = 48/1 = 48"),
        (lambda: TokenLogProbsFromHidden(S, vocab_size=40)(h, w, ids, cu, cu_pad),
         r"weight holds 36 vocabulary rows on each of tp_size=1 ranks = 36, but vocab_size=40"),
        (lambda: TokenLogProbsFromHidden(S, sampling_params=TrainingSamplingParams(top_k=37))(h, w, ids, cu, cu_pad),
         "sampling_params.top_k=37 is invalid for a vocabulary of 36 tokens"),
        (lambda: op(h, w, ids.float(), cu, cu_pad), r"packed_ids must be integer token ids \[1, T\]"),
        (lambda: TokenLogProbsFromHidden()(h, w, ids, cu, cu_pad),
         "TokenLogProbsFromHidden needs the row length S: pass seq_len="),
        (lambda: op(h, w, ids), "TokenLogProbsFromHidden needs cu_seqlens and cu_seqlens_padded, or layout="),
        (lambda: op(h, w, ids, cu, cu_pad.clamp(max=40)), "must start at 0, never decrease and end at 48"),
        (lambda: op(h, w[:20], ids, cu, cu_pad), "is outside the vocabulary"),
        (lambda: TokenLogProbsFromHidden(S, pg_collection=SimpleNamespace(cp=None)),
         "pg_collection \\(SimpleNamespace\\) has no 'tp' group"),
    ]
    for call, message in cases:
        with pytest.raises(PackingError, match=message):
            call()


@pytest.mark.compile
def test_compiled_forward_and_backward_over_a_stream_is_one_graph_and_equals_eager():
    """A run-level ``T`` (``pad_full_seq_to``) and a row capacity: microbatches with different lengths and
    row counts (none included) compile once, forward and backward, with the results of eager mode."""
    op = TokenLogProbsFromHidden(S, chunk_tokens=16, validate=False)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(op, fullgraph=True, backend=counter)
    for i, lengths in enumerate(([5, 0, 16, 3], [16, 16, 16], [1], [], [2, 9, 4, 16])):
        inp = head_inputs(lengths, 1, pad_full_seq_to=64, seed=20 + i, dtype=torch.float32)
        rows = len(lengths)
        pad = [0] * (4 - rows)  # row capacity 4: empty rows collapse onto T
        cu = torch.cat([inp.cu_seqlens, inp.cu_seqlens[-1:].expand(len(pad))]).to(torch.int32)
        cu_pad = torch.cat([inp.cu_seqlens_padded, inp.cu_seqlens_padded[-1:].expand(len(pad))]).to(torch.int32)
        weights = torch.cat([inp.loss_weight, torch.zeros(len(pad), S)])
        inp = inp._replace(cu_seqlens=cu, cu_seqlens_padded=cu_pad, loss_weight=weights)
        got, want = _run(compiled, inp), _run(op, inp)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    torch._dynamo.reset()
