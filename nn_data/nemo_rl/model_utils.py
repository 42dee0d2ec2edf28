"""NeMo-RL's log-prob functions of ``nemo_rl.distributed.model_utils`` on nn_data's path: one import switches
(docs/logprobs.md, "NeMo-RL's log-prob functions"; its conventions: docs/design.md, "NeMo-RL's log-prob conventions").

    # from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs_packed_sequences
    from nn_data.nemo_rl.model_utils import from_parallel_logits_to_logprobs_packed_sequences

Shape legend
    B   sequences (rows); ``cu_seqlens_padded`` has B+1 entries
    S   unpacked row length (``unpacked_seqlen``; ``target.shape[1]`` for unpacked rows)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    V   vocabulary; ``Vt = V / TP`` columns on a tensor-parallel rank
    n   a sequence's padded segment, ``cu_seqlens_padded[b+1] - cu_seqlens_padded[b]``"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nn_data.logprobs import sampling_filter, token_logprobs_local
from nn_data.extension import checks, collectives, process_groups
from nn_data.nemo_rl.linear_ce import (  # NeMo-RL's linear-CE fusion (log-probs from hidden states), with CP
    ChunkedDistributedHiddenStatesToLogprobs,
    from_parallel_hidden_states_to_logprobs,
    from_parallel_hidden_states_to_logprobs_packed_sequences,
    patch_gpt_model_forward_for_linear_ce_fusion,
)
from nn_data.nemo_rl.logprob_steps import (
    DEFAULT_CHUNK_TOKENS, chunk_and_filter, gather_cp, grad_mode, groups, in_vocab, nemo_rl_rows,
    out_of_vocab_as_nemo_rl, packed_logprobs, row_layout,
)
from nn_data.nemo_rl.distillation import (  # the head's other outputs: entropy, log-probs at ids, top-k, soft CE
    ChunkedDistributedEntropy,
    ChunkedDistributedGatherLogprob,
    DistributedCrossEntropy,
    distributed_vocab_topk,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
    vocab_parallel_gather_columns,
)
from nn_data.nemo_rl.sampling import TrainingSamplingParams
from nn_data.nemo_rl.assertions import PackingAssertionError, translate_errors
from nn_data.nemo_rl.vocab_parallel import (  # the CP helpers, the draft and cross-tokenizer losses' helpers
    AllGatherCPTensor,
    _get_tokens_on_this_cp_rank,
    allgather_cp_sharded_tensor,
    _compute_distributed_log_softmax_with_grad,
    _compute_distributed_softmax,
    all_to_all_sq2vp,
    all_to_all_vp2sq,
    cp_load_balanced_to_contiguous,
    cp_shift_next,
    group_all_reduce_sum,
    group_all_reduce_sum_with_grad,
    vocab_parallel_argmax,
    vocab_parallel_full_log_softmax,
    vocab_parallel_log_softmax,
)

__all__ = [
    "AllGatherCPTensor",
    "ChunkedDistributedEntropy",
    "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedHiddenStatesToLogprobs",
    "ChunkedDistributedLogprob",
    "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy",
    "DistributedLogprob",
    "DistributedLogprobWithSampling",
    "TrainingSamplingParams",
    "_compute_distributed_log_softmax",
    "_compute_distributed_log_softmax_with_grad",
    "_compute_distributed_softmax",
    "_get_tokens_on_this_cp_rank",
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "allgather_cp_sharded_tensor",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "distributed_vocab_topk",
    "gather_logits_at_global_indices",
    "get_distillation_topk_logprobs_from_logits",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
    "from_parallel_hidden_states_to_logprobs",
    "from_parallel_hidden_states_to_logprobs_packed_sequences",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "get_next_token_logprobs_from_logits",
    "patch_gpt_model_forward_for_linear_ce_fusion",
    "vocab_parallel_argmax",
    "vocab_parallel_full_log_softmax",
    "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
]


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: Optional["dist.ProcessGroup"],
    inference_only: bool = False,
    cp_group: Optional["dist.ProcessGroup"] = None,
    chunk_size: Optional[int] = None,
    sampling_params=None,
    target_is_pre_rolled: bool = False,
    *,
    validate: bool = True,
    pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` from this rank's packed logits ``[1, T/C, Vt]``: NeMo-RL's function.

    Args:
        vocab_parallel_logits: ``[1, T/C, Vt]`` floating point.
        target: the packed ids ``[1, T]`` (rolled here within each segment), or pre-rolled and sharded ``[1, T/C]``.
        cu_seqlens_padded: ``[B+1]`` rising from 0 to ``T`` in segments divisible by ``2C``.
        unpacked_seqlen: ``S``.
        vocab_start_index: this TP rank's first vocabulary column.
        vocab_end_index: one past its last.
        group: the tensor-parallel group (None: not split).
        inference_only: compute without autograd.
        cp_group: the context-parallel group (None: not split).
        chunk_size: tokens per chunk of the log-sum-exp (None: 256).
        sampling_params: top-k / top-p (:class:`TrainingSamplingParams`).
        target_is_pre_rolled: ``target`` is this rank's rolled shard.
        validate: nn_data only: False skips the one host sync.
        pg_collection: nn_data only: stands for the groups passed as None (its ``tp`` and ``cp``).

    Example (C 1, V 3, uniform logits): cu_seqlens_padded ``[0, 4]``, unpacked_seqlen 3 -> ``[[log(1/3), log(1/3)]]``.

    Raises :class:`~nn_data.errors.PackingError` for any argument outside what is listed above, ``top_k`` above
    ``V``, or a group this process is not in."""
    cp, tp = groups(cp_group, group, pg_collection)
    checks.check_float_logits("vocab_parallel_logits", vocab_parallel_logits, "[1, T // CP, vocab_size // TP] "
                               "(Expected probs to be 1D after squeezing)", 3)
    checks.check_packed("vocab_parallel_logits", vocab_parallel_logits)
    local_total, cols = vocab_parallel_logits.shape[1], vocab_parallel_logits.shape[2]
    total = local_total * cp.size
    seq_len = checks.positive_int("unpacked_seqlen", unpacked_seqlen)
    chunk, filt = chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, cols, tp)
    with grad_mode(inference_only):
        packed, layout = packed_logprobs(
            op="from_parallel_logits_to_logprobs_packed_sequences", name="vocab_parallel_logits",
            data=vocab_parallel_logits, target=target, cu_seqlens_padded=cu_seqlens_padded, total=total,
            seq_len=seq_len, cp=cp, pre_rolled=target_is_pre_rolled, validate=validate, vocab=cols * tp.size,
            # squeeze, not [0]: its backward is a view, where [0]'s would copy the logits' whole gradient
            score=lambda token, keep: _local_logprobs(vocab_parallel_logits.squeeze(0), token, keep, vocab_start_index,
                                                      tp, chunk, filt),
        )  # [1, T]
        return nemo_rl_rows(packed, layout, seq_len)  # [B, S-1]


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Optional["dist.ProcessGroup"],
    inference_only: bool = False,
    cp_group: Optional["dist.ProcessGroup"] = None,
    chunk_size: Optional[int] = None,
    sampling_params=None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` of unpacked rows from this rank's logits ``[B, S_loc, Vt]``: NeMo-RL's function (no sync).

    Under CP each row is this rank's zigzag shard of the row padded to ``S_loc * C >= S``; ``chunk_size`` counts
    positions per row, as NeMo-RL's; ``pg_collection`` (keyword-only) stands for the groups passed as None.

    Example (C 2, S 6, S_loc 4): each row is padded to 8 = 4 chunks of 2; rank 0 holds positions ``0, 1, 6, 7``,
    rank 1 ``2, 3, 4, 5``; positions 0-4 predict tokens 1-5.

    Raises :class:`~nn_data.errors.PackingError`: logits not ``[B, S_loc, Vt]`` floating point, ``target`` not
    ``[B, S]`` integer with ``S <= S_loc * C``, an odd ``S_loc`` under CP, a bad ``chunk_size``, vocabulary slice or
    ``top_k``, a group this process is not in."""
    cp, tp = groups(cp_group, tp_group, pg_collection)
    checks.check_float_logits("vocab_parallel_logits", vocab_parallel_logits, "[B, S // CP, vocab_size // TP]", 3)
    rows, local_len, cols = vocab_parallel_logits.shape
    padded_len = local_len * cp.size  # S_pad
    checks.check_row_target(target, rows, padded_len)
    checks.check_even_shard("vocab_parallel_logits", local_len, cp.size, "row")
    checks.check_same_device(vocab_parallel_logits=vocab_parallel_logits, target=target)
    chunk, filt = chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, cols, tp)
    seq_len = target.shape[1]
    with grad_mode(inference_only):
        layout = row_layout(rows, padded_len, target.device, op="from_parallel_logits_to_logprobs")  # a row a segment
        places = layout.local_places(cp.size, cp.rank)  # 2 x [B*S_loc]
        offset = places.source - places.segment * padded_len  # [B*S_loc] position in the padded row
        keep = offset + 1 < seq_len  # [B*S_loc]
        # row b, position s reads target[b, s + 1] (flat index b*S + s + 1; clamped where keep is False)
        flat = (places.segment * seq_len + offset + 1).clamp(0, max(rows * seq_len - 1, 0))
        token = target.reshape(-1).to(torch.int64)
        token = token.index_select(0, flat) if token.numel() else torch.zeros_like(flat)  # [B*S_loc]
        logits = vocab_parallel_logits.reshape(rows * local_len, cols)  # [B*S_loc, Vt]
        values = _local_logprobs(logits, token, keep, vocab_start_index, tp, chunk * max(rows, 1), filt)
        values = out_of_vocab_as_nemo_rl(values, in_vocab(token, cols * tp.size))
        full = gather_cp(values, layout, cp)  # [1, B*S_pad]
        return full.view(rows, padded_len)[:, : max(seq_len - 1, 0)]  # [B, S-1]


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: Optional[torch.Tensor] = None,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional["dist.ProcessGroup"] = None,
    context_parallel_group: Optional["dist.ProcessGroup"] = None,
    sampling_params=None,
    chunk_size: Optional[int] = None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """NeMo-RL's dispatcher: ``[B, S-1]`` log-probs of ``input_ids [B, S]`` from ``next_token_logits``.

    With ``vocab_parallel_group`` (or ``pg_collection.tp``): :func:`from_parallel_logits_to_logprobs`; without:
    full-vocabulary logits ``[B, S, V]``. Under a top-k / top-p filter logits narrower than float32 are cast to float32
    (as NeMo-RL). ``seq_index`` belongs to NeMo-RL's DTensor path, which nn_data does not provide.

    Raises :class:`~nn_data.errors.PackingError` for DTensor logits, a ``vocab_parallel_group`` without
    ``vocab_parallel_rank``, and as :func:`from_parallel_logits_to_logprobs`."""
    if type(next_token_logits).__name__ == "DTensor":
        raise PackingAssertionError("next_token_logits is a DTensor: nn_data.nemo_rl.model_utils covers the "
                                   "Megatron (vocab-parallel) and plain-tensor paths; use NeMo-RL's "
                                   "get_logprobs_from_vocab_parallel_logits for DTensor logits")
    if sampling_filter(sampling_params) is not None and next_token_logits.is_floating_point():
        next_token_logits = next_token_logits.to(torch.promote_types(next_token_logits.dtype, torch.float32))
    if pg_collection is not None:
        tp = process_groups.given_group_info(vocab_parallel_group, pg_collection=pg_collection, field="tp")
        vocab_parallel_group = tp.group
        vocab_parallel_rank = tp.rank if vocab_parallel_rank is None else vocab_parallel_rank
        context_parallel_group = process_groups.given_group_info(context_parallel_group, pg_collection=pg_collection).group
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise PackingAssertionError("vocab_parallel_rank must be provided when vocab_parallel_group is provided")
        cols = next_token_logits.shape[-1]
        return from_parallel_logits_to_logprobs(
            next_token_logits, input_ids, vocab_parallel_rank * cols, (vocab_parallel_rank + 1) * cols,
            vocab_parallel_group, cp_group=context_parallel_group, sampling_params=sampling_params,
            chunk_size=chunk_size,
        )
    cols = next_token_logits.shape[-1]
    return from_parallel_logits_to_logprobs(next_token_logits, input_ids, 0, cols, None,
                                            sampling_params=sampling_params)


# --- NeMo-RL's autograd functions, called as ``Class.apply(...)`` with its argument order ----------------------


class DistributedLogprob:
    """``apply(vocab_parallel_logits [*, Vt], target [*], vocab_start_index, vocab_end_index, group, inference_only=False)
    -> [*]``: ``log softmax(logits)[target]`` over the TP-split vocabulary (NeMo-RL's rule outside ``[0, V)``)."""

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False, *,
              pg_collection=None):
        return _token_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group,
                               None, None, inference_only, pg_collection)


class ChunkedDistributedLogprob:
    """``apply(vocab_parallel_logits [B, S, Vt], target [B, S], vocab_start_index, vocab_end_index, chunk_size, tp_group,
    inference_only=False) -> [B, S]``: :class:`DistributedLogprob`, ``chunk_size`` positions per row at a time."""

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False, *, pg_collection=None):
        return _token_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                               chunk_size, None, inference_only, pg_collection)


class DistributedLogprobWithSampling:
    """``apply(vocab_parallel_logits [B, S, Vt], target [B, S], tp_group, top_k, top_p,
    inference_only=False) -> [B, S]``: the log-softmax over the logits a top-k / top-p filter keeps."""

    @staticmethod
    def apply(vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only=False, *, pg_collection=None):
        return _sampled(vocab_parallel_logits, target, tp_group, top_k, top_p, None, inference_only, pg_collection)


class ChunkedDistributedLogprobWithSampling:
    """``apply(vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only=False)``:
    :class:`DistributedLogprobWithSampling`, ``chunk_size`` positions per row at a time."""

    @staticmethod
    def apply(vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only=False, *,
              pg_collection=None):
        return _sampled(vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only,
                        pg_collection)


@torch.no_grad()
def _compute_distributed_log_softmax(vocab_parallel_logits: torch.Tensor, group, *,
                                     pg_collection=None) -> torch.Tensor:
    """The log-softmax over the TP-split vocabulary, this rank's columns ``[*, Vt]`` (no autograd, one all-gather)."""
    tp = process_groups.given_group_info(group, pg_collection=pg_collection, field="tp")
    lse = torch.logsumexp(vocab_parallel_logits, dim=-1)  # [*]
    if tp.size > 1:
        lse = torch.logsumexp(collectives.all_gather_dim0(lse[None], tp.group), dim=0)  # [TP, *] -> [*]
    return vocab_parallel_logits - lse[..., None]


# --- shared steps ------------------------------------------------------------------------------------------


def _local_logprobs(logits, token, keep, vocab_start: int, tp: process_groups.ParallelInfo, chunk: int, filt):
    return token_logprobs_local(logits, token, keep, vocab_start=vocab_start, tp_group=tp.group, tp_size=tp.size,
                                chunk_tokens=chunk, sampling=filt)


def _token_logprobs(logits, target, vocab_start_index, vocab_end_index, group, chunk_size, filt, inference_only,
                    pg_collection=None):
    """Log-probs of ``target [*]`` at every position of ``logits [*, Vt]`` (the autograd classes' body); ``chunk_size``
    counts positions of a row, as NeMo-RL's."""
    tp = process_groups.given_group_info(group, pg_collection=pg_collection, field="tp")
    checks.check_min_dims("vocab_parallel_logits", logits, 1, "[*, V // TP]")
    cols = logits.shape[-1]
    checks.check_vocab_range(vocab_start_index, vocab_end_index, cols, tp.rank)
    if chunk_size is None:
        chunk = DEFAULT_CHUNK_TOKENS
    else:
        chunk = checks.positive_int("chunk_size", chunk_size) * (logits.shape[0] if logits.dim() == 3 else 1)
    with grad_mode(inference_only):
        token = target.reshape(-1).to(torch.int64)  # [M]
        keep = torch.ones_like(token, dtype=torch.bool)
        values = _local_logprobs(logits.reshape(-1, cols), token, keep, vocab_start_index, tp, chunk, filt)  # [M]
        return out_of_vocab_as_nemo_rl(values, in_vocab(token, cols * tp.size)).view(target.shape)


def _sampled(logits, target, tp_group, top_k, top_p, chunk_size, inference_only, pg_collection=None):
    """:class:`DistributedLogprobWithSampling`'s body: this TP rank's vocabulary slice is the standard one."""
    filt = sampling_filter(TrainingSamplingParams(top_k=top_k, top_p=top_p))
    tp, cols = process_groups.given_group_info(tp_group, pg_collection=pg_collection, field="tp"), logits.shape[-1]
    if filt is not None:
        checks.check_top_k(filt.top_k, cols * tp.size)
    return _token_logprobs(logits, target, tp.rank * cols, (tp.rank + 1) * cols, tp.group, chunk_size, filt,
                           inference_only)

translate_errors(globals())  # the core's PackingError leaves as PackingAssertionError (nn_data.nemo_rl.assertions)
