"""Tier: pure CPU, single process (C = 1, no tensor parallelism; CP 2, TP 2 and TP 2 x CP 2 run in
tests/multiprocess/test_lm_head_multiprocess.py, the patched ``GPTModel.forward`` in
tests/multiprocess/test_adapters_multiprocess.py).

NeMo-RL's linear-CE fusion functions in ``nn_data.nemo_rl.model_utils`` (log-probs from hidden states):
``from_parallel_hidden_states_to_logprobs``, ``ChunkedDistributedHiddenStatesToLogprobs`` and the packed
entry ``from_parallel_hidden_states_to_logprobs_packed_sequences``, against NeMo-RL's semantics on the
logits ``hidden @ weight.T`` (the loop oracle, and nn_data's unfused drop-in) in float64 at 1e-10: values
on every position and the gradients of the hidden states and of the weight, out-of-vocabulary targets
included; ``inference_only``; host syncs; every error message. (Against NeMo-RL's own functions:
docs/nemo-rl.md, run outside this repository.)
"""

from __future__ import annotations

import math

import pytest
import torch

from nn_data import PackingError
from nn_data.diagnostics import HostSyncCounter
from nn_data.nemo_rl import model_utils as mu
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.testing.nemo_reference import reference_row_logprobs
from tests.support.lm_head_cases import HIDDEN, SEQ_LEN, VOCAB, head_inputs

TOL = dict(rtol=0, atol=1e-10)
ROWS = mu.from_parallel_hidden_states_to_logprobs
PACKED = mu.from_parallel_hidden_states_to_logprobs_packed_sequences


def _rows_inputs(seed=0, batch=3, seq=9):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, batch, HIDDEN, generator=gen, dtype=torch.float64)  # [S, B, H] sequence-first
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / 2
    target = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    target[0, 3], target[2, 6], target[1, 8] = VOCAB, -100, VOCAB + 9  # outside the vocabulary
    return hidden, weight, target, torch.randn(batch, seq - 1, generator=gen, dtype=torch.float64)


def _grads(fn, hidden, weight, loss_weight):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(h, w)
    (out * loss_weight).sum().backward()
    return out.detach(), h.grad, w.grad


def _same(got, want, what):
    for name, a, b in zip(("values", "d hidden", "d weight"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


def test_rows_equal_nemo_rls_semantics_on_the_logits():
    """``[B, S-1]``: position ``s`` scores ``target[b, s+1]``; a target outside ``[0, V)`` gets 0 and the
    gradient ``-softmax`` (NeMo-RL's); chunked or not; ``runtime_gather_output`` changes nothing."""
    hidden, weight, target, lw = _rows_inputs()
    want = _grads(lambda h, w: reference_row_logprobs(h.transpose(0, 1) @ w.T, target), hidden, weight, lw)
    for chunk in (None, 1, 4):
        for gather in (None, True):
            got = _grads(lambda h, w: ROWS(h, w, gather, target, 0, VOCAB, None, chunk_size=chunk), hidden, weight, lw)
            _same(got, want, f"chunk {chunk}")
    assert want[0][0, 2] == 0 and want[1][2, 0].abs().sum() > 0  # the out-of-vocabulary target's gradient
    unfused = _grads(lambda h, w: mu.from_parallel_logits_to_logprobs(h.transpose(0, 1) @ w.T, target, 0, VOCAB,
                                                                      None), hidden, weight, lw)
    _same(unfused, want, "the unfused drop-in")


def test_autograd_class_takes_nemo_rls_argument_order_and_rolled_targets():
    hidden, weight, target, lw = _rows_inputs(seed=1)
    rolled = target.roll(-1, dims=-1)  # NeMo-RL's caller rolls; the class scores every position
    w_full = torch.cat([lw, torch.randn(lw.shape[0], 1, dtype=torch.float64)], dim=1)
    got = _grads(lambda h, w: mu.ChunkedDistributedHiddenStatesToLogprobs.apply(h, rolled, w, 0, VOCAB, 2, None),
                 hidden, weight, w_full)
    logits = lambda h, w: h.transpose(0, 1) @ w.T  # noqa: E731
    want = _grads(lambda h, w: mu.DistributedLogprob.apply(logits(h, w), rolled, 0, VOCAB, None), hidden, weight,
                  w_full)
    _same(got, want, "class")
    out = mu.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden, rolled, weight, 0, VOCAB, 2, None, True)
    assert out.shape == target.shape and not out.requires_grad


@pytest.mark.parametrize("sampling", [None, TrainingSamplingParams(top_k=6, top_p=0.8)], ids=["plain", "top-k+top-p"])
def test_packed_entry_equals_the_unfused_packed_function_on_the_logits(sampling):
    """Every argument of the unfused packed function: targets rolled here or pre-rolled, chunked, top-k /
    top-p, out-of-vocabulary ids; hidden states ``[T, 1, H]`` (megatron-core) or ``[1, T, H]``."""
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seed=2)
    ids = inp.ids.clone()
    ids[0, 3], ids[0, 30] = VOCAB + 4, -1
    lw = inp.loss_weight[:, 1:]
    finite = lambda out: torch.where(torch.isinf(out), 0.0, out)  # noqa: E731
    for pre_rolled in (False, True):
        target = ids
        if pre_rolled:
            from nn_data.testing.nemo_reference import reference_roll_per_segment

            target = reference_roll_per_segment(ids, inp.cu_seqlens_padded)
        for chunk in (None, 5):
            common = dict(chunk_size=chunk, sampling_params=sampling, target_is_pre_rolled=pre_rolled)
            want = _grads(lambda h, w: finite(mu.from_parallel_logits_to_logprobs_packed_sequences(
                h @ w.T, target, inp.cu_seqlens_padded, SEQ_LEN, 0, VOCAB, None, **common)), inp.hidden, inp.weight,
                lw)
            for seq_first in (True, False):
                hidden = inp.hidden.transpose(0, 1) if seq_first else inp.hidden
                got = _grads(lambda h, w: finite(PACKED(h, w, target, inp.cu_seqlens_padded, SEQ_LEN, 0, VOCAB, None,
                                                        **common)), hidden, inp.weight, lw)
                if seq_first:
                    got = (got[0], got[1].transpose(0, 1), got[2])
                _same(got, want, f"pre-rolled {pre_rolled} chunk {chunk} seq-first {seq_first}")
    assert want[0].shape == (4, SEQ_LEN - 1)


def test_inference_only_and_host_syncs():
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    h = inp.hidden.clone().requires_grad_()
    args = (inp.weight, inp.ids, inp.cu_seqlens_padded, SEQ_LEN, 0, VOCAB, None)
    assert not PACKED(h, *args, inference_only=True).requires_grad
    hidden, weight, target, _ = _rows_inputs()
    assert not ROWS(hidden.requires_grad_(), weight, None, target, 0, VOCAB, None, inference_only=True).requires_grad
    for validate, expected in ((False, []), (True, ["tolist"])):
        with HostSyncCounter() as syncs:
            PACKED(h, *args, validate=validate).sum().backward()
            ROWS(hidden, weight, None, target, 0, VOCAB, None).sum().backward()
        assert syncs.calls == expected


def test_uniform_logits_docstring_example():
    out = ROWS(torch.zeros(3, 1, 2, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64), None,
               torch.tensor([[0, 1, 2]]), 0, 3, None)
    torch.testing.assert_close(out, torch.full((1, 2), math.log(1 / 3), dtype=torch.float64), **TOL)


def test_bad_arguments_name_the_argument_and_the_valid_values():
    hidden, weight, target, _ = _rows_inputs()
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    ph, pw, ids, cu = inp.hidden.transpose(0, 1), inp.weight, inp.ids, inp.cu_seqlens_padded
    cases = [
        (lambda: ROWS(hidden, weight[:, :3], None, target, 0, VOCAB, None),
         r"output_weight_layer has shape \(36, 3\) but tensor_parallel_hidden_states \(9, 3, 8\) have hidden size H=8"),
        (lambda: ROWS(hidden, weight, None, target, 0, VOCAB - 1, None),
         r"vocab_end_index=35 do not match output_weight_layer: with 36 vocabulary rows on tensor-parallel rank 0"),
        (lambda: ROWS(hidden, weight[:30], None, target, 0, VOCAB, None), "do not match output_weight_layer"),
        (lambda: ROWS(hidden[:5], weight, None, target, 0, VOCAB, None),
         r"tensor_parallel_hidden_states hold 5 positions per row but this rank's share of the 9 positions"),
        (lambda: ROWS(hidden, weight, None, target, 0, VOCAB, None, chunk_size=0), "chunk_size=0 is invalid"),
        (lambda: ROWS(hidden, weight, None, target.float(), 0, VOCAB, None), r"target must be integer token ids \[B, S\]"),
        (lambda: ROWS(hidden[0], weight, None, target, 0, VOCAB, None),
         "tensor_parallel_hidden_states must be floating-point hidden states"),
        (lambda: PACKED(ph[:40], pw, ids, cu, SEQ_LEN, 0, VOCAB, None),
         r"hold 40 positions per row but this rank's share of the 48 positions of target is 48/1 = 48"),
        (lambda: PACKED(ph, pw, ids, cu, SEQ_LEN, 0, VOCAB, None, chunk_size=-1), "chunk_size=-1 is invalid"),
        (lambda: PACKED(ph, pw, ids, cu, 0, 0, VOCAB, None), "unpacked_seqlen=0 is invalid"),
        (lambda: PACKED(ph, pw[:, :4], ids, cu, SEQ_LEN, 0, VOCAB, None), "have hidden size H=8"),
        (lambda: PACKED(ph, pw, ids, cu, SEQ_LEN, 0, 20, None), "do not match output_weight_layer"),
        (lambda: PACKED(ph, pw, ids, cu.clamp(max=40), SEQ_LEN, 0, VOCAB, None),
         "must start at 0, never decrease and end at 48"),
        (lambda: PACKED(ph.expand(-1, 2, -1), pw, ids, cu, SEQ_LEN, 0, VOCAB, None), r"must be \[T // CP, 1, H\]"),
        (lambda: mu.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden, target, weight[:, :2], 0, VOCAB, 2, None),
         "have hidden size H=8"),
    ]
    for call, message in cases:
        with pytest.raises(PackingError, match=message):
            call()


def test_every_entry_takes_pg_collection_as_the_model_utils_functions_do():
    """``pg_collection=`` (a stand-in collection whose ``cp`` and ``tp`` are None: not split) gives the
    results of the groups passed as None; a collection without the group is refused by name, so the
    collection is read (a ``TypeError`` before: the keyword was missing). Real groups: the multiprocess
    pg_collection tests."""
    from types import SimpleNamespace

    hidden, weight, target, _ = _rows_inputs()
    inp = head_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    ph, cu = inp.hidden.transpose(0, 1), inp.cu_seqlens_padded
    rolled = target.roll(-1, dims=-1)
    calls = {
        "rows": lambda **kw: ROWS(hidden, weight, None, target, 0, VOCAB, None, **kw),
        "packed": lambda **kw: PACKED(ph, inp.weight, inp.ids, cu, SEQ_LEN, 0, VOCAB, None, **kw),
        "apply": lambda **kw: mu.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden, rolled, weight, 0, VOCAB, 2,
                                                                               None, **kw),
    }
    for name, call in calls.items():
        torch.testing.assert_close(call(pg_collection=SimpleNamespace(cp=None, tp=None)), call(), **TOL,
                                   msg=lambda m: f"{name}: {m}")
        with pytest.raises(PackingError, match=r"pg_collection \(SimpleNamespace\) has no 'tp' group"):
            call(pg_collection=SimpleNamespace(cp=None))
    with pytest.raises(PackingError, match=r"pg_collection \(SimpleNamespace\) has no 'cp' group"):
        calls["rows"](pg_collection=SimpleNamespace(tp=None))
