"""Tier: pure CPU, one process.

The NeMo-RL layer's path, measured: from ``process_microbatch`` to the executor that moves the data,
how many frames and which record types are on the stack (docs/nemo-rl.md, "The path to the
executor"), and how many host syncs a NeMo-RL round trip (``process_microbatch`` -> a model ->
``from_parallel_logits_to_logprobs_packed_sequences``, defaults) costs.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.layout import host
from nn_data.nemo_rl import model_utils
from nn_data.nemo_rl import megatron_data as md
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.testing.coded import coded_batch

LENGTHS, S, M, FULL = [5, 3, 8], 8, 4, 24


def _batch():
    ids = coded_batch(LENGTHS, S)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(LENGTHS),
                           mtp_loss_mask=(ids % 3 != 0).float(), routed_experts=coded_batch(LENGTHS, S, (2, 3)))


def _is_record(value) -> bool:
    """An instance of a NamedTuple or dataclass defined in nn_data (not a tensor, dict or int)."""
    cls = type(value)
    ours = cls.__module__.startswith("nn_data")
    return ours and (dataclasses.is_dataclass(value) or (issubclass(cls, tuple) and hasattr(cls, "_fields")))


def _stack_at_the_executor(monkeypatch):
    """For each call of the host executor's pack, the frames from process_microbatch (inclusive) down to
    it (exclusive), outermost first, as ``(function name, record types among its locals then)``."""
    seen = []
    real = host.HostExecutor.pack

    def recording(*args, **kwargs):
        frames = [f.frame for f in inspect.stack()[1:]]
        top = [f.f_code.co_name for f in frames].index("process_microbatch")
        seen.append([(f.f_code.co_name, {type(v).__name__ for v in f.f_locals.values() if _is_record(v)})
                     for f in frames[: top + 1][::-1]])
        return real(*args, **kwargs)

    monkeypatch.setattr(host.HostExecutor, "pack", recording)
    md.process_microbatch(_batch(), "input_lengths", M, 1, FULL, pack_sequences=True)
    return seen


def test_the_path_from_process_microbatch_to_the_executor_is_at_most_five_frames(monkeypatch):
    stacks = _stack_at_the_executor(monkeypatch)
    assert len(stacks) == 3  # the ids, the MTP mask and the routes: three tensors, one layout
    names = [name for name, _ in stacks[0]]
    assert names == ["process_microbatch", "packed_inputs", "pack_microbatch", "pack_shard", "pack"], names
    assert len(names) <= 5


def test_at_most_three_record_types_travel_down_to_the_executor(monkeypatch):
    types = {t for stack in _stack_at_the_executor(monkeypatch) for _, kinds in stack for t in kinds}
    assert types <= {"PackOptions", "DropInSpec", "PackLayout"}, types
    assert len(types) <= 3


@pytest.mark.parametrize("validate, syncs", [(True, 2), (False, 1)])
def test_a_nemo_rl_round_trip_costs_the_documented_host_syncs(validate, syncs):
    """process_microbatch reads the lengths once (T, max_seqlen, the checks); the packed log-prob function
    reads the boundaries once more to validate them (its default), else nothing."""
    vocab = 64
    data = _batch()
    md.process_microbatch(data, "input_lengths", M, 1, FULL, pack_sequences=True)  # PackedSeqParams imported
    head = torch.nn.Embedding(vocab, vocab, dtype=torch.float64)  # a stand-in model: ids -> logits
    with HostSyncCounter() as counter:
        out = md.process_microbatch(data, "input_lengths", M, 1, FULL, pack_sequences=True)
        logits = head(out.input_ids_cp_sharded % vocab)  # [1, T, V]
        logprobs = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
            logits, out.input_ids % vocab, out.cu_seqlens_padded, S, 0, vocab, None, validate=validate)
    assert counter.count == syncs, counter.calls
    assert logprobs.shape == (len(LENGTHS), S - 1)
