"""Tier: pure CPU, single process (plus one fresh interpreter for the import check).

The public surface of nn_data.nemo_rl.megatron_data: every name of NeMo-RL's API page with the same
parameters and defaults (extra nn_data parameters only as optional keyword-only ones), the
dataclass fields, and imports that stay free of megatron-core.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import nn_data.nemo_rl.megatron_data as md

E = inspect.Parameter.empty
# Arguments NeMo-RL's HEAD added after the API page was taken, in HEAD's order.
HEAD_ARGS = [("delegate_mtp_loss_mask_to_model", False), ("model_slices_context_parallel_inputs", False)]
# (name, default) of every positional-or-keyword / keyword-only parameter on NeMo-RL's API page.
API = {
    "make_processed_microbatch_iterator": [
        ("raw_iterator", E), ("cfg", E), ("seq_length_key", E), ("pad_individual_seqs_to_multiple_of", E),
        ("pad_packed_seq_to_multiple_of", E), ("straggler_timer", E), ("pad_full_seq_to", E),
        ("delegate_pack_to_model", False), *HEAD_ARGS],
    "get_microbatch_iterator": [("data", E), ("cfg", E), ("mbs", E), ("straggler_timer", E),
                                ("seq_length_key", None), ("delegate_pack_to_model", False), *HEAD_ARGS],
    "get_ltor_masks_and_position_ids": [("args", E), ("kwargs", E)],
    "process_microbatch": [
        ("data_dict", E), ("seq_length_key", None), ("pad_individual_seqs_to_multiple_of", 1),
        ("pad_packed_seq_to_multiple_of", 1), ("pad_full_seq_to", None), ("pack_sequences", False),
        ("delegate_pack_to_model", False), *HEAD_ARGS, ("straggler_timer", None)],
    "_make_r3_trace_token_identity": [("input_ids", E), ("seq_lengths", None)],
    "_verify_r3_trace_cp_token_alignment": [
        ("source_input_ids", E), ("source_routed_experts", E), ("input_ids_cp_sharded", E),
        ("routed_experts_cp_sharded", E), ("token_identity_cp_sharded", E)],
    "_fill_routed_experts_padding": [("routed_experts", E), ("seq_lengths", E)],
    "process_global_batch": [("data", E), ("loss_fn", E), ("dp_group", E), ("batch_idx", E), ("batch_size", E)],
    "_prepare_vlm_batch_for_megatron": [("input_ids", E), ("seq_lengths", E),
                                        ("pad_individual_seqs_to_multiple_of", E), ("pad_full_seq_to", None)],
    "_pack_sequences_for_megatron": [
        ("input_ids", E), ("seq_lengths", E), ("pad_individual_seqs_to_multiple_of", 1),
        ("pad_packed_seq_to_multiple_of", 1), ("pad_packed_seq_to", None), ("cp_rank", 0), ("cp_size", 1)],
    "_shard_routed_experts_for_cp": [("routed_experts", E), ("token_identity", E), ("seq_lengths", E),
                                     ("cu_seqlens", E), ("cu_seqlens_padded", E), ("cp_rank", E), ("cp_size", E)],
    "_get_pack_sequence_parameters_for_megatron": [("megatron_cfg", E), ("pad_individual_seqs_to_multiple_of", E),
                                                   ("max_seq_len_in_batch", E)],
    "_unpack_sequences_from_megatron": [("output_tensor", E), ("seq_lengths", E), ("cu_seqlens", E),
                                        ("cu_seqlens_padded", E), ("original_batch_size", E),
                                        ("original_seq_length", E)],
    "get_and_validate_seqlen": [("data", E)],
}
KEYWORD_ONLY = {"_verify_r3_trace_cp_token_alignment": 5, "process_global_batch": 2}  # NeMo-RL's own '*'
FIELDS = ["input_ids", "input_ids_cp_sharded", "attention_mask", "position_ids", "packed_seq_params",
          "cu_seqlens_padded", "mtp_loss_mask", "routed_experts", "routed_experts_cp_sharded",
          "media_token_validity_mask"]


@pytest.mark.parametrize("name", sorted(API))
def test_signature_matches_the_api_page(name):
    params = list(inspect.signature(getattr(md, name)).parameters.values())
    ours = [(p.name, p.default) for p in params[: len(API[name])]]
    assert ours == API[name]
    kw_only = [p.name for p in params[: len(API[name])] if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(kw_only) == KEYWORD_ONLY.get(name, 0)
    for extra in params[len(API[name]):]:  # nn_data additions: optional and keyword-only, so old calls work
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not E


NN_DATA_FIELDS = ["padding_mask", "shared_prefix"]  # nn_data's additions, after NeMo-RL's fields, default None


def test_dataclass_fields_and_defaults():
    inputs = dataclasses.fields(md.ProcessedInputs)
    assert [f.name for f in inputs] == FIELDS + NN_DATA_FIELDS
    assert [f.name for f in inputs if f.default is None] == FIELDS[6:] + NN_DATA_FIELDS
    assert [f.name for f in dataclasses.fields(md.ProcessedMicrobatch)] == ["data_dict", *FIELDS, *NN_DATA_FIELDS]
    assert set(md.__all__) >= set(API) | {"ProcessedInputs", "ProcessedMicrobatch", "get_context_parallel_rank",
                                          "get_context_parallel_world_size", "get_packed_seq_cp_partition_indices"}


def test_importing_the_layer_does_not_import_megatron_core():
    code = ("import sys, nn_data, nn_data.nemo_rl.megatron_data, nn_data.nemo_rl.batched_data_dict; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
