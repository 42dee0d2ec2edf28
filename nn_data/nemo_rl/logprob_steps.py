"""The steps NeMo-RL's log-prob functions share, from logits (``model_utils``) or from hidden states
(``linear_ce``): groups, chunking and filter arguments, the packed targets, NeMo-RL's rule for a target
outside the vocabulary, and the CP gather with NeMo-RL's ``C``-times gradient.

Shape legend
    B   sequences; ``cu_seqlens_padded`` has B+1 entries
    S   unpacked row length (``unpacked_seqlen``)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    Vt  vocabulary columns on a tensor-parallel rank
"""

from __future__ import annotations

import contextlib

import torch

from nn_data import _checks
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.groups import ParallelInfo, given_group_info
from nn_data.layout.internal import Segments, local_places, segment_bounds
from nn_data.sampling import sampling_filter
from nn_data.targets import next_token_at
from nn_data.unpack import unpack_sequences

#: Tokens per chunk of the log-sum-exp when NeMo-RL's ``chunk_size`` is None (NeMo-RL then holds
#: a float32 ``[N, Vt]`` log-softmax; one ``[256, Vt]`` block here).
DEFAULT_CHUNK_TOKENS = 256


def groups(cp_group, tp_group, pg_collection=None) -> tuple[ParallelInfo, ParallelInfo]:
    """``(cp, tp)`` of a call: the groups given, else ``pg_collection``'s ``cp`` / ``tp``, else not split
    (:func:`nn_data.groups.given_group_info`)."""
    return (given_group_info(cp_group, pg_collection=pg_collection, field="cp"),
            given_group_info(tp_group, pg_collection=pg_collection, field="tp"))


def grad_mode(inference_only: bool):
    """``torch.no_grad()`` for NeMo-RL's ``inference_only=True`` (no graph, nothing saved), else nothing."""
    return torch.no_grad() if inference_only else contextlib.nullcontext()


def chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, cols: int, tp: ParallelInfo,
                     **vocab_wording):
    """Tokens per chunk and the sampling filter (or None), after the checks they share (``vocab_wording``:
    :func:`~nn_data._checks.check_vocab_range`'s ``against`` / ``unit``)."""
    chunk = _checks.positive_int("chunk_size", chunk_size, allow_none=True) or DEFAULT_CHUNK_TOKENS
    _checks.check_vocab_range(vocab_start_index, vocab_end_index, cols, tp.rank, **vocab_wording)
    filt = sampling_filter(sampling_params)
    if filt is not None:
        _checks.check_top_k(filt.top_k, cols * tp.size)
    return chunk, filt


def packed_targets(target, pre_rolled: bool, cu_seqlens_padded, total: int, cp: ParallelInfo, seq_len: int):
    """``(token [N], keep [N])`` for this rank's packed positions: the token each one scores and
    whether NeMo-RL's output holds it (offset ``s`` in its padded segment ``n``: ``s < min(n-1, S-1)``).

    Example (C 1): cu_seqlens_padded ``[0, 4, 12]``, S 6 -> keep ``[T,T,T,F, T,T,T,T,T,F,F,F]``
    (segment 1 is cut at ``S - 1 = 5`` positions); position 3 would score the next segment's token.
    """
    bounds = segment_bounds(cu_seqlens_padded, total)  # [B'+1]
    places = local_places(bounds, total, cp.size, cp.rank)  # 2 x [N]
    seg_len = bounds[1:] - bounds[:-1]  # [B'] padded segments: every padded position is scored
    offset = places.source - bounds[places.segment]  # [N]
    keep = (offset + 1 < seg_len[places.segment]) & (offset + 1 < seq_len)  # [N]
    if pre_rolled:
        return target[0].to(torch.int64), keep  # [N] given on this rank's positions
    return next_token_at(target[0], Segments(bounds, seg_len), places, total)[0], keep  # [N] the token at t + 1


def in_vocab(token: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N]`` bool: the target is a vocabulary id."""
    return (token >= 0) & (token < vocab)


def out_of_vocab_as_nemo_rl(values: torch.Tensor, token_in_vocab: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's result for a target outside the vocabulary: the value 0, and the gradient its backward
    gives, ``-softmax`` of the row times the output's gradient (NeMo-RL masks such a target out of the
    one-hot term only). ``values`` come from the chunked kernel run with those positions kept, where no
    rank owns the target: their value is ``-lse`` and their gradient ``-softmax``; ``v - v.detach()``
    is exactly 0 and passes the gradient through unchanged.

    Example: ``values [-1.2, -3.4]``, ``token_in_vocab [True, False]`` -> ``[-1.2, 0.0]``, and a gradient
    ``g`` reaches both positions of the kernel.
    """
    return torch.where(token_in_vocab, values, values - values.detach())


def gather_cp(values: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp: ParallelInfo) -> torch.Tensor:
    """``[N, *]`` on each rank -> ``[1, T, *]``: one all-gather; backward a reduce-scatter (NeMo-RL's
    ``C``-times gradient)."""
    if cp.size == 1:
        return values[None]
    return GatherFromContextParallel(cp.group, grad_mode="sum", validate=False)(values[None], cu_seqlens_padded)


def nemo_rl_rows(packed: torch.Tensor, cu_seqlens_padded: torch.Tensor, seq_len: int) -> torch.Tensor:
    """NeMo-RL's ``[B, S-1]`` rows from the packed values ``[1, T]`` (position ``start_b + s`` scoring token
    ``s + 1``): row ``b`` keeps ``min(n_b - 1, S - 1)`` values, 0 beyond. Example: segments ``[4, 8]``, S 6
    -> rows of 3 and 5 values."""
    cu = cu_seqlens_padded.to(torch.int64)
    lengths = (cu[1:] - cu[:-1] - 1).clamp(0, seq_len - 1)  # [B] min(n_b - 1, S - 1)
    return unpack_sequences(packed, lengths, cu_seqlens_padded, seq_len - 1, 0, validate=False)  # [B, S-1]
