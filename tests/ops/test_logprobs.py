"""Tier: pure CPU, single process (C=1, no tensor parallelism; the CP and TP variants run in
tests/multiprocess/test_cp_multiprocess.py).

TokenLogProbs against the loop reference and against NeMo-RL's layout built from the
padded batch, values and gradients, in float64/float32/bfloat16 and several chunk
sizes; what it allocates (no [T, V] temporary in forward, one gradient-sized tensor in
backward); errors; torch.compile (fullgraph, forward and backward, one frame for a
stream of microbatches); meta tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

from nn_data.diagnostics import Allocations
from tests.support.cp_cases import make_microbatch, pack_single
from nn_data import GatherFromContextParallel, PackingError, TokenLogProbs, UnpackSequences
from nn_data.diagnostics import HostSyncCounter
from nn_data.testing.reference import reference_token_logprobs

V = 23
S = 16


def _inputs(lengths, seed=0, dtype=torch.float64, pad_full_seq_to=48, capacity=None):
    mb = make_microbatch(lengths, 1, pad_full_seq_to=pad_full_seq_to, capacity=capacity)
    r = pack_single(mb).result
    ids = (r.packed * 5 + 1) % V
    logits = torch.randn(1, ids.shape[1], V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    weight = torch.randn(r.cu_seqlens.shape[0] - 1, S, generator=torch.Generator().manual_seed(seed + 1),
                         dtype=torch.float64)
    return r, ids, logits.to(dtype), weight.to(dtype)


def _grad(fn, logits, weight):
    x = logits.clone().requires_grad_()
    out = fn(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def test_docstring_example():
    out = TokenLogProbs(4)(torch.zeros(1, 4, 3), torch.tensor([[1, 2, 0, 0]]), torch.tensor([0, 3]),
                           torch.tensor([0, 4]))
    assert torch.allclose(out, torch.tensor([[0.0, math.log(1 / 3), math.log(1 / 3), 0.0]]))


@pytest.mark.parametrize("chunk", [1, 5, 256])
@pytest.mark.parametrize("lengths", [[5, 0, 16, 3], [0, 0], [16, 1, 16], []], ids=str)
def test_values_and_gradients_equal_the_reference(lengths, chunk):
    r, ids, logits, weight = _inputs(lengths, seed=len(lengths) + chunk)
    op = TokenLogProbs(S, chunk_tokens=chunk)
    out, grad = _grad(lambda x: op(x, ids, r.cu_seqlens, r.cu_seqlens_padded), logits, weight)
    ref, ref_grad = _grad(lambda x: reference_token_logprobs(x, ids, r.cu_seqlens, r.cu_seqlens_padded, S),
                          logits, weight)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert out.shape == (len(lengths), S) and out.dtype == torch.float64


def test_layout_is_nemo_rls_logprobs_from_the_padded_batch():
    # NeMo-RL (non-packed path): log_softmax over [B, S, V], token s+1 taken at s, a zero column
    # prepended, padding masked. Built here from the unpacked logits; the op must agree.
    r, ids, logits, _ = _inputs([5, 0, 16, 3], seed=3)
    lengths = r.cu_seqlens[1:] - r.cu_seqlens[:-1]
    rows = UnpackSequences(S)(logits, lengths, r.cu_seqlens_padded)  # [B, S, V]
    row_ids = UnpackSequences(S)(ids, lengths, r.cu_seqlens_padded)  # [B, S]
    lp = torch.log_softmax(rows[:, :-1], dim=-1).gather(2, row_ids[:, 1:, None]).squeeze(2)  # [B, S-1]
    nemo = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # position s: log p(x_s | x_<s); s=0 -> 0
    nemo = nemo * (torch.arange(S) < lengths[:, None])
    out = TokenLogProbs(S)(logits, ids, r.cu_seqlens, r.cu_seqlens_padded)
    torch.testing.assert_close(out, nemo, rtol=0, atol=1e-12)
    s = torch.arange(S)
    assert torch.equal(out != 0, (s >= 1) & (s < lengths[:, None]))  # exactly one value per predicted token


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_logits_are_reduced_in_float32(dtype, tol):
    r, ids, logits, weight = _inputs([5, 0, 16, 3], seed=5, dtype=dtype)
    op = TokenLogProbs(S, chunk_tokens=7)
    out, grad = _grad(lambda x: op(x, ids, r.cu_seqlens, r.cu_seqlens_padded), logits, weight.float())
    ref, ref_grad = _grad(lambda x: reference_token_logprobs(x.double(), ids, r.cu_seqlens, r.cu_seqlens_padded, S),
                          logits, weight.double())
    assert out.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=tol, atol=tol)


def test_no_logits_sized_temporary_in_forward_and_one_gradient_in_backward():
    r, ids, logits, weight = _inputs([16, 16, 9], seed=7, dtype=torch.float32)
    op = TokenLogProbs(S, chunk_tokens=4)
    x = logits.clone().requires_grad_()
    with Allocations() as fwd:
        out = op(x, ids, r.cu_seqlens, r.cu_seqlens_padded)
    assert max(fwd.sizes) <= 4 * V  # one [chunk, V] block at most; everything else is O(T)
    with Allocations() as bwd:
        (out * weight.float()).sum().backward()
    big = [n for n in bwd.sizes if n > 4 * V]
    assert big == [logits.numel()]  # the gradient itself, written chunk by chunk


def test_bad_arguments_name_the_argument_and_the_valid_values():
    r, ids, logits, _ = _inputs([5, 0, 16, 3])
    args = (r.cu_seqlens, r.cu_seqlens_padded)
    with pytest.raises(PackingError, match=r"seq_len=-1 is invalid; expected an int >= 0 or None"):
        TokenLogProbs(-1)
    with pytest.raises(PackingError, match=r"TokenLogProbs needs the row length S: pass seq_len= to forward"):
        TokenLogProbs()(logits, ids, *args)
    with pytest.raises(PackingError, match=r"seq_len=-2 is invalid; expected an int >= 0"):
        TokenLogProbs(S)(logits, ids, *args, seq_len=-2)
    with pytest.raises(PackingError, match="logits must be floating point"):
        TokenLogProbs(S)(ids, ids, *args)
    with pytest.raises(PackingError, match=r"pass the full packed ids \[1, 48\]"):
        TokenLogProbs(S)(logits, ids[:, :24], *args)
    with pytest.raises(PackingError, match=r"the length 16 of sequence 2 \(from cu_seqlens\) is outside \[0, seq_len=8\]"):
        TokenLogProbs(8)(logits, ids, *args)
    bad = ids.clone()
    bad[0, 7] = V  # the second token of sequence 2 (segments 6, 0, 16, 26 long: it starts at 6)
    with pytest.raises(PackingError, match=f"packed token id {V} at position 7 is outside the vocabulary"):
        TokenLogProbs(S)(logits, bad, *args)
    with pytest.raises(PackingError, match="must start at 0, never decrease and end at 48"):
        TokenLogProbs(S)(logits, ids, r.cu_seqlens, r.cu_seqlens_padded.clamp(max=40))


@pytest.mark.parametrize("executor", ["host", "device", "layout"])
@pytest.mark.parametrize("lengths", [[5, 0, 16, 3], [0, 0], [16, 1, 16], []], ids=str)
def test_both_executors_and_a_travelling_layout_give_the_same_values_and_gradients(lengths, executor):
    r, ids, logits, weight = _inputs(lengths, seed=len(lengths))
    ref, ref_grad = _grad(lambda x: reference_token_logprobs(x, ids, r.cu_seqlens, r.cu_seqlens_padded, S),
                          logits, weight)
    if executor == "layout":  # the pack's plan: no read of the boundaries
        op = TokenLogProbs(S, chunk_tokens=5)
        with HostSyncCounter() as syncs:
            out, grad = _grad(lambda x: op(x, ids, places=None, layout=r.layout), logits, weight)
        assert syncs.count == 0, syncs.calls
    else:
        op = TokenLogProbs(S, chunk_tokens=5, host_reads=executor == "host")
        out, grad = _grad(lambda x: op(x, ids, r.cu_seqlens, r.cu_seqlens_padded), logits, weight)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_row_length_per_call_equals_the_reference_for_every_s():
    """``seq_len=`` in forward overrides the configured S (0 and 1 included), as UnpackSequences."""
    op = TokenLogProbs(chunk_tokens=5)
    for row_len in (0, 1, 3, 16, 20):
        lengths = [min(n, row_len) for n in (5, 0, 16, 3)]
        r, ids, logits, weight = _inputs(lengths, seed=row_len)
        out = op(logits, ids, r.cu_seqlens, r.cu_seqlens_padded, seq_len=row_len)
        ref = reference_token_logprobs(logits, ids, r.cu_seqlens, r.cu_seqlens_padded, row_len)
        assert out.shape == (4, row_len)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    configured = TokenLogProbs(16)  # the configured S still applies without seq_len
    r, ids, logits, _ = _inputs([5, 0, 16, 3])
    assert configured(logits, ids, r.cu_seqlens, r.cu_seqlens_padded).shape == (4, 16)
    assert configured(logits, ids, r.cu_seqlens, r.cu_seqlens_padded, seq_len=20).shape == (4, 20)


def test_boundaries_are_checked_as_unpack_checks_them():
    r, ids, logits, _ = _inputs([5, 0, 16, 3])  # T = 48: cu_seqlens ends at 24
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 5, 5, 21, 24\] is invalid for a packed length "
                                           r"T=48; it must start at 0, never decrease and end at 48"):
        TokenLogProbs(S)(logits, ids, r.cu_seqlens, r.cu_seqlens)  # cu_seqlens where cu_seqlens_padded belongs
    with pytest.raises(PackingError, match=r"the length 16 of sequence 2 \(from cu_seqlens\) does not fit its "
                                           r"segment of cu_seqlens_padded \(6 long\)"):
        TokenLogProbs(S)(logits, ids, r.cu_seqlens, torch.tensor([0, 6, 6, 12, 48]))


def test_gather_without_torch_distributed_is_the_identity():
    gather = GatherFromContextParallel()
    assert (gather.cp_rank, gather.cp_size) == (0, 1)
    x = torch.arange(8.0).view(1, 8, 1).requires_grad_()
    y = gather(x, torch.tensor([0, 8]))
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(PackingError, match="grad_mode='mean' is invalid"):
        GatherFromContextParallel(grad_mode="mean")


@pytest.mark.compile
def test_compiled_forward_and_backward_match_eager_with_one_frame():
    op = TokenLogProbs(S, chunk_tokens=16)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(op, fullgraph=True, backend=counter)
    for i, lengths in enumerate(([5, 0, 16, 3], [0, 0], [16, 16, 16], [1], [], [2, 9, 4, 16])):
        r, ids, logits, weight = _inputs(lengths, seed=20 + i, dtype=torch.float32, pad_full_seq_to=64, capacity=4)
        args = (ids, r.cu_seqlens, r.cu_seqlens_padded)
        out, grad = _grad(lambda x: compiled(x, *args), logits, weight)
        ref, ref_grad = _grad(lambda x: op(x, *args), logits, weight)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


ROW_LENGTHS = (5, 0, 1, 16, 3, 9, 2, 12, 7, 4, 11, 6, 0, 1)  # 12 distinct S, 0 and 1 among them, again at the end


@pytest.mark.compile
def test_compiled_over_a_stream_of_row_lengths_is_one_graph_and_equals_eager():
    """A log-prob step whose row length S varies per microbatch: ``seq_len=like.shape[1]`` of a
    ``[R, S]`` tensor marked with ``with_dynamic_row_length`` keeps one graph for 12 distinct S
    (0 and 1 included) and any row count under a row capacity; forward and backward equal eager."""
    from nn_data import PackSequences, pad_to_row_capacity
    from nn_data.rows import with_dynamic_row_length
    from nn_data.testing.coded import coded_batch

    op = TokenLogProbs(chunk_tokens=16)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def step(logits, ids, cu, cu_pad, like):
        return op(logits, ids, cu, cu_pad, seq_len=like.shape[1])

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for row_len in ROW_LENGTHS:
        rows = int(torch.randint(0, 5, (), generator=gen))
        lengths = torch.randint(0, row_len + 1, (rows,), generator=gen)
        padded = pad_to_row_capacity(coded_batch(lengths.tolist(), row_len), lengths, 4)
        r = PackSequences(2, pad_full_seq_to=64)(padded.x, padded.seq_lengths, padded.num_rows)
        ids = (r.packed * 5 + 1) % V
        logits = torch.randn(1, 64, V, generator=gen)
        weight = torch.randn(4, row_len, generator=gen)
        args = (ids, r.cu_seqlens, r.cu_seqlens_padded)
        out, grad = _grad(lambda x: compiled(x, *args, with_dynamic_row_length(padded.x)), logits, weight)
        ref, ref_grad = _grad(lambda x: op(x, *args, seq_len=row_len), logits, weight)
        assert out.shape == (4, row_len)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(set(ROW_LENGTHS))} row lengths"
    torch._dynamo.reset()


def test_runs_on_meta_tensors_so_it_never_reads_values_on_the_host():
    logits = torch.empty(1, 64, V, device="meta", requires_grad=True)
    ids = torch.empty(1, 64, dtype=torch.int64, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    out = TokenLogProbs(S, validate=False, host_reads=False)(logits, ids, cu, cu)
    assert out.shape == (4, S)
    out.sum().backward()
    assert logits.grad.shape == logits.shape
