"""Tier: pure CPU, single process (a pool of one rank: every round one block of one rank; the rounds over
4 and 8 ranks run in tests/multiprocess/test_dynamic_cp_multiprocess.py).

get_microbatch_iterator(..., dynamic_cp=(runner, plan)): one NeMo-RL microbatch per round of a dynamic-CP plan.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.dynamic_cp import DynamicCPRunner, dynamic_cp_groups
from nn_data.errors import PackingError
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import ProcessedMicrobatch, get_microbatch_iterator
from nn_data.planning import Parallelism, plan_step_dynamic_cp
from nn_data.testing.coded import coded_batch
from tests.support.megatron_config import megatron_cfg

LENGTHS, S, TPR = [5, 9, 3, 4, 6, 1, 0, 12], 12, 16


def _cfg():
    return {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
            "megatron_cfg": megatron_cfg(cp=1), "make_sequence_length_divisible_by": 1}


def test_the_iterator_yields_every_round_with_neMo_rl_fields():
    ids = coded_batch(LENGTHS, S)
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(LENGTHS))
    plan = plan_step_dynamic_cp(LENGTHS, Parallelism(dp=1), tokens_per_rank=TPR)
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=TPR, row_capacity=4, make_packed_seq_params=True)
    iterator, count, mbs, seq_dim, padded = get_microbatch_iterator(data, _cfg(), 1, None, dynamic_cp=(runner, plan))
    assert (count, mbs, seq_dim, padded) == (plan.rounds_per_rank, 1, S, TPR)
    seen = []
    with HostSyncCounter() as syncs:
        microbatches = list(iterator)
    assert syncs.count == 0, syncs.calls
    assert len(microbatches) == count
    for mb, blocks in zip(microbatches, plan.rounds):
        (block,) = blocks
        assert isinstance(mb, ProcessedMicrobatch)
        assert mb.input_ids.shape == mb.input_ids_cp_sharded.shape == mb.position_ids.shape == (1, TPR)
        assert torch.equal(mb.data_dict["input_lengths"], torch.tensor([LENGTHS[i] for i in block.sequences]))
        assert mb.packed_seq_params.local_cp_size == 1 and mb.packed_seq_params.cp_group is None
        starts = mb.cu_seqlens_padded.tolist()
        for row, i in enumerate(block.sequences):  # each sequence's tokens where its segment starts
            n = LENGTHS[i]
            assert torch.equal(mb.input_ids_cp_sharded[0, starts[row]:starts[row] + n], ids[i, :n])
            assert torch.equal(mb.position_ids[0, starts[row]:starts[row] + n], torch.arange(n))
        seen += list(block.sequences)
    assert sorted(seen) == list(range(len(LENGTHS)))


def test_the_iterator_refuses_a_runner_without_packed_seq_params_and_foreign_data():
    data = BatchedDataDict(input_ids=coded_batch(LENGTHS, S), input_lengths=torch.tensor(LENGTHS))
    plan = plan_step_dynamic_cp(LENGTHS, Parallelism(dp=1), tokens_per_rank=TPR)
    bare = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=TPR)
    with pytest.raises(PackingError, match=r"needs PackedSeqParams: build the runner with .*make_packed_seq_params"):
        get_microbatch_iterator(data, _cfg(), 1, None, dynamic_cp=(bare, plan))
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=TPR, make_packed_seq_params=True)
    other = plan_step_dynamic_cp(LENGTHS[:3], Parallelism(dp=1), tokens_per_rank=TPR)
    with pytest.raises(PackingError, match=r"data holds 8 sequences but the plan was made for 3"):
        get_microbatch_iterator(data, _cfg(), 1, None, dynamic_cp=(runner, other))


def test_each_microbatch_is_the_record_process_microbatch_makes_of_its_rows():
    """NeMo-RL's record: ``cu_seqlens_padded`` and ``PackedSeqParams.cu_seqlens_q`` hold rows + 1
    boundaries (not ``row_capacity + 1``), ``padding_mask`` is passed on, all as ``process_microbatch``
    gives them for the microbatch's ``data_dict``; so NeMo-RL's packed log-prob function (nn_data's drop-in
    of it: no NeMo-RL source here) returns one row per ``data_dict`` row, its reference's values."""
    from nn_data.nemo_rl.megatron_data import process_microbatch
    from nn_data.nemo_rl.model_utils import from_parallel_logits_to_logprobs_packed_sequences
    from nn_data.testing.nemo_reference import reference_packed_logprobs, reference_roll_per_segment

    lengths = [5, 9, 3, 4, 6, 1, 0, 12, 2]
    data = BatchedDataDict(input_ids=coded_batch(lengths, S), input_lengths=torch.tensor(lengths))
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=1), tokens_per_rank=TPR)
    runner = DynamicCPRunner(dynamic_cp_groups(), tokens_per_rank=TPR, row_capacity=8, make_packed_seq_params=True)
    iterator, *_ = get_microbatch_iterator(data, _cfg(), 1, None, dynamic_cp=(runner, plan))
    gen = torch.Generator().manual_seed(0)
    for mb, (block,) in zip(iterator, plan.rounds):
        rows = len(block.sequences)
        want = process_microbatch(mb.data_dict, seq_length_key="input_lengths", pad_full_seq_to=TPR,
                                  pack_sequences=True, pad_individual_seqs_to_multiple_of=plan.sequence_multiples[1])
        assert mb.cu_seqlens_padded.shape == (rows + 1,) and torch.equal(mb.cu_seqlens_padded, want.cu_seqlens_padded)
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert torch.equal(getattr(mb.packed_seq_params, field), getattr(want.packed_seq_params, field)), field
        assert mb.padding_mask is not None and torch.equal(mb.padding_mask, want.padding_mask)
        assert torch.equal(mb.input_ids, want.input_ids)
        logits = torch.randn(1, TPR, 11, generator=gen, dtype=torch.float64)
        target = mb.input_ids % 11
        out = from_parallel_logits_to_logprobs_packed_sequences(logits, target, mb.cu_seqlens_padded, S, 0, 11, None)
        assert out.shape == (rows, S - 1)  # one row per data_dict row (8 = row_capacity before)
        ref = reference_packed_logprobs(logits, reference_roll_per_segment(target, mb.cu_seqlens_padded),
                                        mb.cu_seqlens_padded, S)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
