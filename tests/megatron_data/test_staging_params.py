"""Tier: pure CPU, single process (both CI jobs: megatron-core 0.16 and 0.19).

StagedMicrobatch's megatron-core ``PackedSeqParams``: made once, its boundary tensors are the staged
buffers (the same objects on every microbatch), ``max_seqlen`` fixed at T, and where the release has
``seq_idx`` (0.17 and newer) it is refreshed in place to megatron-core's own value for each microbatch.
"""

from __future__ import annotations

import torch

from nn_data import PackedForward
from nn_data.megatron_parallel import packed_seq_params_class, packed_seq_params_fields
from nn_data.staging import StagedMicrobatch
from nn_data.testing.coded import coded_batch


def _probe(input_ids, position_ids, packed):
    return input_ids[..., None].float()


def test_staged_packed_seq_params_are_the_buffers_with_max_seqlen_fixed():
    packing = PackedForward(_probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=32, row_capacity=4,
                            make_packed_seq_params=True)
    stage = StagedMicrobatch(packing, 10)
    params = stage.info.packed_seq_params
    seq_idx = getattr(params, "seq_idx", None)
    for lengths in ([3, 0, 9], [10, 10, 4], [], [1]):
        stage.load(coded_batch(lengths, 10), torch.tensor(lengths, dtype=torch.int64)).prepare()
        assert stage.info.packed_seq_params is params
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert getattr(params, field) is stage.cu_seqlens_padded, field
        assert params.max_seqlen_q == params.max_seqlen_kv == 32 and params.qkv_format == "thd"
        if "seq_idx" in packed_seq_params_fields():  # megatron-core's own __post_init__ as the oracle
            assert params.seq_idx is seq_idx
            own = packed_seq_params_class()(qkv_format="thd", cu_seqlens_q=stage.cu_seqlens_padded.clone(),
                                            cu_seqlens_kv=stage.cu_seqlens_padded.clone(), max_seqlen_q=32,
                                            max_seqlen_kv=32, total_tokens=32)
            assert torch.equal(params.seq_idx, own.seq_idx), lengths
