"""The self-packing (VLM) path: prepare ``[B, S]`` rows for a model that packs and CP-shards itself.

Shape legend
    B   sequences; S padded row length of the input
    P   ``padded_max``: the longest padded length, the columns handed to the model
    T   ``sum(padded lengths)``: the packed view's length"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nn_data.layout import PackSpec, layout_from_lengths
from nn_data.extension import checks, layout_checks, layout_from_read_lengths, megatron
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.dispatch import as_lengths


def _prepare_vlm_batch_for_megatron(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual_seqs_to_multiple_of: int,
    pad_full_seq_to: Optional[int] = None,
):
    """Prepare a ``[B, S]`` batch for a model that packs and CP-shards internally (mbridge VLMs); one host sync.

    Each length is rounded up to the multiple; with ``pad_full_seq_to`` the last sequence absorbs the deficit (a
    multiple of the per-sequence multiple). Returns ``(input_ids [1, T], input_ids_cp_sharded [B, P], attention_mask
    [B, P] bool, packed_seq_params, None, cu_seqlens_padded [B+1] int32)``; with ``B = 0``, empty rows and ``[0]``.

    Args:
        input_ids: ``[B, S]``.
        seq_lengths: ``[B]`` ints in ``[0, S]``.
        pad_individual_seqs_to_multiple_of: each length's multiple.
        pad_full_seq_to: the packed total the model's own packing must give (PP > 1).

    Example: lengths ``[3, 5]``, multiple 4, ``pad_full_seq_to=16`` -> padded ``[4, 8]``, deficit 4 -> ``[4, 12]``,
    ``P = 12``, ``cu_seqlens_padded [0, 4, 16]``.

    Raises :class:`~nn_data.errors.PackingError` (NeMo-RL's wording first) for a padded total above
    ``pad_full_seq_to``, a deficit not a multiple, a length outside ``[0, S]``, or ``pad_full_seq_to`` above int32."""
    checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    rows, cols = input_ids.shape[:2]
    m = max(1, int(pad_individual_seqs_to_multiple_of))
    layout_checks.fixed_total_arg("pad_full_seq_to", pad_full_seq_to)
    lengths = as_lengths(seq_lengths, rows, input_ids.device)
    if rows == 0:  # as NeMo-RL: the model packs nothing, so no slack either: [0] boundaries, no column
        cu_seqlens_padded = torch.zeros(1, dtype=torch.int32, device=input_ids.device)
        return (input_ids.new_zeros((1, 0)), input_ids[:, :0], torch.zeros(0, 0, dtype=torch.bool,
                device=input_ids.device), megatron.make_packed_seq_params(cu_seqlens_padded, 0, None), None, cu_seqlens_padded)
    layout = layout_from_lengths(lengths, cols, PackSpec(m), op="_prepare_vlm_batch_for_megatron")  # the one read
    if pad_full_seq_to is not None:  # the model pads every row itself: the slack must suit it (host ints)
        _check_deficit(layout.total, m, pad_full_seq_to)
        layout = layout_from_read_lengths(layout.host.lengths, lengths, cols, PackSpec(m, fixed_total=pad_full_seq_to))
    padded_max = layout.host.max_seqlen  # P: the model's columns
    if cols < padded_max:
        ids_2d = F.pad(input_ids, (0, padded_max - cols), value=0)  # [B, P]
    else:
        ids_2d = input_ids[:, :padded_max].contiguous()  # [B, P]; cut columns hold padding only
    cu_seqlens_padded = layout.cu_seqlens_padded  # [B+1]: each row's padded length, the slack on the last
    padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).to(torch.int64)  # [B]
    attention_mask = torch.arange(padded_max, device=input_ids.device)[None, :] < padded[:, None]  # [B, P]
    # The packed view holds exactly what the model packs: every row's first padded[b] columns, back to
    # back (the rows packed on the same layout with their padded lengths as lengths).
    whole = layout_from_read_lengths(layout.host.segments, padded, padded_max, PackSpec(fixed_total=layout.total),
                                     validate=False)  # segments [4, 12] (lengths [3, 5], m 4, T 16) -> lengths [4, 12]
    packed = whole.pack(ids_2d)  # [1, T]
    params = megatron.make_packed_seq_params(cu_seqlens_padded, padded_max, None)
    return packed, ids_2d, attention_mask, params, None, cu_seqlens_padded


def _check_deficit(natural: int, m: int, fixed_total: int) -> None:
    """The packed length must hold ``sum(round_up(L, m))`` and exceed it by a multiple of ``m`` (NeMo-RL's asserts).

    Example: lengths ``[3, 5]``, m 4: natural 12; ``pad_full_seq_to`` 16 passes, 8 and 14 are refused."""
    if natural > fixed_total:
        raise PackingAssertionError(
            f"pad_full_seq_to ({fixed_total}) < natural padded sum ({natural}); increase pad_full_seq_to to at least "
            f"{natural} (the packed total sum(round_up(seq_lengths, {m})) = {natural})")
    if (fixed_total - natural) % m:
        raise PackingAssertionError(
            f"pad_full_seq_to deficit ({fixed_total - natural}) must be a multiple of pad_individual_seqs_to_multiple_of "
            f"({m}) (the model pads every sequence to {m} itself, the last one included: choose pad_full_seq_to = "
            f"{natural} + a multiple of {m})")
