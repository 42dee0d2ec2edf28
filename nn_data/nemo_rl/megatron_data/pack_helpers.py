"""NeMo-RL's packing helpers on nn_data's ops: pack, unpack, pack parameters, seq-dim check.

Shape legend
    B   sequences; S padded row length; T packed tokens; C context-parallel size
    V   trailing feature dims of a model output (e.g. vocab)

Same names, signatures, defaults and return values as ``nemo_rl.models.megatron.data``; where NeMo-RL silently
produces wrong data these raise or are right instead (docs/nemo-rl.md, "Differences from NeMo-RL")."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from nn_data.layout import Boundaries, layout_from_boundaries, round_up
from nn_data.planning import Parallelism
from nn_data.extension import checks, megatron, unpack_sequences
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.dispatch import as_lengths, on_device, pack_microbatch
from nn_data.nemo_rl.megatron_data.options import PackOptions, nemo_rl_spec


def _pack_sequences_for_megatron(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual_seqs_to_multiple_of: int = 1,
    pad_packed_seq_to_multiple_of: int = 1,
    pad_packed_seq_to: Optional[int] = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    *,
    options: Optional[PackOptions] = None,
):
    """Pack ``input_ids [B, S]`` into THD ``[1, T]`` and take this rank's zigzag CP shard, with one host sync.

    Returns NeMo-RL's five values: ``(packed_input_ids [1, T], input_ids_cp_sharded [1, T/C], packed_seq_params,
    cu_seqlens [B+1] int32, cu_seqlens_padded [B+1] int32)``; with ``cp_size == 1`` the two id tensors are one.

    Args:
        input_ids: ``[B, S]`` token ids.
        seq_lengths: ``[B]`` ints (a tensor, list or array; non-integers are refused).
        pad_individual_seqs_to_multiple_of: each sequence starts at a multiple of this.
        pad_packed_seq_to_multiple_of: ``T`` is rounded up to this (the last sequence absorbs the slack).
        pad_packed_seq_to: a fixed ``T`` (a larger packed total raises: NeMo-RL truncates).
        cp_rank: this rank in the CP group.
        cp_size: CP size; with ``cp_size > 1`` each segment must be a multiple of ``2 * cp_size``.
        options: nn_data only: the compiled graph and ``T`` buckets (:class:`PackOptions`).

    Example: lengths ``[8, 5, 7]``, multiple 4 -> ``cu_seqlens [0, 8, 13, 20]``, ``cu_seqlens_padded [0, 8, 16, 24]``,
    max_seqlen 8.

    Raises :class:`~nn_data.errors.PackingError` for the cases above, a length outside ``[0, S]``, a multiple below 1,
    ``pad_packed_seq_to`` not a multiple of ``pad_packed_seq_to_multiple_of``, or ``cp_rank`` outside ``[0, cp_size)``."""
    options = options or PackOptions()
    spec = nemo_rl_spec(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of,
                        fixed_total=options.fixed_total(pad_packed_seq_to, "pad_packed_seq_to"), cp_rank=cp_rank,
                        cp_size=cp_size, name="pad_packed_seq_to")
    batch = pack_microbatch(input_ids, seq_lengths, spec=spec, cp_rank=cp_rank, options=options, extras={},
                            name="pad_packed_seq_to")
    layout = batch.layout
    params = megatron.make_packed_seq_params(layout.cu_seqlens_padded, layout.host.max_seqlen, layout.total // cp_size,
                                    total=layout.total)
    return batch.full["input_ids"], batch.local["input_ids"], params, layout.cu_seqlens, layout.cu_seqlens_padded


def _unpack_sequences_from_megatron(
    output_tensor: torch.Tensor,
    seq_lengths: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: Optional[torch.Tensor],
    original_batch_size: int,
    original_seq_length: int,
) -> torch.Tensor:
    """Unpack a (CP-gathered) model output ``[1, T, *]`` to ``[B, S, *]``: one gather, one validation sync.

    ``out[b, s] = output_tensor[0, cu_seqlens_padded[b] + s]`` for ``s < seq_lengths[b]``, 0 elsewhere. nn_data always
    uses the padded offsets (NeMo-RL reads ``cu_seqlens`` at CP 1: docs/nemo-rl.md, "Differences from NeMo-RL").

    Args:
        output_tensor: ``[1, T, *]`` (or ``[T]``), any trailing dims.
        seq_lengths: ``[B]`` ints.
        cu_seqlens: ``[B+1]`` unpadded offsets, used only when ``cu_seqlens_padded`` is None (they may end before T).
        cu_seqlens_padded: ``[B+1]`` offsets rising from 0 to ``T``.
        original_batch_size: ``B``.
        original_seq_length: ``S``.

    Example: output ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``, lengths ``[3, 0, 5]``, ``cu_seqlens_padded
    [0, 4, 4, 12]``, S 5 -> ``[[1, 2, 3, 0, 0], [0, 0, 0, 0, 0], [4, 5, 6, 7, 8]]``.

    Raises :class:`~nn_data.errors.PackingError` for non-integer lengths, not ``B`` of them, lengths on ``meta``, a length
    outside ``[0, S]`` or longer than its segment, or boundaries that do not rise from 0 to ``T``."""
    offsets = "padded" if cu_seqlens_padded is not None else "unpadded"
    bounds = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    if output_tensor.dim() == 1:
        output_tensor = output_tensor.unsqueeze(0)  # [T] -> [1, T]
    lengths = as_lengths(seq_lengths, original_batch_size, output_tensor.device, "output_tensor")
    checks.check_int_vector("cu_seqlens_padded" if offsets == "padded" else "cu_seqlens", bounds)
    bounds = on_device("cu_seqlens_padded" if offsets == "padded" else "cu_seqlens", bounds,
                       "output_tensor", output_tensor.device)
    checks.row_length("original_seq_length", original_seq_length)
    if offsets == "padded":
        return unpack_sequences(output_tensor, lengths, bounds, original_seq_length)
    # NeMo-RL's contract lets the unpadded offsets stand in: they may end before T (padding after the last
    # sequence); every other check is the same
    checks.check_packed("output_tensor", output_tensor)
    checks.check_boundaries_for("seq_lengths", lengths, "cu_seqlens", bounds)
    bounds = Boundaries(bounds, output_tensor.shape[1], seq_lengths=lengths, name="cu_seqlens",
                        total_from=" (T = output_tensor.shape[1])", valid_offsets=True)
    layout = layout_from_boundaries(bounds, op="_unpack_sequences_from_megatron", seq_len=original_seq_length)
    return layout.unpack(output_tensor, original_seq_length)


def _get_pack_sequence_parameters_for_megatron(
    megatron_cfg: Mapping[str, Any],
    pad_individual_seqs_to_multiple_of: int,
    max_seq_len_in_batch: int,
):
    """``(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, pad_packed_seq_to)`` for a Megatron config.

    The multiples are :class:`nn_data.planning.Parallelism`'s (docs/planning.md): the per-sequence multiple must be a
    multiple of ``2 * cp_size`` (CP > 1) times ``tp_size`` (TP > 1 with SP); the packed multiple adds FP8, FP4 or
    HybridEP's; ``pad_packed_seq_to`` is None unless PP > 1, then ``max_seq_len_in_batch`` rounded up to it.

    Args:
        megatron_cfg: NeMo-RL's ``megatron_cfg``.
        pad_individual_seqs_to_multiple_of: the per-sequence multiple.
        max_seq_len_in_batch: the step's longest bin.

    Example: TP 2 + SP, CP 2, FP8 blockwise, PP 2, multiple 8, max 1000 -> ``(8, 1024, 1024)``.

    Raises :class:`~nn_data.errors.PackingError` when the per-sequence multiple is not a multiple of the pad factor."""
    parallelism = Parallelism.from_megatron_cfg(
        megatron_cfg, make_sequence_length_divisible_by=pad_individual_seqs_to_multiple_of)
    pad_packed_seq_to_multiple_of = parallelism.packed_multiple
    pad_packed_seq_to = None
    if parallelism.pp > 1:
        pad_packed_seq_to = round_up(max_seq_len_in_batch, pad_packed_seq_to_multiple_of)
    return pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, pad_packed_seq_to


def get_and_validate_seqlen(data):
    """``(1, S)``: dim 1 is the sequence dim; every tensor of ``data`` with 2+ dims must share ``S``.

    Args:
        data: any mapping read as NeMo-RL reads it (``data["input_ids"]``, ``data.items()``).

    Raises :class:`~nn_data.errors.PackingError` with NeMo-RL's message (``Dim 1 must be the sequence dim, ...``) naming
    the key whose dim 1 differs; ``KeyError`` when there is no ``input_ids`` (as NeMo-RL)."""
    sequence_dim = 1
    try:
        input_ids = data["input_ids"]
    except KeyError:
        raise KeyError("'input_ids': get_and_validate_seqlen reads the sequence length from data['input_ids']") \
            from None
    seq_dim_size = input_ids.shape[sequence_dim]
    for key, value in data.items():
        if torch.is_tensor(value) and value.dim() > 1 and value.shape[sequence_dim] != seq_dim_size:
            raise PackingAssertionError(
                f"Dim 1 must be the sequence dim, expected dim 1={seq_dim_size} but got shape {value.shape} "
                f"for key {key} (input_ids.shape[1] = {seq_dim_size}; every tensor with 2+ dims must have "
                "the sequence along dim 1)"
            )
    return sequence_dim, seq_dim_size


__all__ = [
    "_get_pack_sequence_parameters_for_megatron",
    "_pack_sequences_for_megatron",
    "_unpack_sequences_from_megatron",
    "get_and_validate_seqlen",
]
