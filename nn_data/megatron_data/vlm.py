"""The self-packing (VLM) path: prepare ``[B, S]`` rows for a model that packs and CP-shards itself.

Shape legend
    B   sequences; S padded row length of the input
    P   ``padded_max``: the longest padded length, the columns handed to the model
    T   ``sum(padded lengths)``: the packed view's length
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nn_data._index import exclusive_cumsum, round_up
from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.megatron_data.common import require
from nn_data.megatron_parallel import make_packed_seq_params
from nn_data.megatron_data.engine import as_lengths
from nn_data.pack import PackSequences


def _prepare_vlm_batch_for_megatron(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual_seqs_to_multiple_of: int,
    pad_full_seq_to: Optional[int] = None,
):
    """Prepare a ``[B, S]`` batch for a model that packs and CP-shards internally (mbridge VLMs).

    Each length is rounded up to ``pad_individual_seqs_to_multiple_of``; with
    ``pad_full_seq_to`` (PP > 1) the last sequence's length is extended by the deficit
    ``pad_full_seq_to - sum(padded)`` so the model's own packing always gives that total
    (the extra positions count as valid for the model; mask them at the loss).

    Returns ``(input_ids [1, T], input_ids_cp_sharded [B, P], attention_mask [B, P] bool,
    packed_seq_params, None, cu_seqlens_padded [B+1] int32)``: the packed view (each
    row's first ``padded[b]`` columns, back to back), the rows for the model cut or
    zero-padded to ``P = max(padded)`` columns, ``True`` on each row's first ``padded[b]``
    positions, a THD ``PackedSeqParams`` over ``cu_seqlens_padded`` with max length ``P``,
    and ``cu_seqlens_padded = [0, cumsum(padded)]``.

    Example: lengths ``[3, 5]``, multiple 4, ``pad_full_seq_to=16`` -> padded ``[4, 8]``,
    deficit 4 -> ``[4, 12]``, ``P = 12``, ``cu_seqlens_padded [0, 4, 16]``.

    One host sync (NeMo-RL: one too). Raises :class:`~nn_data.errors.PackingError` when the padded total exceeds
    ``pad_full_seq_to``, the deficit is not a multiple of the per-sequence multiple, or a
    length is outside ``[0, S]`` (NeMo-RL reads zeros past the row there).
    """
    _checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    _checks.check_int32("pad_full_seq_to", pad_full_seq_to)
    rows, cols = input_ids.shape[:2]
    align = max(1, int(pad_individual_seqs_to_multiple_of))
    lengths = as_lengths(seq_lengths, rows, input_ids.device)
    padded, padded_max, total = _padded_lengths(lengths, cols, align, pad_full_seq_to)
    if cols < padded_max:
        ids_2d = F.pad(input_ids, (0, padded_max - cols), value=0)  # [B, P]
    else:
        ids_2d = input_ids[:, :padded_max].contiguous()  # [B, P]; cut columns hold padding only
    attention_mask = torch.arange(padded_max, device=input_ids.device)[None, :] < padded[:, None]  # [B, P]
    cu_seqlens_padded = exclusive_cumsum(padded).to(torch.int32)  # [B+1]
    if total:
        # Lengths = padded lengths: the packed view holds exactly what the model packs.
        packed = PackSequences(pad_full_seq_to=total, validate=False)(ids_2d, padded).packed  # [1, T]
    else:
        packed = ids_2d.new_zeros((1, 0))
    params = make_packed_seq_params(cu_seqlens_padded, padded_max, None)
    return packed, ids_2d, attention_mask, params, None, cu_seqlens_padded


def _padded_lengths(lengths, cols: int, align: int, pad_full_seq_to):
    """``(padded [B], P, T)`` after the deficit rule; one host sync.

    Example: lengths ``[3, 5]``, align 4, target 16 -> natural ``[4, 8]`` (12), deficit 4 ->
    ``([4, 12], 12, 16)``.
    """
    padded = round_up(lengths, align)  # [B]
    if lengths.shape[0] == 0:
        return padded, 0, 0
    lo, hi, natural, pmax, plast = torch.stack(
        [lengths.min(), lengths.max(), padded.sum(), padded.max(), padded[-1]]).tolist()  # sync: P and T are shapes
    if lo < 0 or hi > cols:
        _checks.raise_length_outside((lengths < 0) | (lengths > cols), lengths, cols)
    deficit = 0
    if pad_full_seq_to is not None:
        deficit = pad_full_seq_to - natural
        require(deficit >= 0, f"pad_full_seq_to ({pad_full_seq_to}) < natural padded sum ({natural}); "
                              f"increase pad_full_seq_to to at least {natural}")
        require(deficit % align == 0, f"pad_full_seq_to deficit ({deficit}) must be a multiple of "
                                      f"pad_individual_seqs_to_multiple_of ({align})")
    elif natural > _checks.INT32_MAX:
        raise PackingError(_checks.int32_limit(f"the padded total sum(round_up(seq_lengths, {align})) = {natural}"))
    if deficit:
        padded = torch.cat([padded[:-1], padded[-1:] + deficit])  # the last sequence absorbs it
    return padded, max(pmax, plast + deficit), natural + deficit
