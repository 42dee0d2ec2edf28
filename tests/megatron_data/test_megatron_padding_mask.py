"""Tier: pure CPU, single process (CP ranks simulated by patching the CP getters NeMo-RL's module binds;
the pg_collection path under real CP groups is tests/multiprocess/test_pg_collection_multiprocess.py).
The oracle is the loop reference (``nn_data.testing.reference.reference_padding_mask``).

The compat layer's ``padding_mask`` (nn_data's field of ``ProcessedInputs`` / ``ProcessedMicrobatch``):
True exactly at the padding of the model's ids (this CP rank's ``[1, T/C]``, the full ``[1, T]`` when
the model slices CP itself), on the one-call path and compiled; no
extra host sync; None where nothing is packed.
"""

from __future__ import annotations


import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.diagnostics import HostSyncCounter
from nn_data.nemo_rl import megatron_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import PackOptions, get_microbatch_iterator, process_microbatch
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_padding_mask

LENGTHS, S = [12, 3, 0, 8, 1], 12


def _batch(lengths=LENGTHS):
    return BatchedDataDict(input_ids=coded_batch(lengths, S), input_lengths=torch.tensor(lengths, dtype=torch.int64))


@pytest.fixture
def cp(monkeypatch):
    def set_rank(rank, size=2):  # NeMo-RL's patch points: the module-level CP getters
        monkeypatch.setattr(megatron_data, "get_context_parallel_rank", lambda: rank)
        monkeypatch.setattr(megatron_data, "get_context_parallel_world_size", lambda: size)
    return set_rank


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_microbatch_carries_this_ranks_padding_mask(cp, rank):
    cp(rank)
    with HostSyncCounter() as syncs:
        out = process_microbatch(_batch(), "input_lengths", 4, 1, 48, pack_sequences=True)
    assert syncs.count == 1, syncs.calls  # the layout's one read of the lengths, as without the mask
    want = reference_padding_mask(LENGTHS, 4, 1, 48, 2, rank)
    assert out.padding_mask.dtype == torch.bool and out.padding_mask.shape == out.input_ids_cp_sharded.shape
    assert torch.equal(out.padding_mask, want)
    assert not (out.input_ids_cp_sharded[~out.padding_mask] == 0).any()  # every real token is marked real


def test_no_fixed_length_and_a_microbatch_of_no_sequence():
    out = process_microbatch(_batch(), "input_lengths", 1, 8, None, pack_sequences=True)
    assert torch.equal(out.padding_mask, reference_padding_mask(LENGTHS, 1, 8, None))
    empty = process_microbatch(_batch([]), "input_lengths", 4, 1, 16, pack_sequences=True)
    assert empty.padding_mask.tolist() == [[True] * 16]


def test_a_model_that_slices_cp_itself_gets_the_full_row(cp):
    cp(1)
    out = process_microbatch(_batch(), "input_lengths", 4, 1, 48, pack_sequences=True,
                             model_slices_context_parallel_inputs=True)
    assert out.padding_mask.shape == out.input_ids_cp_sharded.shape == (1, 48)
    assert torch.equal(out.padding_mask, reference_padding_mask(LENGTHS, 4, 1, 48))


def test_compiled_gives_the_same_mask(cp):
    cp(1)
    want = reference_padding_mask(LENGTHS, 4, 1, 48, 2, 1)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = process_microbatch(_batch(), "input_lengths", 4, 1, 48, pack_sequences=True,
                                  options=PackOptions(compile=True, backend=counter))
    assert counter.frame_count == 1 and torch.equal(compiled.padding_mask, want)


def test_unpacked_microbatches_have_none():
    out = process_microbatch(_batch(), "input_lengths", pack_sequences=False)
    assert out.padding_mask is None


def test_the_iterator_yields_it():
    data = _batch()
    planned, _ = data.plan_sequence_packing(16, sequence_length_pad_multiple=4)
    cfg = {"sequence_packing": {"enabled": True}, "make_sequence_length_divisible_by": 4,
           "megatron_cfg": {"tensor_model_parallel_size": 1, "sequence_parallel": False,
                            "pipeline_model_parallel_size": 2, "context_parallel_size": 1}}
    it, *_ = get_microbatch_iterator(planned, cfg, 1, None)
    for mb, (start, end) in zip(it, planned.micro_batch_indices[0]):
        lengths = planned["input_lengths"][start:end].tolist()
        assert torch.equal(mb.padding_mask, reference_padding_mask(lengths, 4, 1, mb.input_ids.shape[1]))
