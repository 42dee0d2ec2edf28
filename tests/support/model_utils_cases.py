"""Inputs for the ``nn_data.nemo_rl.model_utils`` tests, and the cases every spawned rank runs (see cp_harness.py).

Each case builds the same float64 data on every rank from fixed seeds (full packed logits
``[1, T, V]``), gives the function this rank's CP shard and vocabulary columns, and compares the
result with the NeMo-RL-semantics loop oracle (``nn_data.testing.nemo_reference``) at 1e-10:
values on every position, and the gradient of the local logits against ``C`` times the shard of
the single-process gradient (NeMo-RL's convention under CP).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from nn_data.nemo_rl import model_utils
from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.errors import PackingError
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.testing.nemo_reference import (
    reference_packed_logprobs,
    reference_roll_per_segment,
    reference_row_logprobs,
)
from nn_data.testing.reference import reference_shard
from tests.support.cp_cases import make_microbatch, pack_single

VOCAB = 40
SEQ_LEN = 16  # S of the unpacked rows (the microbatches' row length)
TOL = dict(rtol=0, atol=1e-10)

SAMPLINGS = {
    "none": None,
    "top-k": TrainingSamplingParams(top_k=6),
    "top-p": TrainingSamplingParams(top_p=0.8),
    "top-k+top-p": TrainingSamplingParams(top_k=12, top_p=0.7),
}


class PackedInputs(NamedTuple):
    logits: torch.Tensor  # [1, T, V] float64, the full packed logits
    ids: torch.Tensor  # [1, T] int64 packed ids (padding holds the pad id 3)
    cu_seqlens_padded: torch.Tensor  # [B+1] int32
    weight: torch.Tensor  # [B, S-1] float64, the loss weights
    seq_len: int


def packed_inputs(lengths, cp_size: int, pad_full_seq_to: Optional[int] = 80, seed: int = 0,
                  seq_len: int = SEQ_LEN) -> PackedInputs:
    """A microbatch packed by nn_data (segments padded to ``2C``, the last one to ``pad_full_seq_to``)."""
    r = pack_single(make_microbatch(lengths, cp_size, pad_full_seq_to=pad_full_seq_to)).result
    ids = (r.packed * 7 + 3) % VOCAB  # [1, T]; distinct codes stay distinct within a row
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, ids.shape[1], VOCAB, generator=gen, dtype=torch.float64)
    weight = torch.randn(len(lengths), seq_len - 1, generator=gen, dtype=torch.float64)
    return PackedInputs(logits, ids, r.cu_seqlens_padded, weight, seq_len)


def finite_loss(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum(out * weight)`` over the finite values (a filtered target's ``-inf`` gets no gradient)."""
    return (torch.where(torch.isinf(out), 0.0, out) * weight).sum()


def reference_packed(inp: PackedInputs, sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's ``[B, S-1]`` values and the single-process gradient of ``[1, T, V]``."""
    top_k, top_p = (None, 1.0) if sampling is None else (sampling.top_k, sampling.top_p)
    x = inp.logits.clone().requires_grad_()
    rolled = reference_roll_per_segment(inp.ids, inp.cu_seqlens_padded)
    out = reference_packed_logprobs(x, rolled, inp.cu_seqlens_padded, inp.seq_len, top_k, top_p)
    finite_loss(out, inp.weight).backward()
    return out.detach(), x.grad


def assert_same_values(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), f"{what}: filtered targets differ"
    torch.testing.assert_close(torch.where(torch.isinf(out), 0.0, out), torch.where(torch.isinf(ref), 0.0, ref),
                               **TOL, msg=lambda m: f"{what}: {m}")


def _local(full: torch.Tensor, cu_pad, cp, tp) -> torch.Tensor:
    """This rank's CP shard and vocabulary columns of full packed logits ``[1, T, V]``."""
    cols = full.shape[-1] // tp.size
    return reference_shard(full, cu_pad, cp.size, cp.rank)[..., tp.rank * cols : (tp.rank + 1) * cols]


def run_packed(inp: PackedInputs, cp, tp, *, chunk_size=None, sampling=None, pre_rolled=False, validate=True):
    """The drop-in on this rank: ``(values [B, S-1], gradient of the local logits)``."""
    cols = VOCAB // tp.size
    local = _local(inp.logits, inp.cu_seqlens_padded, cp, tp).clone().requires_grad_()
    target = inp.ids
    if pre_rolled:
        target = reference_shard(reference_roll_per_segment(inp.ids, inp.cu_seqlens_padded), inp.cu_seqlens_padded,
                                 cp.size, cp.rank)
    out = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
        local, target, inp.cu_seqlens_padded, inp.seq_len, tp.rank * cols, (tp.rank + 1) * cols, tp.group,
        cp_group=cp.group, chunk_size=chunk_size, sampling_params=sampling, target_is_pre_rolled=pre_rolled,
        validate=validate)
    finite_loss(out, inp.weight).backward()
    return out.detach(), local.grad


LAYOUTS = [[5, 0, 16, 3], [16, 16, 16, 16], [1, 7, 2, 9]]


# --- cases (every rank of the pool) ---------------------------------------------------------------------------


def case_packed(sampling_name: str):
    """Values and ``C``-times gradients equal the oracle's, chunked and not, targets rolled here or pre-rolled."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    sampling = SAMPLINGS[sampling_name]
    checked = 0
    for i, lengths in enumerate(LAYOUTS):
        inp = packed_inputs(lengths, cp.size, pad_full_seq_to=80 if i != 1 else 64, seed=i)
        ref, ref_grad = reference_packed(inp, sampling)
        expected_grad = cp.size * _local(ref_grad, inp.cu_seqlens_padded, cp, tp)
        for chunk_size in (None, 5):
            for pre_rolled in (False, True):
                what = f"{lengths} chunk {chunk_size} pre-rolled {pre_rolled}"
                out, grad = run_packed(inp, cp, tp, chunk_size=chunk_size, sampling=sampling, pre_rolled=pre_rolled)
                assert_same_values(out, ref, what)
                torch.testing.assert_close(grad, expected_grad, **TOL, msg=lambda m: f"{what} grad: {m}")
                checked += 1
    return (cp.rank, tp.rank, checked)


def case_rows(sampling_name: str):
    """Unpacked rows, each CP-sharded: values and ``C``-times gradients equal the oracle's."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    sampling = SAMPLINGS[sampling_name]
    top_k, top_p = (None, 1.0) if sampling is None else (sampling.top_k, sampling.top_p)
    gen = torch.Generator().manual_seed(5)
    rows, seq_len, padded = 3, 11, 16  # each row padded to S_pad 16 >= S: 2C chunks of 4 (C 2)
    full = torch.randn(rows, padded, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (rows, seq_len), generator=gen)
    weight = torch.randn(rows, seq_len - 1, generator=gen, dtype=torch.float64)
    x = full.clone().requires_grad_()
    ref = reference_row_logprobs(x, target, top_k, top_p)
    finite_loss(ref, weight).backward()
    cols = VOCAB // tp.size
    shard = model_utils._get_tokens_on_this_cp_rank
    for chunk_size in (None, 3):
        local = shard(full, cp.rank, cp.size, seq_dim=1)[..., tp.rank * cols : (tp.rank + 1) * cols]
        local = local.clone().requires_grad_()
        out = model_utils.from_parallel_logits_to_logprobs(
            local, target, tp.rank * cols, (tp.rank + 1) * cols, tp.group, cp_group=cp.group,
            chunk_size=chunk_size, sampling_params=sampling)
        finite_loss(out, weight).backward()
        assert_same_values(out, ref.detach(), f"rows chunk {chunk_size}")
        expected = cp.size * shard(x.grad, cp.rank, cp.size, seq_dim=1)[..., tp.rank * cols : (tp.rank + 1) * cols]
        torch.testing.assert_close(local.grad, expected, **TOL)
    return (cp.rank, tp.rank)


def case_out_of_vocab():
    """Targets outside ``[0, V)``: the value 0 and NeMo-RL's gradient (``-softmax``, ``C`` times under CP), packed
    (rolled here and pre-rolled, chunked and not) and in unpacked rows."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = packed_inputs([5, 0, 16, 3], cp.size, seed=4)
    ids = inp.ids.clone()
    ids[0, 3], ids[0, 9], ids[0, 30], ids[0, 31] = VOCAB, VOCAB + 5, -1, -100
    inp = inp._replace(ids=ids)
    ref, ref_grad = reference_packed(inp, None)
    expected_grad = cp.size * _local(ref_grad, inp.cu_seqlens_padded, cp, tp)
    for chunk_size in (None, 5):
        for pre_rolled in (False, True):
            out, grad = run_packed(inp, cp, tp, chunk_size=chunk_size, pre_rolled=pre_rolled)
            assert_same_values(out, ref, f"chunk {chunk_size} pre-rolled {pre_rolled}")
            torch.testing.assert_close(grad, expected_grad, **TOL)
    gen = torch.Generator().manual_seed(6)
    full = torch.randn(2, 8, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 8), generator=gen)
    target[0, 2], target[1, 5] = VOCAB + 1, -7
    weight = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    x = full.clone().requires_grad_()
    (reference_row_logprobs(x, target) * weight).sum().backward()
    cols, shard = VOCAB // tp.size, model_utils._get_tokens_on_this_cp_rank
    local = shard(full, cp.rank, cp.size, seq_dim=1)[..., tp.rank * cols : (tp.rank + 1) * cols].clone().requires_grad_()
    out = model_utils.from_parallel_logits_to_logprobs(local, target, tp.rank * cols, (tp.rank + 1) * cols, tp.group,
                                                       cp_group=cp.group)
    (out * weight).sum().backward()
    expected = cp.size * shard(x.grad, cp.rank, cp.size, seq_dim=1)[..., tp.rank * cols : (tp.rank + 1) * cols]
    torch.testing.assert_close(local.grad, expected, **TOL)
    return (cp.rank, tp.rank)


def case_allgather():
    """``allgather_cp_sharded_tensor``: the whole sequence on every rank, along any dim, integer tensors
    too; the gradient of a shard is the sum over ranks (``C`` times for a replicated loss)."""
    cp = context_parallel_info()
    shard = model_utils._get_tokens_on_this_cp_rank
    full = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3).requires_grad_()
    local = shard(full, cp.rank, cp.size, seq_dim=1)
    gathered = model_utils.allgather_cp_sharded_tensor(local, cp.group, seq_dim=1)
    assert torch.equal(gathered, full)
    (gathered ** 2).sum().backward()
    assert torch.equal(shard(full.grad, cp.rank, cp.size, seq_dim=1), cp.size * 2 * local.detach())
    other = shard(full.grad, (cp.rank + 1) % cp.size, cp.size, seq_dim=1)
    assert not other.any(), "only this rank's positions of the full tensor receive a gradient"
    ids = torch.arange(8 * 2).view(8, 2)
    assert torch.equal(model_utils.allgather_cp_sharded_tensor(shard(ids, cp.rank, cp.size, 0), cp.group, 0), ids)
    return cp.rank


def case_counts():
    """No host sync with ``validate=False`` (one with validation), one CP all-gather forward and one
    reduce-scatter backward (plus one TP all-gather under TP; two more per chunk with a TP filter)."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    inp = packed_inputs([5, 0, 16, 3], cp.size)
    local_total = inp.ids.shape[1] // cp.size
    found = {}
    for name, sampling, chunk in (("plain", None, None), ("top-p", SAMPLINGS["top-p"], 8)):
        for validate in (False, True):
            cols = VOCAB // tp.size
            local = _local(inp.logits, inp.cu_seqlens_padded, cp, tp).clone().requires_grad_()
            with HostSyncCounter() as syncs, CollectiveCounter() as forward:
                out = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
                    local, inp.ids, inp.cu_seqlens_padded, inp.seq_len, tp.rank * cols, (tp.rank + 1) * cols,
                    tp.group, cp_group=cp.group, chunk_size=chunk, sampling_params=sampling, validate=validate)
            with CollectiveCounter() as backward:
                finite_loss(out, inp.weight).backward()
            found[(name, validate)] = (syncs.calls, forward.calls, backward.calls)
    chunks = -(-local_total // 8)
    tp_filter = ["all_to_all_single", "all_gather_into_tensor"] * chunks if tp.size > 1 else []
    tp_combine = ["all_gather_into_tensor"] if tp.size > 1 else []
    cp_gather = ["all_gather_into_tensor"]
    assert found[("plain", False)] == ([], tp_combine + cp_gather, ["reduce_scatter_tensor"]), found
    assert found[("plain", True)] == (["tolist"], tp_combine + cp_gather, ["reduce_scatter_tensor"]), found
    assert found[("top-p", False)] == ([], tp_filter + tp_combine + cp_gather, ["reduce_scatter_tensor"]), found
    return found[("top-p", False)][1]


def case_errors():
    """The checks that need a CP group: ``T`` not a multiple of ``2C``; an odd shard of a row."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    cols = VOCAB // tp.size
    args = (tp.rank * cols, (tp.rank + 1) * cols, tp.group)
    try:
        model_utils.from_parallel_logits_to_logprobs_packed_sequences(
            torch.zeros(1, 3, cols), torch.zeros(1, 3 * cp.size, dtype=torch.int64), torch.tensor([0, 3 * cp.size]),
            4, *args, cp_group=cp.group)
    except PackingError as e:
        assert f"the packed length T={3 * cp.size} is not a multiple of 2*cp_size={2 * cp.size}" in str(e), e
    else:
        raise AssertionError("no error for T not a multiple of 2*cp_size")
    for call in (
        lambda: model_utils.from_parallel_logits_to_logprobs(torch.zeros(2, 3, cols), torch.zeros(2, 5, dtype=torch.int64),
                                                             *args, cp_group=cp.group),
        lambda: model_utils.allgather_cp_sharded_tensor(torch.zeros(2, 3), cp.group, seq_dim=1),
    ):
        try:
            call()
        except PackingError as e:
            assert "holds 3 positions per" in str(e) and "so it must be even" in str(e), e
        else:
            raise AssertionError("no error for an odd shard")
    return cp.rank


CASES: dict[str, Callable] = {
    "packed": case_packed,
    "rows": case_rows,
    "allgather": case_allgather,
    "out_of_vocab": case_out_of_vocab,
    "counts": case_counts,
    "errors": case_errors,
}
