"""Tier: CPU multi-process over gloo (torch.multiprocessing spawn, 127.0.0.1, a free port).

Two CPU processes over gloo: process_microbatch takes CP rank and size from megatron-core's
initialised parallel_state (CP 2), the two shards gather back to the packed tensor, and
process_global_batch all-reduces its normalisers over a gloo group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nn_data.testing.dist import free_port, init_gloo

WORLD = 2


def _worker(rank: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    init_gloo(rank, WORLD, port)
    try:
        _check_cp_from_parallel_state(rank)
        _check_global_batch_all_reduce(rank)
    finally:
        dist.destroy_process_group()


def _check_cp_from_parallel_state(rank: int) -> None:
    from megatron.core import parallel_state

    from nn_data import UnshardFromContextParallel
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.nemo_rl.megatron_data.common import megatron_cp_rank_and_size as cp_rank_and_size
    from nn_data.nemo_rl.megatron_data import process_microbatch
    from nn_data.testing.coded import coded_batch
    from nn_data.testing.reference import reference_pack, reference_shard

    assert cp_rank_and_size() == (0, 1)  # distributed, but no CP group yet: a single CP rank
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD, create_gloo_process_groups=False)
    try:
        assert cp_rank_and_size() == (rank, WORLD)
        lengths = [16, 16]
        data = BatchedDataDict(input_ids=coded_batch(lengths, 16), input_lengths=torch.tensor(lengths),
                               routed_experts=coded_batch(lengths, 16, (2, 3)))
        out = process_microbatch(data, "input_lengths", 4, 1, 40, pack_sequences=True)
        ref = reference_pack(data["input_ids"], lengths, 4, 1, 40)
        assert torch.equal(out.input_ids_cp_sharded, reference_shard(ref.packed, ref.cu_seqlens_padded, WORLD, rank))
        shards = [torch.empty_like(out.input_ids_cp_sharded) for _ in range(WORLD)]
        dist.all_gather(shards, out.input_ids_cp_sharded, group=parallel_state.get_context_parallel_group())
        restored = UnshardFromContextParallel(WORLD)(torch.cat(shards), out.cu_seqlens_padded)
        assert torch.equal(restored, out.input_ids) and torch.equal(restored, ref.packed)
        routes = [torch.empty_like(out.routed_experts_cp_sharded) for _ in range(WORLD)]
        dist.all_gather(routes, out.routed_experts_cp_sharded, group=parallel_state.get_context_parallel_group())
        assert torch.equal(UnshardFromContextParallel(WORLD)(torch.cat(routes), out.cu_seqlens_padded),
                           out.routed_experts)
    finally:
        parallel_state.destroy_model_parallel()


def _check_global_batch_all_reduce(rank: int) -> None:
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.nemo_rl.megatron_data import process_global_batch

    sample_mask = torch.tensor([1.0, 0.0, 1.0, 1.0]) if rank == 0 else torch.tensor([1.0, 1.0, 1.0, 0.0])
    token_mask = torch.ones(4, 6)
    data = BatchedDataDict(input_ids=torch.zeros(4, 6, dtype=torch.long), sample_mask=sample_mask,
                           token_mask=token_mask)
    out = process_global_batch(data, object(), dist.group.WORLD, batch_idx=0, batch_size=4)
    assert out["global_valid_seqs"].item() == 3.0 + 3.0
    assert out["global_valid_toks"].item() == 6 * 5  # six valid sequences, 5 tokens each after the shift
    assert out["global_valid_seqs"].device.type == "cpu"


def test_cp_from_parallel_state_and_global_batch_over_gloo():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
