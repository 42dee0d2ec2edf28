"""The steps NeMo-RL's log-prob functions share, from logits (``model_utils``) or hidden states (``linear_ce``), and
the one body of both packed entry points (:func:`packed_logprobs`); the kernels are :mod:`nn_data.logprobs`'.

Shape legend
    B   sequences; ``cu_seqlens_padded`` has B+1 entries
    S   unpacked row length (``unpacked_seqlen``)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    Vt  vocabulary columns on a tensor-parallel rank"""

from __future__ import annotations

import contextlib

import torch

from nn_data.layout import Boundaries, layout_from_boundaries
from nn_data.logprobs import sampling_filter
from nn_data.extension import checks, layout_checks, next_token_at, process_groups, unpack_sequences
from nn_data import GatherFromContextParallel, PackLayout

#: Tokens per chunk of the log-sum-exp when NeMo-RL's ``chunk_size`` is None (NeMo-RL then holds
#: a float32 ``[N, Vt]`` log-softmax; one ``[256, Vt]`` block here).
DEFAULT_CHUNK_TOKENS = 256


def groups(cp_group, tp_group, pg_collection=None) -> tuple[process_groups.ParallelInfo, process_groups.ParallelInfo]:
    """``(cp, tp)`` of a call: the groups given, else ``pg_collection``'s ``cp`` / ``tp``, else not split
    (:func:`nn_data.groups.given_group_info`)."""
    return (process_groups.given_group_info(cp_group, pg_collection=pg_collection, field="cp"),
            process_groups.given_group_info(tp_group, pg_collection=pg_collection, field="tp"))


def grad_mode(inference_only: bool):
    """``torch.no_grad()`` for NeMo-RL's ``inference_only=True`` (no graph, nothing saved), else nothing."""
    return torch.no_grad() if inference_only else contextlib.nullcontext()


def chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, cols: int, tp: process_groups.ParallelInfo,
                     **vocab_wording):
    """Tokens per chunk and the sampling filter (or None), after the checks they share (``vocab_wording``:
    :func:`~nn_data._checks.check_vocab_range`'s ``against`` / ``unit``)."""
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True) or DEFAULT_CHUNK_TOKENS
    checks.check_vocab_range(vocab_start_index, vocab_end_index, cols, tp.rank, **vocab_wording)
    filt = sampling_filter(sampling_params)
    if filt is not None:
        checks.check_top_k(filt.top_k, cols * tp.size)
    return chunk, filt


def packed_layout(cu_seqlens_padded: torch.Tensor, total: int, cp: process_groups.ParallelInfo, *, op: str,
                  validate: bool) -> PackLayout:
    """The layout of a packed call: with ``validate`` one host read of ``cu_seqlens_padded`` (device asserts when
    compiled). Its valid tokens are the whole padded segments, as NeMo-RL scores them."""
    bounds = Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens_padded)
    # NeMo-RL's validate=False means no read at all: the drop-in asks for the device executor then
    return layout_from_boundaries(bounds, op=op, cp_size=cp.size, validate=validate, host_reads=validate)


def row_layout(rows: int, row_len: int, device, *, op: str) -> PackLayout:
    """The layout of ``rows`` unpacked rows of ``row_len`` positions back to back, one segment each (no
    read, nothing to check). Example: 2 rows of 4 -> cu_seqlens_padded ``[0, 4, 8]``."""
    bounds = torch.arange(rows + 1, device=device) * row_len  # [B+1]
    return layout_from_boundaries(Boundaries(bounds, rows * row_len), op=op, validate=False, host_reads=False)


def packed_targets(target, pre_rolled: bool, layout: PackLayout, cp: process_groups.ParallelInfo, seq_len: int):
    """``(token [N], keep [N])`` for this rank's packed positions: the token each one scores and
    whether NeMo-RL's output holds it (offset ``s`` in its padded segment ``n``: ``s < min(n-1, S-1)``).

    Example (C 1): cu_seqlens_padded ``[0, 4, 12]``, S 6 -> keep ``[T,T,T,F, T,T,T,T,T,F,F,F]``
    (segment 1 is cut at ``S - 1 = 5`` positions); position 3 would score the next segment's token.
    """
    segments = layout.segments()  # the padded segments, every position valid (packed_layout)
    places = layout.local_places(cp.size, cp.rank)  # 2 x [N]
    offset = places.source - segments.bounds[places.segment]  # [N]
    keep = (offset + 1 < segments.lengths[places.segment]) & (offset + 1 < seq_len)  # [N]
    if pre_rolled:
        return target[0].to(torch.int64), keep  # [N] given on this rank's positions
    return next_token_at(target[0], segments, places, layout.total)[0], keep  # [N] the token at t + 1


def packed_logprobs(*, op: str, name: str, data: torch.Tensor, target: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                    total: int, seq_len: int, cp: process_groups.ParallelInfo, pre_rolled: bool, validate: bool, vocab: int,
                    score) -> tuple[torch.Tensor, PackLayout]:
    """The one body of NeMo-RL's packed log-prob functions, from logits or hidden states (``data``, named ``name``).

    Returns ``(packed [1, T], layout)``: position ``t`` (offset ``s`` in its padded segment ``n``) holds the log-prob
    of the token at ``t + 1`` for ``s < min(n - 1, seq_len - 1)``, else 0, on every CP rank. ``score(token [N], keep
    [N]) -> [N]`` is the kernel call on this rank's positions."""
    checks.check_logprob_target(target, pre_rolled, total // cp.size, total)
    layout_checks.boundary_args(name, data, total, cu_seqlens_padded, cp.size)
    checks.check_same_device(**{name: data, "target": target})
    layout = packed_layout(cu_seqlens_padded, total, cp, op=op, validate=validate)
    token, keep = packed_targets(target, pre_rolled, layout, cp, seq_len)  # [N] each
    values = out_of_vocab_as_nemo_rl(score(token, keep), in_vocab(token, vocab))  # [N]
    return gather_cp(values, layout, cp), layout  # [1, T]


def in_vocab(token: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N]`` bool: the target is a vocabulary id."""
    return (token >= 0) & (token < vocab)


def out_of_vocab_as_nemo_rl(values: torch.Tensor, token_in_vocab: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's result for a target outside the vocabulary: the value 0, the gradient ``-softmax`` of the row (the
    kernel's, passed through by ``v - v.detach()``).

    Example: ``values [-1.2, -3.4]``, ``token_in_vocab [True, False]`` -> ``[-1.2, 0.0]``."""
    return torch.where(token_in_vocab, values, values - values.detach())


def gather_cp(values: torch.Tensor, layout: PackLayout, cp: process_groups.ParallelInfo) -> torch.Tensor:
    """``[N, *]`` on each rank -> ``[1, T, *]`` along ``layout``: one all-gather; backward a reduce-scatter
    (NeMo-RL's ``C``-times gradient)."""
    if cp.size == 1:
        return values[None]
    return GatherFromContextParallel(cp.group, grad_mode="sum", validate=False, host_reads=False)(values[None], layout=layout)


def nemo_rl_rows(packed: torch.Tensor, layout: PackLayout, seq_len: int) -> torch.Tensor:
    """NeMo-RL's ``[B, S-1]`` rows from the packed values ``[1, T]`` (position ``start_b + s`` scoring token
    ``s + 1``): row ``b`` keeps ``min(n_b - 1, S - 1)`` values, 0 beyond. Example: segments ``[4, 8]``, S 6
    -> rows of 3 and 5 values."""
    cu = layout.cu_seqlens_padded
    lengths = (layout.lengths() - 1).clamp(0, seq_len - 1)  # [B] min(n_b - 1, S - 1): the padded segments
    return unpack_sequences(packed, lengths, cu, seq_len - 1, 0, validate=False, host_reads=False)  # [B, S-1]
