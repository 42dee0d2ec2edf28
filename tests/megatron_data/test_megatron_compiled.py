"""Tier: pure CPU, single process, torch.compile (inductor). Compiles are counted with
CompileCounterWithBackend; the dynamo cache is reset around the module.

The compiled switch of the pack path: a stream of microbatches with different lengths, row
counts and row lengths compiles once (pad_full_seq_to + row capacity) and equals eager exactly;
without pad_full_seq_to, T buckets bound the compiles by the number of buckets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from nn_data.nemo_rl import megatron_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import PackOptions, get_microbatch_iterator, process_microbatch
from nn_data.nemo_rl.megatron_data.graph import reset_compiled
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_pack
from nn_data.diagnostics import HostSyncCounter
from tests.support.megatron_config import megatron_cfg

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def fresh_dynamo():
    torch._dynamo.reset()
    reset_compiled()
    yield
    torch._dynamo.reset()
    reset_compiled()


def _stream(n, seed, max_rows, max_len):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        rows = int(torch.randint(1, max_rows + 1, (1,), generator=gen))
        seq_len = int(torch.randint(8, max_len + 1, (1,), generator=gen))
        lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen).tolist()
        data = BatchedDataDict(input_ids=coded_batch(lengths, seq_len), input_lengths=torch.tensor(lengths),
                               routed_experts=coded_batch(lengths, seq_len, (2, 3)),
                               mtp_loss_mask=(coded_batch(lengths, seq_len) % 5 != 0).float())
        yield data


def _assert_same(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "packed_seq_params":
            assert (x.max_seqlen_q, x.max_seqlen_kv) == (y.max_seqlen_q, y.max_seqlen_kv)
            assert torch.equal(x.cu_seqlens_q, y.cu_seqlens_q)
        elif x is None or y is None:
            assert x is y is None, field.name
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), field.name


def test_stream_of_20_compiles_once_and_matches_eager(fresh_dynamo, monkeypatch):
    monkeypatch.setattr(megatron_data, "get_context_parallel_rank", lambda: 1)
    monkeypatch.setattr(megatron_data, "get_context_parallel_world_size", lambda: 2)
    counter = CompileCounterWithBackend("inductor")
    compiled = PackOptions(compile=True, row_capacity=8, backend=counter)
    rows_seen, lengths_seen = set(), set()
    for data in _stream(20, seed=0, max_rows=8, max_len=24):
        args = ("input_lengths", 4, 1, 192, True)
        got = process_microbatch(data, *args, options=compiled)
        want = process_microbatch(data, *args)
        _assert_same(got, want)
        assert got.input_ids.shape == (1, 192) and got.input_ids_cp_sharded.shape == (1, 96)
        rows_seen.add(data.size)
        lengths_seen.add(data["input_ids"].shape[1])
    assert len(rows_seen) > 3 and len(lengths_seen) > 3  # the stream really varies B and S
    assert counter.frame_count == 1
    syncs, more = HostSyncCounter(), list(_stream(3, seed=5, max_rows=8, max_len=24))
    with syncs:  # the compiled path keeps the one planning sync per microbatch, no more
        for data in more:
            process_microbatch(data, "input_lengths", 4, 1, 192, True, options=compiled)
    assert syncs.count <= 3, syncs.calls
    assert counter.frame_count == 1


def test_buckets_bound_compiles_without_pad_full_seq_to(fresh_dynamo):
    counter = CompileCounterWithBackend("aot_eager")  # graph capture + functionalisation; inductor is test 1
    compiled = PackOptions(compile=True, row_capacity=8, buckets=(64, 128), backend=counter)
    eager = PackOptions(buckets=(64, 128))
    totals = set()
    for data in _stream(12, seed=1, max_rows=8, max_len=24):
        args = ("input_lengths", 4, 1, None, True)
        got = process_microbatch(data, *args, options=compiled)
        _assert_same(got, process_microbatch(data, *args, options=eager))
        total = got.input_ids.shape[1]
        ref = reference_pack(data["input_ids"], data["input_lengths"].tolist(), 4, 1, total)
        assert torch.equal(got.input_ids, ref.packed)  # the bucket's slack went to the last sequence
        totals.add(total)
    assert totals == {64, 128}
    assert counter.frame_count == len(totals)


def test_compiled_switch_from_the_config_and_row_capacity_errors(fresh_dynamo):
    counter = CompileCounter()  # dynamo capture only: this test is about the wiring
    data = next(_stream(1, seed=2, max_rows=3, max_len=12))
    planned, _ = data.plan_sequence_packing(64, sequence_length_pad_multiple=4)
    cfg = {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
           "megatron_cfg": megatron_cfg(pp=2), "make_sequence_length_divisible_by": 4,
           "nn_data": {"compile": True, "row_capacity": 4, "backend": counter, "device": "cpu"}}
    it, n, _, _, padded = get_microbatch_iterator(planned, cfg, 1, None)
    for mb in it:
        eager = process_microbatch(mb.data_dict, "input_lengths", 4, 1, padded, True)
        assert torch.equal(mb.input_ids, eager.input_ids) and torch.equal(mb.routed_experts, eager.routed_experts)
    assert counter.frame_count == 1  # the iterator really went through torch.compile, once
    too_many = next(_stream(1, seed=3, max_rows=1, max_len=8))
    too_many = too_many.select_indices([0] * 5)
    with pytest.raises(PackingError, match=r"the batch has 5 rows, more than row_capacity=4; raise "
                                           r"cfg\['nn_data'\]\['row_capacity'\] to at least 5"):
        process_microbatch(too_many, "input_lengths", 4, 1, 64, True,
                           options=PackOptions(compile=True, row_capacity=4, backend=counter))
