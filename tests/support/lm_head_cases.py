"""Inputs for the fused head's tests (``TokenLogProbsFromHidden`` and the NeMo-RL drop-in from hidden
states), and the cases every spawned rank runs (tests/support/cp_harness.py) for
tests/multiprocess/test_lm_head_multiprocess.py.

Every rank builds the same float64 data from fixed seeds: the full packed hidden states ``[1, T, H]``,
the full output weight ``[V, H]``, packed ids. It feeds the op this rank's part (the zigzag CP shard of
the hidden states, this TP rank's rows of it with sequence parallelism, this TP rank's vocabulary rows
of the weight) and compares with the single-process oracle on the logits ``hidden @ weight.T / t``:
values on every position; the hidden states' gradient against its part of the single-process one;
the weight's gradient, summed over the CP group (megatron-core's data-and-context-parallel
all-reduce), against its rows of the single-process one. nn_data's op: the single-process gradients;
the NeMo-RL drop-in: ``C`` times them (NeMo-RL's convention). Tolerance 1e-10.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from nn_data import TokenLogProbs, TokenLogProbsFromHidden
from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.errors import PackingError
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.nemo_rl import model_utils
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.testing.nemo_reference import (
    reference_filter, reference_packed_logprobs, reference_roll_per_segment, reference_row_logprobs,
)
from nn_data.testing.reference import reference_shard, reference_token_logprobs
from tests.support.cp_cases import make_microbatch, pack_single

VOCAB, HIDDEN, SEQ_LEN = 36, 8, 16
TOL = dict(rtol=0, atol=1e-10)
BATCHES = ([5, 0, 16, 3], [16, 16, 16], [1, 7, 2, 9])


class HeadInputs(NamedTuple):
    hidden: torch.Tensor  # [1, T, H] the full packed hidden states
    weight: torch.Tensor  # [V, H] the full output weight
    ids: torch.Tensor  # [1, T] packed ids
    cu_seqlens: torch.Tensor  # [B+1]
    cu_seqlens_padded: torch.Tensor  # [B+1]
    loss_weight: torch.Tensor  # [B, S] weights of the test's loss
    layout: object  # the pack's PackLayout


def head_inputs(lengths, cp_size: int, *, pad_full_seq_to: int = 80, seed: int = 0, dtype=torch.float64,
                vocab: int = VOCAB) -> HeadInputs:
    """A microbatch packed by nn_data (segments padded to ``2C``, the last one to ``pad_full_seq_to``)."""
    r = pack_single(make_microbatch(lengths, cp_size, pad_full_seq_to=pad_full_seq_to)).result
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, r.packed.shape[1], HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64) / 2
    loss_weight = torch.randn(len(lengths), SEQ_LEN, generator=gen, dtype=torch.float64)
    ids = (r.packed * 7 + 3) % vocab
    return HeadInputs(hidden.to(dtype), weight.to(dtype), ids, r.cu_seqlens, r.cu_seqlens_padded, loss_weight.to(dtype),
                      r.layout)


def reference(inp: HeadInputs, temperature: float = 1.0):
    """The single-process oracle: ``(rows [B, S], d hidden [1, T, H], d weight [V, H])`` of
    ``sum(rows * loss_weight)``, from the logits ``hidden @ weight.T / temperature``."""
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    rows = reference_token_logprobs(h @ w.T / temperature, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded, SEQ_LEN)
    (rows * inp.loss_weight).sum().backward()
    return rows.detach(), h.grad, w.grad


def local_parts(inp: HeadInputs, cp, tp, sequence_parallel: bool):
    """This rank's hidden states ``[1, n, H]`` and weight rows ``[V/TP, H]`` (fresh leaves)."""
    hidden = reference_shard(inp.hidden, inp.cu_seqlens_padded, cp.size, cp.rank)  # [1, T/C, H]
    if sequence_parallel:
        hidden = hidden.chunk(tp.size, dim=1)[tp.rank]  # [1, T/(C*TP), H]
    rows = inp.weight.shape[0] // tp.size
    weight = inp.weight[tp.rank * rows : (tp.rank + 1) * rows]
    return hidden.clone().requires_grad_(), weight.clone().requires_grad_()


def expected_grads(inp: HeadInputs, grad_h, grad_w, cp, tp, sequence_parallel: bool, scale: float = 1.0):
    """This rank's part of the single-process gradients (``scale`` times: ``C`` for NeMo-RL's convention)."""
    h = reference_shard(grad_h, inp.cu_seqlens_padded, cp.size, cp.rank)
    if sequence_parallel:
        h = h.chunk(tp.size, dim=1)[tp.rank]
    rows = grad_w.shape[0] // tp.size
    return scale * h, scale * grad_w[tp.rank * rows : (tp.rank + 1) * rows]


def summed_over(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad`` summed over ``group`` (None: itself): what megatron-core's gradient all-reduce adds up."""
    if group is None:
        return grad
    out = grad.clone()
    dist.all_reduce(out, group=group)
    return out


TOP_K = 5


def reference_outputs(logits: torch.Tensor, inp: HeadInputs, top_k: int = TOP_K, sampling=None) -> dict:
    """The oracle of ``outputs()``, one sequence at a time from the full logits ``[1, T, V]`` (float64): row
    ``b``, column ``s`` (``1 <= s < L[b]``) from the log-softmax of position ``start_b + s - 1``, else 0:
    ``logprobs`` of the next token, ``entropy``, ``topk_logprobs`` / ``topk_indices`` (``torch.topk``),
    ``argmax``. Differentiable w.r.t. ``logits``. ``sampling`` (``top_k`` / ``top_p`` attributes): the
    log-softmax of the filtered row (``-inf`` where ``reference_filter`` drops a logit), the entropy over the
    kept logits."""
    cu, starts = [int(v) for v in inp.cu_seqlens], [int(v) for v in inp.cu_seqlens_padded]
    rows = len(cu) - 1
    out = {"logprobs": logits.new_zeros(rows, SEQ_LEN), "entropy": logits.new_zeros(rows, SEQ_LEN),
           "topk_logprobs": logits.new_zeros(rows, SEQ_LEN, top_k),
           "topk_indices": torch.zeros(rows, SEQ_LEN, top_k, dtype=torch.int64),
           "argmax": torch.zeros(rows, SEQ_LEN, dtype=torch.int64)}
    for b in range(rows):
        for s in range(1, cu[b + 1] - cu[b]):
            row = logits[0, starts[b] + s - 1]  # [V]
            kept = torch.ones_like(row, dtype=torch.bool)
            if sampling is not None:
                kept = reference_filter(row.detach(), sampling.top_k, sampling.top_p)  # [V]
            lp = torch.log_softmax(torch.where(kept, row, float("-inf")), dim=-1)  # [V]
            top = torch.topk(lp, top_k)
            out["logprobs"] = out["logprobs"].index_put((torch.tensor(b), torch.tensor(s)),
                                                        lp[inp.ids[0, starts[b] + s]])
            entropy = -(lp.exp() * lp.masked_fill(~kept, 0.0)).sum()  # a filtered logit weighs 0
            out["entropy"] = out["entropy"].index_put((torch.tensor(b), torch.tensor(s)), entropy)
            out["topk_logprobs"] = out["topk_logprobs"].index_put((torch.tensor(b), torch.tensor(s)), top.values)
            out["topk_indices"][b, s] = top.indices
            out["argmax"][b, s] = lp.argmax()
    return out


def asked_fields(asked: dict) -> set:
    """The fields of ``HeadOutputs`` an ``outputs(**asked)`` call fills."""
    fields = {"logprobs"} if asked.get("logprobs", True) else set()
    fields |= {"entropy"} if asked.get("entropy") else set()
    fields |= {"topk_logprobs", "topk_indices"} if asked.get("top_k") else set()
    return fields | ({"argmax"} if asked.get("argmax") else set())


def outputs_loss(out, weights) -> torch.Tensor:
    """The tests' loss of every differentiable output: ``sum(logprobs * a + entropy * b + topk * c)``."""
    get = out.get if isinstance(out, dict) else out._asdict().get
    return sum((get(name) * weights[name]).sum() for name in ("logprobs", "entropy", "topk_logprobs")
               if get(name) is not None)


def output_weights(rows: int, seed: int = 11, top_k: int = TOP_K) -> dict:
    """Random float64 weights of :func:`outputs_loss`."""
    gen = torch.Generator().manual_seed(seed)
    return {"logprobs": torch.randn(rows, SEQ_LEN, generator=gen, dtype=torch.float64),
            "entropy": torch.randn(rows, SEQ_LEN, generator=gen, dtype=torch.float64),
            "topk_logprobs": torch.randn(rows, SEQ_LEN, top_k, generator=gen, dtype=torch.float64)}


def assert_outputs_equal(got, want: dict, what: str) -> None:
    """Every field ``got`` holds equals the oracle's (1e-10; ids exactly)."""
    for name, value in got._asdict().items():
        if value is None:
            continue
        if value.dtype == torch.int64:
            assert torch.equal(value, want[name]), f"{what} {name}"
        else:
            torch.testing.assert_close(value, want[name].detach(), **TOL, msg=lambda m: f"{what} {name}: {m}")


# --- cases (every rank of the pool) ---------------------------------------------------------------------------


def case_core(sequence_parallel: bool):
    """``TokenLogProbsFromHidden`` under this parallel split: rows equal the oracle's on every rank, the hidden
    states' and the weight's gradients are the single-process ones (chunked, temperature, the travelling
    layout and the boundaries alike)."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    checked = 0
    for i, lengths in enumerate(BATCHES):
        inp = head_inputs(lengths, cp.size * (tp.size if sequence_parallel else 1), seed=i,
                          pad_full_seq_to=96 if i != 1 else 48 * cp.size)
        for temperature, chunk in ((1.0, 256), (0.7, 5)):
            ref, ref_h, ref_w = reference(inp, temperature)
            want_h, want_w = expected_grads(inp, ref_h, ref_w, cp, tp, sequence_parallel)
            op = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group, tp_group=tp.group,
                                         sequence_parallel=sequence_parallel, chunk_tokens=chunk,
                                         temperature=temperature)
            for use_layout in (False, True):
                hidden, weight = local_parts(inp, cp, tp, sequence_parallel)
                args = dict(layout=inp.layout) if use_layout else dict(cu_seqlens=inp.cu_seqlens,
                                                                      cu_seqlens_padded=inp.cu_seqlens_padded)
                out = op(hidden, weight, inp.ids, **args)
                (out * inp.loss_weight).sum().backward()
                what = f"{lengths} t {temperature} chunk {chunk} layout {use_layout}"
                torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{what} values: {m}")
                torch.testing.assert_close(hidden.grad, want_h, **TOL, msg=lambda m: f"{what} d hidden: {m}")
                torch.testing.assert_close(summed_over(weight.grad, cp.group), want_w, **TOL,
                                           msg=lambda m: f"{what} d weight: {m}")
                checked += 1
    return (cp.rank, tp.rank, checked)


def case_outputs(sequence_parallel: bool):
    """``TokenLogProbsFromHidden.outputs`` (every output at once, and the entropy alone) and
    ``TokenLogProbs.outputs`` on this rank's logits under this split: the oracle's rows on every rank, the
    single-process gradients (hidden states, weight summed over CP; the logits' for the unfused op)."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = head_inputs([5, 0, 16, 3], cp.size * (tp.size if sequence_parallel else 1), pad_full_seq_to=96, seed=6)
    weights = output_weights(4)
    cols = VOCAB // tp.size
    for temperature, chunk, asked in ((1.0, 256, dict(entropy=True, top_k=TOP_K, argmax=True)),
                                      (0.7, 5, dict(entropy=True, top_k=TOP_K, argmax=True)),
                                      (1.0, 7, dict(logprobs=False, entropy=True))):
        h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
        logits = h @ w.T / temperature  # [1, T, V]
        want = reference_outputs(logits, inp)
        want = {k: v for k, v in want.items() if k in asked_fields(asked)}
        outputs_loss(want, weights).backward()
        want_h, want_w = expected_grads(inp, h.grad, w.grad, cp, tp, sequence_parallel)
        what = f"t {temperature} chunk {chunk} {asked}"
        op = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group, tp_group=tp.group,
                                     sequence_parallel=sequence_parallel, chunk_tokens=chunk, temperature=temperature)
        hidden, weight = local_parts(inp, cp, tp, sequence_parallel)
        got = op.outputs(hidden, weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded, **asked)
        assert sorted(k for k, v in got._asdict().items() if v is not None) == sorted(want), what
        outputs_loss(got, weights).backward()
        assert_outputs_equal(got, want, what)
        torch.testing.assert_close(hidden.grad, want_h, **TOL, msg=lambda m: f"{what} d hidden: {m}")
        torch.testing.assert_close(summed_over(weight.grad, cp.group), want_w, **TOL,
                                   msg=lambda m: f"{what} d weight: {m}")
        # from this rank's logits: the same rows, the logits' gradient the single-process one
        full = (inp.hidden @ inp.weight.T / temperature).requires_grad_()  # [1, T, V]
        shard = reference_shard(full.detach(), inp.cu_seqlens_padded, cp.size, cp.rank)[..., tp.rank * cols:
                                                                                         (tp.rank + 1) * cols]
        local = shard.clone().requires_grad_()
        got = TokenLogProbs(SEQ_LEN, cp_group=cp.group, tp_group=tp.group, chunk_tokens=chunk).outputs(
            local, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded, **asked)
        outputs_loss(got, weights).backward()
        assert_outputs_equal(got, want, what + " from logits")
        ref = full.detach().requires_grad_()
        outputs_loss({k: v for k, v in reference_outputs(ref, inp).items() if k in want}, weights).backward()
        want_z = reference_shard(ref.grad, inp.cu_seqlens_padded, cp.size, cp.rank)[..., tp.rank * cols:
                                                                                     (tp.rank + 1) * cols]
        torch.testing.assert_close(local.grad, want_z, **TOL, msg=lambda m: f"{what} d logits: {m}")
    return (cp.rank, tp.rank)


FILTERS = (TrainingSamplingParams(top_k=6), TrainingSamplingParams(top_p=0.8),
           TrainingSamplingParams(top_k=12, top_p=0.7))


def assert_filtered_outputs_equal(got, want: dict, what: str) -> None:
    """:func:`assert_outputs_equal` where a filter leaves fewer than ``K`` logits: those top-k entries are
    ``-inf`` on both sides and their ids (any of the filtered ones) are not compared."""
    for name, value in got._asdict().items():
        if value is None:
            continue
        if name == "topk_indices":
            finite = torch.isfinite(got.topk_logprobs)
            assert torch.equal(value[finite], want[name][finite]), f"{what} {name}"
        elif value.dtype == torch.int64:
            assert torch.equal(value, want[name]), f"{what} {name}"
        else:
            torch.testing.assert_close(value, want[name].detach(), **TOL, msg=lambda m: f"{what} {name}: {m}")


def case_filtered_outputs(sequence_parallel: bool):
    """``TokenLogProbsFromHidden(sampling_params=...).outputs`` with every output under this split: the
    filtered, renormalised distribution's log-probs (``-inf`` for a filtered target), entropy, top-k and
    argmax equal the oracle's on the filtered full logits, and so do both gradients. Returns how many
    top-k entries were ``-inf`` (the filter left fewer than ``K``) and how many targets were filtered."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = head_inputs([5, 0, 16, 3], cp.size * (tp.size if sequence_parallel else 1), pad_full_seq_to=96, seed=8)
    weights = output_weights(4)
    asked = dict(entropy=True, top_k=TOP_K, argmax=True)
    short = dropped = 0
    for sampling, temperature, chunk in zip(FILTERS, (1.0, 0.7, 1.0), (256, 5, 7)):
        h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
        want = reference_outputs(h @ w.T / temperature, inp, sampling=sampling)
        outputs_loss(want, weights).backward()  # -inf values: their gradients are finite
        want_h, want_w = expected_grads(inp, h.grad, w.grad, cp, tp, sequence_parallel)
        what = f"{sampling} t {temperature} chunk {chunk}"
        op = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group, tp_group=tp.group, sampling_params=sampling,
                                     sequence_parallel=sequence_parallel, chunk_tokens=chunk, temperature=temperature)
        hidden, weight = local_parts(inp, cp, tp, sequence_parallel)
        got = op.outputs(hidden, weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded, **asked)
        outputs_loss(got, weights).backward()
        assert_filtered_outputs_equal(got, want, what)
        torch.testing.assert_close(hidden.grad, want_h, **TOL, msg=lambda m: f"{what} d hidden: {m}")
        torch.testing.assert_close(summed_over(weight.grad, cp.group), want_w, **TOL,
                                   msg=lambda m: f"{what} d weight: {m}")
        short += int(torch.isinf(got.topk_logprobs).sum())  # sync: test bookkeeping
        dropped += int(torch.isinf(got.logprobs).sum())  # sync: test bookkeeping
    return (cp.rank, tp.rank, short, dropped)


def case_counts(sequence_parallel: bool):
    """No host sync on the device plan (``host_reads=False``), one on the host plan; the collectives of one call:
    forward one CP all-gather of the values (plus, under TP, one ``[2, N]`` all-gather and with sequence
    parallelism one all-gather of the hidden states), backward the hidden states' TP reduction (and the
    re-gather with sequence parallelism)."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = head_inputs([5, 0, 16, 3], cp.size * (tp.size if sequence_parallel else 1), pad_full_seq_to=96)
    found = {}
    for validate in (False, True):
        op = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group, tp_group=tp.group,
                                     sequence_parallel=sequence_parallel, chunk_tokens=8, validate=validate,
                                     host_reads=validate)
        hidden, weight = local_parts(inp, cp, tp, sequence_parallel)
        with HostSyncCounter() as syncs, CollectiveCounter() as forward:
            out = op(hidden, weight, inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded)
        with CollectiveCounter() as backward:
            (out * inp.loss_weight).sum().backward()
        found[validate] = (syncs.calls, forward.calls, backward.calls)
    gather_hidden = ["all_gather_into_tensor"] if sequence_parallel and tp.size > 1 else []
    combine = ["all_gather_into_tensor"] if tp.size > 1 else []
    values = ["all_gather_into_tensor"] if cp.size > 1 else []
    reduce = [] if tp.size == 1 else ["reduce_scatter_tensor"] if sequence_parallel else ["all_reduce"]
    assert found[False] == ([], gather_hidden + combine + values, gather_hidden + reduce), found
    assert found[True][0] == ["tolist"] and found[True][1:] == found[False][1:], found
    return found[False][1]


def case_dropin_packed(sequence_parallel: bool):
    """``from_parallel_hidden_states_to_logprobs_packed_sequences``: NeMo-RL's ``[B, S-1]`` values (the
    oracle of the unfused packed function on the logits) and ``C``-times gradients, out-of-vocabulary
    targets included, targets rolled inside or pre-rolled, with and without top-k / top-p, hidden states
    ``[T/C, 1, H]`` as megatron-core hands them."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    fn = model_utils.from_parallel_hidden_states_to_logprobs_packed_sequences
    inp = head_inputs([5, 0, 16, 3], cp.size * (tp.size if sequence_parallel else 1), pad_full_seq_to=96, seed=3)
    ids = inp.ids.clone()
    ids[0, 3], ids[0, 30] = VOCAB + 4, -1  # out of the vocabulary: NeMo-RL's 0 and -softmax gradient
    inp = inp._replace(ids=ids)
    rolled = reference_roll_per_segment(ids, inp.cu_seqlens_padded)
    loss_weight = inp.loss_weight[:, 1:]
    rows = VOCAB // tp.size
    for sampling in (None, TrainingSamplingParams(top_k=6, top_p=0.8)):
        top = (None, 1.0) if sampling is None else (sampling.top_k, sampling.top_p)
        h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
        ref = reference_packed_logprobs(h @ w.T, rolled, inp.cu_seqlens_padded, SEQ_LEN, *top)
        (finite(ref) * loss_weight).sum().backward()
        want_h, want_w = expected_grads(inp, h.grad, w.grad, cp, tp, sequence_parallel, scale=cp.size)
        for pre_rolled in (False, True):
            for chunk in (None, 5):
                hidden, weight = local_parts(inp, cp, tp, sequence_parallel)
                target = reference_shard(rolled, inp.cu_seqlens_padded, cp.size, cp.rank) if pre_rolled else ids
                out = fn(hidden.transpose(0, 1), weight, target, inp.cu_seqlens_padded, SEQ_LEN, tp.rank * rows,
                         (tp.rank + 1) * rows, tp.group, cp_group=cp.group, chunk_size=chunk,
                         sampling_params=sampling, target_is_pre_rolled=pre_rolled)
                (finite(out) * loss_weight).sum().backward()
                what = f"sampling {sampling} pre-rolled {pre_rolled} chunk {chunk}"
                assert torch.equal(torch.isinf(out), torch.isinf(ref)), what
                torch.testing.assert_close(finite(out), finite(ref).detach(), **TOL, msg=lambda m: f"{what}: {m}")
                torch.testing.assert_close(hidden.grad, want_h, **TOL, msg=lambda m: f"{what} d hidden: {m}")
                torch.testing.assert_close(summed_over(weight.grad, cp.group), want_w, **TOL,
                                           msg=lambda m: f"{what} d weight: {m}")
    return (cp.rank, tp.rank)


def finite(out: torch.Tensor) -> torch.Tensor:
    """``out`` with a filtered target's ``-inf`` as 0 (no gradient flows there)."""
    return torch.where(torch.isinf(out), 0.0, out)


def case_dropin_rows(sequence_parallel: bool):
    """``from_parallel_hidden_states_to_logprobs`` on unpacked rows ``[S/C, B, H]`` (each row zigzag-sharded
    over CP; NeMo-RL asserts there): NeMo-RL's ``[B, S-1]`` values, ``C``-times gradients."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    split = cp.size * (tp.size if sequence_parallel else 1)
    gen = torch.Generator().manual_seed(8)
    batch, seq = 3, 8 * split  # each row splits into 2C chunks (of TP rows each with sequence parallelism)
    full = torch.randn(seq, batch, HIDDEN, generator=gen, dtype=torch.float64)  # [S, B, H]
    weight_full = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / 2
    target = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    target[1, 5] = VOCAB  # out of the vocabulary
    loss_weight = torch.randn(batch, seq - 1, generator=gen, dtype=torch.float64)
    h, w = full.clone().requires_grad_(), weight_full.clone().requires_grad_()
    ref = reference_row_logprobs(h.transpose(0, 1) @ w.T, target)
    (ref * loss_weight).sum().backward()
    shard = model_utils._get_tokens_on_this_cp_rank
    local = shard(full, cp.rank, cp.size, seq_dim=0)  # [S/C, B, H]
    want_h = cp.size * shard(h.grad, cp.rank, cp.size, seq_dim=0)
    if sequence_parallel:
        local, want_h = local.chunk(tp.size, 0)[tp.rank], want_h.chunk(tp.size, 0)[tp.rank]
    rows = VOCAB // tp.size
    local = local.clone().requires_grad_()
    weight = weight_full[tp.rank * rows : (tp.rank + 1) * rows].clone().requires_grad_()
    out = model_utils.from_parallel_hidden_states_to_logprobs(local, weight, None, target, tp.rank * rows,
                                                              (tp.rank + 1) * rows, tp.group, cp_group=cp.group,
                                                              chunk_size=3)
    (out * loss_weight).sum().backward()
    torch.testing.assert_close(out, ref.detach(), **TOL)
    torch.testing.assert_close(local.grad, want_h, **TOL)
    torch.testing.assert_close(summed_over(weight.grad, cp.group), cp.size * w.grad[tp.rank * rows : (tp.rank + 1) * rows],
                               **TOL)
    return (cp.rank, tp.rank)


def case_errors():
    """The checks that need a group: hidden states that are not this rank's share of ``T``."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = head_inputs([5, 3], cp.size * tp.size, pad_full_seq_to=16 * cp.size * tp.size)
    op = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group, tp_group=tp.group, sequence_parallel=True)
    try:
        op(inp.hidden, inp.weight[: VOCAB // tp.size], inp.ids, inp.cu_seqlens, inp.cu_seqlens_padded)
    except PackingError as e:
        assert "this rank's share of the T=" in str(e) and "pass this rank's zigzag shard" in str(e), e
    else:
        if cp.size * tp.size > 1:
            raise AssertionError("no error for the full hidden states on a split rank")
    return cp.rank


CASES = {
    "core": case_core,
    "counts": case_counts,
    "outputs": case_outputs,
    "dropin_packed": case_dropin_packed,
    "dropin_rows": case_dropin_rows,
    "errors": case_errors,
}
