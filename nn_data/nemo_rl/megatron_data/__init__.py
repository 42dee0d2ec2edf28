"""NeMo-RL's ``nemo_rl.models.megatron.data`` on nn_data's ops: switch by changing one import.

    # from nemo_rl.models.megatron.data import process_microbatch, get_microbatch_iterator
    from nn_data.nemo_rl.megatron_data import process_microbatch, get_microbatch_iterator

Every name of NeMo-RL's API page is here with the same signature, defaults and return values, plus the names
NeMo-RL's module binds (``get_context_parallel_rank``, ``get_context_parallel_world_size``,
``get_packed_seq_cp_partition_indices``). The functions call each other through this module's names at call
time, so ``mock.patch("nn_data.nemo_rl.megatron_data.X")`` reaches the call as in NeMo-RL. Errors are
:class:`~nn_data.nemo_rl.assertions.PackingAssertionError` (also an ``AssertionError``); every difference:
docs/nemo-rl.md, "Differences from NeMo-RL"."""

from __future__ import annotations

from nn_data.nemo_rl.megatron_data.common import get_context_parallel_rank, get_context_parallel_world_size
from nn_data.nemo_rl.megatron_data.options import PackOptions
from nn_data.nemo_rl.megatron_data.iterators import (
    get_microbatch_iterator,
    make_processed_microbatch_iterator,
    process_global_batch,
)
from nn_data.nemo_rl.megatron_data.microbatch import (
    ProcessedInputs,
    ProcessedMicrobatch,
    _prepare_vlm_batch_for_megatron,
    get_ltor_masks_and_position_ids,
    process_microbatch,
)
from nn_data.nemo_rl.megatron_data.pack_helpers import (
    _get_pack_sequence_parameters_for_megatron,
    _pack_sequences_for_megatron,
    _unpack_sequences_from_megatron,
    get_and_validate_seqlen,
)
from nn_data.nemo_rl.megatron_data.packed import get_packed_seq_cp_partition_indices
from nn_data.nemo_rl.megatron_data.r3 import (
    _fill_routed_experts_padding,
    _make_r3_trace_token_identity,
    _shard_routed_experts_for_cp,
    _verify_r3_trace_cp_token_alignment,
)
from nn_data.nemo_rl.assertions import translate_errors

__all__ = [
    "PackOptions",
    "ProcessedInputs",
    "ProcessedMicrobatch",
    "_fill_routed_experts_padding",
    "_get_pack_sequence_parameters_for_megatron",
    "_make_r3_trace_token_identity",
    "_pack_sequences_for_megatron",
    "_prepare_vlm_batch_for_megatron",
    "_shard_routed_experts_for_cp",
    "_unpack_sequences_from_megatron",
    "_verify_r3_trace_cp_token_alignment",
    "get_and_validate_seqlen",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_ltor_masks_and_position_ids",
    "get_microbatch_iterator",
    "get_packed_seq_cp_partition_indices",
    "make_processed_microbatch_iterator",
    "process_global_batch",
    "process_microbatch",
]

translate_errors(globals())  # the core's PackingError leaves as PackingAssertionError (nn_data.nemo_rl.assertions)
