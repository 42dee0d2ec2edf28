"""Tier: pure CPU, single process (C = 1, no tensor parallelism; CP 2 and TP 2 x CP 2 run in
tests/multiprocess/test_model_utils_multiprocess.py).

``nn_data.nemo_rl.model_utils`` against the NeMo-RL-semantics loop oracle (``nn_data.testing.nemo_reference``)
in float64 at 1e-10, values on every position and gradients: the packed function (every argument:
chunked, top-k / top-p, pre-rolled targets, ``inference_only``), unpacked rows, the autograd classes,
the dispatcher; the conversion to nn_data's ``TokenLogProbs`` convention; dtypes; no host sync
(meta tensors) and one with validation; every error message.
"""

from __future__ import annotations

import math

import pytest
import torch

from nn_data import PackingError, TokenLogProbs
from nn_data.nemo_rl import model_utils as mu
from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.groups import SINGLE
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.logprobs.filters import SamplingFilter, row_thresholds, sampling_filter
from nn_data.testing.nemo_reference import reference_filter, reference_row_logprobs
from nn_data.testing.reference import reference_shard
from nn_data.diagnostics import Allocations
from tests.support.model_utils_cases import (
    LAYOUTS,
    SAMPLINGS,
    VOCAB,
    assert_same_values,
    finite_loss,
    packed_inputs,
    reference_packed,
    run_packed,
)

TOL = dict(rtol=0, atol=1e-10)
PACKED = mu.from_parallel_logits_to_logprobs_packed_sequences


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("lengths", LAYOUTS + [[]], ids=str)
def test_packed_values_and_gradients_equal_the_oracle(lengths, sampling):
    inp = packed_inputs(lengths, 1, pad_full_seq_to=64, seed=len(lengths))
    ref, ref_grad = reference_packed(inp, SAMPLINGS[sampling])
    for chunk_size in (None, 1, 7):
        for pre_rolled in (False, True):
            out, grad = run_packed(inp, SINGLE, SINGLE, chunk_size=chunk_size, sampling=SAMPLINGS[sampling],
                                   pre_rolled=pre_rolled)
            assert_same_values(out, ref, f"chunk {chunk_size} pre-rolled {pre_rolled}")
            torch.testing.assert_close(grad, ref_grad, **TOL)
    assert ref.shape == (len(lengths), inp.seq_len - 1)


def test_padding_positions_keep_log_p_of_the_pad_token_and_rows_are_cut_at_unpacked_seqlen():
    # lengths [5, 0, 16, 3] on 48 positions, segments padded to 2: [6, 0, 16, 26]; S 8 cuts segment 2 and 3
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48, seq_len=8)
    out = PACKED(inp.logits, inp.ids, inp.cu_seqlens_padded, 8, 0, VOCAB, None)
    lp = torch.log_softmax(inp.logits[0], dim=-1)  # [T, V]
    # row 0: start 0, L 5, segment 6: positions 0..3 predict tokens 1..4, position 4 the pad at 5
    assert torch.allclose(out[0, 4], lp[4, inp.ids[0, 5]]) and out[0, 4] != 0
    assert torch.equal(out[0, 5:], torch.zeros(2, dtype=out.dtype))  # past the segment: 0
    assert torch.equal(out[1], torch.zeros(7, dtype=out.dtype))  # an empty row
    assert (out[2] != 0).all() and (out[3] != 0).all()  # long segments: all S-1 = 7 positions kept


def test_conversion_to_token_logprobs_convention():
    # nn_data's TokenLogProbs: [B, S] with 0 at s = 0 and past L; NeMo-RL's: [B, S-1], shifted by one,
    # log p(pad) past L. TokenLogProbs == cat([0, nemo]) masked to 1 <= s < L (single process: same gradient).
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    r_cu = torch.tensor([0, 5, 5, 21, 24])  # cu_seqlens of the lengths
    x = inp.logits.clone().requires_grad_()
    nemo = PACKED(x, inp.ids, inp.cu_seqlens_padded, inp.seq_len, 0, VOCAB, None)
    lengths = r_cu[1:] - r_cu[:-1]
    s = torch.arange(inp.seq_len)
    converted = torch.cat([torch.zeros_like(nemo[:, :1]), nemo], dim=1) * ((s >= 1) & (s < lengths[:, None]))
    y = inp.logits.clone().requires_grad_()
    ours = TokenLogProbs(inp.seq_len)(y, inp.ids, r_cu.to(torch.int32), inp.cu_seqlens_padded)
    torch.testing.assert_close(converted, ours, **TOL)
    w = torch.randn(ours.shape, dtype=torch.float64)
    (converted * w).sum().backward()
    (ours * w).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, **TOL)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_unpacked_rows_equal_the_oracle(sampling):
    sp = SAMPLINGS[sampling]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9, VOCAB, generator=gen, dtype=torch.float64)  # S_loc 9 >= S 7 (padded rows)
    target = torch.randint(0, VOCAB, (3, 7), generator=gen)
    ref = reference_row_logprobs(logits, target, *(() if sp is None else (sp.top_k, sp.top_p)))
    for chunk_size in (None, 2):
        out = mu.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, chunk_size=chunk_size,
                                                  sampling_params=sp)
        assert_same_values(out, ref, f"chunk {chunk_size}")
        via = mu.get_next_token_logprobs_from_logits(target, logits, sampling_params=sp, chunk_size=chunk_size)
        assert_same_values(via, ref, "get_next_token_logprobs_from_logits")


def test_autograd_classes_take_nemo_rls_argument_order():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 5), generator=gen)
    target[0, 0] = -100  # outside the vocabulary: 0, as NeMo-RL's vocab mask gives
    lp = torch.log_softmax(logits, dim=-1).gather(2, target.clamp(min=0)[..., None]).squeeze(2)
    expected = torch.where(target >= 0, lp, 0.0)
    for out in (mu.DistributedLogprob.apply(logits, target, 0, VOCAB, None),
                mu.ChunkedDistributedLogprob.apply(logits, target, 0, VOCAB, 2, None)):
        torch.testing.assert_close(out, expected, **TOL)
    sampled = mu.DistributedLogprobWithSampling.apply(logits, target.clamp(min=0), None, 6, 0.9)
    chunked = mu.ChunkedDistributedLogprobWithSampling.apply(logits, target.clamp(min=0), None, 6, 0.9, 2)
    assert torch.equal(torch.isinf(sampled), torch.isinf(chunked)) and torch.isinf(sampled).any()
    torch.testing.assert_close(sampled.nan_to_num(neginf=0), chunked.nan_to_num(neginf=0), **TOL)
    torch.testing.assert_close(mu._compute_distributed_log_softmax(logits, None), torch.log_softmax(logits, -1), **TOL)


def test_out_of_vocabulary_targets_get_nemo_rls_value_and_gradient():
    """A target outside ``[0, V)`` (``V`` itself, ``V + 2``, ``-100``): the value 0 and NeMo-RL's gradient
    ``-softmax`` times the output's gradient (its backward masks the one-hot term only; checked against
    NeMo-RL's own ``DistributedLogprob`` and packed function, docs/nemo-rl.md), in the autograd classes,
    the packed function (rolled here and pre-rolled) and unpacked rows."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 5, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 5), generator=gen)
    target[0, 1], target[1, 3], target[1, 4] = VOCAB, VOCAB + 2, -100
    w = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    in_vocab = (target >= 0) & (target < VOCAB)
    one_hot = torch.nn.functional.one_hot(target.clamp(0, VOCAB - 1), VOCAB) * in_vocab[..., None]
    expected = (one_hot - torch.softmax(logits, -1)) * w[..., None]
    for name, fn in (("DistributedLogprob", lambda x: mu.DistributedLogprob.apply(x, target, 0, VOCAB, None)),
                     ("ChunkedDistributedLogprob", lambda x: mu.ChunkedDistributedLogprob.apply(x, target, 0, VOCAB,
                                                                                                2, None))):
        x = logits.clone().requires_grad_()
        out = fn(x)
        (out * w).sum().backward()
        assert torch.equal(out[~in_vocab], torch.zeros(3, dtype=out.dtype)), name
        torch.testing.assert_close(x.grad, expected, **TOL, msg=lambda m: f"{name}: {m}")
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    ids = inp.ids.clone()
    ids[0, 3], ids[0, 7], ids[0, 30] = VOCAB, VOCAB + 5, -1  # targets of positions 2, 6 and 29
    inp = inp._replace(ids=ids)
    ref, ref_grad = reference_packed(inp, None)
    for pre_rolled in (False, True):
        out, grad = run_packed(inp, SINGLE, SINGLE, chunk_size=7, pre_rolled=pre_rolled)
        assert_same_values(out, ref, f"packed, pre-rolled {pre_rolled}")
        torch.testing.assert_close(grad, ref_grad, **TOL)
    assert ref_grad[0, 2].abs().sum() > 0 and ref[0, 2] == 0  # the oracle's out-of-vocabulary position
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    rows = mu.from_parallel_logits_to_logprobs(x, target, 0, VOCAB, None, chunk_size=2)
    ref_rows = reference_row_logprobs(y, target)
    (rows * w[:, 1:]).sum().backward()
    (ref_rows * w[:, 1:]).sum().backward()
    assert_same_values(rows, ref_rows.detach(), "rows")
    torch.testing.assert_close(x.grad, y.grad, **TOL)


def test_inference_only_builds_no_graph_and_dtypes_follow_the_logits():
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    x = inp.logits.clone().requires_grad_()
    assert not PACKED(x, inp.ids, inp.cu_seqlens_padded, 16, 0, VOCAB, None, inference_only=True).requires_grad
    ref = PACKED(inp.logits, inp.ids, inp.cu_seqlens_padded, 16, 0, VOCAB, None)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        out = PACKED(inp.logits.to(dtype), inp.ids, inp.cu_seqlens_padded, 16, 0, VOCAB, None)
        assert out.dtype == torch.float32  # NeMo-RL's dtype below float64
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert ref.dtype == torch.float64  # float64 logits stay float64 (NeMo-RL: float32)


@pytest.mark.parametrize("sampling", [None, "top-k+top-p"])
def test_one_chunk_in_forward_and_one_logits_sized_gradient_in_backward(sampling):
    inp = packed_inputs([16, 16, 9], 1, pad_full_seq_to=48)
    x = inp.logits.float().requires_grad_()
    with Allocations() as fwd:
        out = PACKED(x, inp.ids, inp.cu_seqlens_padded, 16, 0, VOCAB, None, chunk_size=4,
                     sampling_params=SAMPLINGS.get(sampling), validate=False)
    assert max(fwd.sizes) <= 4 * VOCAB  # one [chunk, V] block at a time (the filter's sort included)
    with Allocations() as bwd:
        finite_loss(out, inp.weight.float()).backward()
    assert [n for n in bwd.sizes if n > 4 * VOCAB] == [x.numel()]  # the gradient itself, chunk by chunk


def test_filter_thresholds_match_the_oracle_and_the_docstring_example():
    x = torch.tensor([[1.0, 3.0, 0.0, 2.0]])
    assert row_thresholds(x, SamplingFilter(2, 1.0)).tolist() == [2.0]
    assert row_thresholds(x, SamplingFilter(None, 0.5)).tolist() == [3.0]
    assert sampling_filter(TrainingSamplingParams(top_k=-1, top_p=0.9)) == SamplingFilter(None, 0.9)
    assert sampling_filter(TrainingSamplingParams()) is None and sampling_filter(None) is None
    rows = torch.randn(64, 30, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for filt in (SamplingFilter(5, 1.0), SamplingFilter(None, 0.3), SamplingFilter(8, 0.95), SamplingFilter(3, 1.5)):
        tau = row_thresholds(rows, filt)
        for row, t in zip(rows, tau):
            assert torch.equal(row >= t, reference_filter(row, filt.top_k, filt.top_p)), filt


def test_zigzag_shard_and_allgather_without_a_group():
    x = torch.arange(2 * 12 * 3).view(2, 12, 3)
    assert mu._get_tokens_on_this_cp_rank(x, 0, 1) is x
    for rank in range(3):
        rows = torch.cat([reference_shard(x[b : b + 1], [0, 12], 3, rank) for b in range(2)])  # [2, 4, 3]
        assert torch.equal(mu._get_tokens_on_this_cp_rank(x, rank, 3), rows)
        assert torch.equal(mu._get_tokens_on_this_cp_rank(x[0], rank, 3, seq_dim=0), rows[0])
    assert torch.equal(mu._get_tokens_on_this_cp_rank(torch.arange(8), 1, 2, seq_dim=0), torch.tensor([2, 3, 4, 5]))
    assert mu.allgather_cp_sharded_tensor(x, None) is x


def test_no_host_sync_on_meta_tensors_and_one_with_validation():
    logits = torch.empty(1, 64, VOCAB, device="meta", requires_grad=True)
    ids = torch.empty(1, 64, dtype=torch.int64, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    for sp in (None, SAMPLINGS["top-k+top-p"]):
        with HostSyncCounter() as syncs, CollectiveCounter() as coll:
            out = PACKED(logits, ids, cu, 16, 0, VOCAB, None, chunk_size=16, sampling_params=sp, validate=False)
            out.sum().backward()
            rows = mu.from_parallel_logits_to_logprobs(logits.view(4, 16, VOCAB), ids.view(4, 16), 0, VOCAB, None,
                                                       sampling_params=sp)
        assert syncs.calls == [] and coll.calls == [] and out.shape == (4, 15) and rows.shape == (4, 15)
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    with HostSyncCounter() as syncs:
        PACKED(inp.logits, inp.ids, inp.cu_seqlens_padded, 16, 0, VOCAB, None)
    assert syncs.calls == ["tolist"]  # the validation of cu_seqlens_padded


def test_bad_arguments_name_the_argument_and_the_valid_values():
    inp = packed_inputs([5, 0, 16, 3], 1, pad_full_seq_to=48)
    lg, ids, cu = inp.logits, inp.ids, inp.cu_seqlens_padded
    cases = [
        (lambda: PACKED(lg[0], ids, cu, 16, 0, VOCAB, None), "Expected probs to be 1D after squeezing"),
        (lambda: PACKED(lg.expand(2, -1, -1), ids, cu, 16, 0, VOCAB, None), r"must be \[1, T, \*\]"),
        (lambda: PACKED(lg, ids[:, :40], cu, 16, 0, VOCAB, None), r"target_is_pre_rolled=False it must be the packed ids \[1, 48\]"),
        (lambda: PACKED(lg, ids.float(), cu, 16, 0, VOCAB, None), "target must be integer token ids"),
        (lambda: PACKED(lg, ids, cu, 0, 0, VOCAB, None), "unpacked_seqlen=0 is invalid; expected an int >= 1"),
        (lambda: PACKED(lg, ids, cu, 16, 0, VOCAB, None, chunk_size=0), "chunk_size=0 is invalid"),
        (lambda: PACKED(lg, ids, cu, 16, 0, VOCAB - 1, None), "vocab_end_index=39 do not match the logits"),
        (lambda: PACKED(lg, ids, cu, 16, 0, VOCAB, None, sampling_params=TrainingSamplingParams(top_k=41)),
         "sampling_params.top_k=41 is invalid for a vocabulary of 40 tokens"),
        (lambda: PACKED(lg, ids, cu.clamp(max=40), 16, 0, VOCAB, None), "must start at 0, never decrease and end at 48"),
        (lambda: mu.from_parallel_logits_to_logprobs(lg, ids[:, :10].expand(2, 10), 0, VOCAB, None),
         r"the logits hold 1 rows of 48 positions .* so target must be \[1, S\] with S <= 48"),
        (lambda: mu.from_parallel_logits_to_logprobs(lg, torch.zeros(1, 50, dtype=torch.int64), 0, VOCAB, None),
         r"target has shape \(1, 50\); the logits hold 1 rows of 48"),
        (lambda: mu.from_parallel_logits_to_logprobs(lg, ids[:, :10].float(), 0, VOCAB, None),
         r"target must be integer token ids \[B, S\]"),
        (lambda: mu.from_parallel_logits_to_logprobs(lg[0], ids, 0, VOCAB, None), "must be floating-point logits"),
        (lambda: mu._get_tokens_on_this_cp_rank(ids, 0, 5), "48 positions along seq_dim=1, not a multiple of 2\\*cp_size=10"),
        (lambda: mu._get_tokens_on_this_cp_rank(ids, 2, 2), "cp_rank=2 is invalid"),
        (lambda: mu.get_next_token_logprobs_from_logits(ids, lg, vocab_parallel_group=object()),
         "vocab_parallel_rank must be provided when vocab_parallel_group is provided"),
        (lambda: mu.get_next_token_logprobs_from_logits(ids, torch.Tensor._make_subclass(_DTensorLike, lg)),
         "next_token_logits is a DTensor"),
    ]
    for call, message in cases:
        with pytest.raises(PackingError, match=message):
            call()


class _DTensorLike(torch.Tensor):
    """A tensor whose class is named like torch's DTensor (the dispatcher refuses it by name)."""


_DTensorLike.__name__ = "DTensor"


def test_uniform_logits_docstring_example():
    out = PACKED(torch.zeros(1, 4, 3, dtype=torch.float64), torch.tensor([[1, 2, 0, 0]]), torch.tensor([0, 4]),
                 3, 0, 3, None)
    torch.testing.assert_close(out, torch.full((1, 2), math.log(1 / 3), dtype=torch.float64), **TOL)


# --- NeMo-RL's entropy, distillation and vocabulary-parallel helpers (cases: tests/support/distillation_cases.py) ---

# NeMo-RL's public names of nemo_rl/distributed/model_utils.py (HEAD 7ea279a) and where each stands here: every
# one is importable from nn_data.nemo_rl.model_utils but the DTensor path's, left out in docs/logprobs.md.
NEMO_RL_NAMES = [
    "AllGatherCPTensor", "ChunkedDistributedEntropy", "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedHiddenStatesToLogprobs", "ChunkedDistributedLogprob", "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy", "DistributedLogprob", "DistributedLogprobWithSampling",
    "_compute_distributed_log_softmax", "_compute_distributed_log_softmax_with_grad", "_compute_distributed_softmax",
    "_get_tokens_on_this_cp_rank", "all_to_all_sq2vp", "all_to_all_vp2sq", "allgather_cp_sharded_tensor",
    "cp_load_balanced_to_contiguous", "cp_shift_next", "distributed_vocab_topk", "from_parallel_hidden_states_to_logprobs",
    "from_parallel_logits_to_logprobs", "from_parallel_logits_to_logprobs_packed_sequences",
    "gather_logits_at_global_indices", "get_distillation_topk_logprobs_from_logits", "get_next_token_logprobs_from_logits",
    "group_all_reduce_sum", "group_all_reduce_sum_with_grad", "patch_gpt_model_forward_for_linear_ce_fusion",
    "vocab_parallel_argmax", "vocab_parallel_full_log_softmax", "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
]
LEFT_OUT = ["dtensor_from_parallel_logits_to_logprobs", "get_logprobs_from_vocab_parallel_logits"]


def test_nemo_rls_names_are_here_and_each_absent_one_is_documented():
    from pathlib import Path

    missing = [n for n in NEMO_RL_NAMES if not hasattr(mu, n)]
    assert missing == [] and set(NEMO_RL_NAMES) <= set(mu.__all__)
    doc = (Path(__file__).parents[2] / "docs" / "logprobs.md").read_text()
    for name in LEFT_OUT:
        assert not hasattr(mu, name) and f"`{name}`" in doc, name


@pytest.mark.parametrize("case", ["entropy_and_gather_logprob", "cross_entropy_and_topk",
                                  "gather_logits_and_distillation", "vocab_parallel_helpers", "errors"])
def test_entropy_distillation_and_vocab_parallel_helpers_equal_nemo_rls_semantics(case):
    from tests.support.distillation_cases import CASES

    assert CASES[case]() == (0, 0)


def test_entropy_docstring_examples_and_nemo_rls_sign():
    z = torch.zeros(1, 1, 4, dtype=torch.float64)
    assert torch.allclose(mu.ChunkedDistributedEntropy.apply(z, 1, None), torch.tensor([[-math.log(4)]]).double())
    ce = mu.DistributedCrossEntropy.apply(torch.tensor([[0.0, math.log(3)]]), torch.tensor([[0.0, 0.0]]), None)
    assert abs(ce.item() - 0.8370) < 1e-4
    vals, ids = mu.distributed_vocab_topk(torch.tensor([[[1.0, 5.0, 3.0]]]), 2, None, vocab_start_index=0,
                                          vocab_end_index=3)
    assert vals.tolist() == [[[5.0, 3.0]]] and ids.tolist() == [[[1, 2]]]
    assert mu.vocab_parallel_argmax(torch.tensor([[[1.0, 5.0, 5.0]]])).tolist() == [[1]]
    assert mu.gather_logits_at_global_indices(torch.tensor([[[1.0, 5.0, 3.0]]]), torch.tensor([[[2, 0]]]),
                                              vocab_start_index=0, vocab_end_index=3).tolist() == [[[3.0, 1.0]]]
    assert mu.cp_shift_next(torch.tensor([[1, 2, 3]]), fill=0).tolist() == [[2, 3, 0]]


def test_bfloat16_logits_give_float32_entropy_and_a_bfloat16_gradient():
    z = torch.randn(2, 6, 16).to(torch.bfloat16).requires_grad_()
    out = mu.ChunkedDistributedEntropy.apply(z, 2, None)
    out.sum().backward()
    ref = torch.log_softmax(z.detach().float(), -1)
    assert out.dtype == torch.float32 and z.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, (ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)


def test_entropy_and_gather_logprob_hold_no_float32_copy_of_the_logits():
    """NeMo-RL's functions hold ``[B, S, V]`` float32 log-softmax / softmax per chunk of positions of every row;
    here one ``[chunk, V]`` block at a time, forward and backward (the logits' gradient aside)."""
    rows, seq, vocab, chunk = 2, 32, 101, 2
    z = torch.randn(rows, seq, vocab, dtype=torch.float32, requires_grad=True)
    ids = torch.randint(0, vocab, (rows, seq, 3))
    with Allocations() as fwd:
        h = mu.ChunkedDistributedEntropy.apply(z, chunk, None)
        g = mu.ChunkedDistributedGatherLogprob.apply(z, ids, 0, vocab, chunk, None)
    assert max(fwd.sizes) <= rows * chunk * vocab
    with Allocations() as bwd:
        (h.sum() + g.sum()).backward()
    # each op's logits gradient and autograd's sum of the two into z.grad
    assert sorted(n for n in bwd.sizes if n > rows * chunk * vocab) == [z.numel()] * 3
