"""The NeMo-RL microbatch iterator over a dynamic-CP plan: one :class:`ProcessedMicrobatch` per round.

Each microbatch has NeMo-RL's fields for the round (``input_ids [1, c * tpr]``, ``input_ids_cp_sharded [1, tpr]``,
``position_ids``, ``cu_seqlens_padded [rows + 1]`` and ``packed_seq_params`` over the round's ``cp_group``),
``padding_mask`` and ``data_dict`` the block's rows; no host read per microbatch (docs/dynamic-cp.md)."""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.extension import megatron
from nn_data.nemo_rl.megatron_data.microbatch import ProcessedMicrobatch


def dynamic_cp_microbatch_iterator(data, cfg: dict, runner, plan, *, device) -> Tuple[Iterator[ProcessedMicrobatch],
                                                                                      int, int, int, int]:
    """``(iterator, rounds, 1, S, padded_seq_length)`` as :func:`get_microbatch_iterator` returns them, on ``device``;
    ``padded_seq_length`` is ``tokens_per_rank`` times the static CP size of ``cfg["megatron_cfg"]``.

    Raises :class:`PackingError` when the runner does not build ``PackedSeqParams`` or ``data`` does not hold the
    plan's sequences."""
    if not runner.make_packed_seq_params:
        raise PackingAssertionError("a dynamic-CP microbatch needs PackedSeqParams: build the runner with "
                                    "DynamicCPRunner(..., megatron.make_packed_seq_params=True)")
    if data.size != len(plan.lengths):
        raise PackingAssertionError(f"data holds {data.size} sequences but the plan was made for {len(plan.lengths)}; plan "
                                    "the global batch's lengths (data['input_lengths'])")
    target = device
    input_ids = data["input_ids"].to(target)
    step = runner.step(plan, input_ids)
    static_cp = int(((cfg or {}).get("megatron_cfg") or {}).get("context_parallel_size", 1))
    return _rounds(step, data, target), len(step), 1, input_ids.shape[1], plan.tokens_per_rank * static_cp


def _rounds(step, data, target) -> Iterator[ProcessedMicrobatch]:
    for k in range(len(step)):
        inputs = step.round(k)
        rows = data.select_indices(list(inputs.block.sequences)).to(target)
        cu_pad = rows_boundaries(inputs.packed.cu_seqlens_padded, len(inputs.block.sequences))
        total = inputs.block.size * step.plan.tokens_per_rank  # T = c * tpr
        params = megatron.make_packed_seq_params(cu_pad, total, step.plan.tokens_per_rank, total=total, cp_group=inputs.cp_group,
                                        local_cp_size=inputs.block.size)
        yield ProcessedMicrobatch(data_dict=rows, input_ids=inputs.packed_ids, input_ids_cp_sharded=inputs.input_ids,
                                  attention_mask=None, position_ids=inputs.position_ids, packed_seq_params=params,
                                  cu_seqlens_padded=cu_pad, padding_mask=inputs.packed.padding_mask)


def rows_boundaries(cu_seqlens_padded: torch.Tensor, rows: int) -> torch.Tensor:
    """NeMo-RL's ``[rows + 1]`` boundaries of a block's ``[Bc + 1]`` (a view); ``[T]`` for an empty block.

    Example: ``[0, 5, 16, 16, 16]``, 2 rows -> ``[0, 5, 16]``; 0 rows -> ``[16]``."""
    return cu_seqlens_padded[:rows + 1] if rows else cu_seqlens_padded[-1:]

