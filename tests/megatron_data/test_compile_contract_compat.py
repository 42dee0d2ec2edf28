"""Tier: pure CPU, single process, torch.compile(fullgraph=True) with inductor (one module-scoped
compile; CP rank 1 of 2 is simulated by patching the parallel_state lookup).

The compile contract of the NeMo-RL-compatible layer's compiled switch: one graph for a
stream whose row length ``S`` (0 and 1 included) and row count (0 included) vary, compiled == eager
on every field of ``ProcessedInputs`` (``PackedSeqParams`` included), and every shape/dtype/device
error raised as ``PackingError`` before the compiled region, with the eager message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackSequences
from nn_data.nemo_rl import megatron_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import PackOptions, process_microbatch
from nn_data.nemo_rl.megatron_data.graph import reset_compiled
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.testing.coded import coded_batch

R, M, T = 8, 4, 192  # row capacity, multiple (2 * cp_size), pad_full_seq_to (8 rows x 24 tokens fit)
STREAM = [(5, 8), (0, 3), (1, 0), (7, 5), (9, 1), (11, 8), (13, 2), (2, 7), (3, 4), (4, 6), (6, 8), (8, 1),
          (10, 2), (12, 3), (24, 8), (17, 0), (1, 5), (0, 6)]  # 15 distinct S, rows 0..R
ARGS = ("input_lengths", M, 1, T, True)  # seq_length_key, m, p, pad_full_seq_to, pack_sequences


@pytest.fixture(scope="module")
def compiled_options():
    torch._dynamo.reset()
    reset_compiled()
    counter = CompileCounterWithBackend("inductor")
    yield PackOptions(compile=True, row_capacity=R, backend=counter), counter
    torch._dynamo.reset()
    reset_compiled()


@pytest.fixture
def rank1(monkeypatch):
    monkeypatch.setattr(megatron_data, "get_context_parallel_rank", lambda: 1)
    monkeypatch.setattr(megatron_data, "get_context_parallel_world_size", lambda: 2)


def _data(gen, seq_len, rows):
    lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen).tolist()
    return BatchedDataDict(input_ids=coded_batch(lengths, seq_len), input_lengths=torch.tensor(lengths, dtype=torch.int64),
                           routed_experts=coded_batch(lengths, seq_len, (2, 3)),
                           mtp_loss_mask=(coded_batch(lengths, seq_len) % 5 != 0).float())


def _assert_same(got, want):
    """Every field of ProcessedInputs, and every field of its PackedSeqParams."""
    for field in dataclasses.fields(got):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if field.name == "packed_seq_params":
            for f in dataclasses.fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                assert (torch.equal(x, y) and x.dtype == y.dtype) if torch.is_tensor(x) else x == y, f.name
        elif a is None or b is None:
            assert a is b is None, field.name
        else:
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), field.name


def test_compat_compiled_switch_one_graph_for_a_stream_of_row_lengths(compiled_options, rank1):
    options, counter = compiled_options
    gen = torch.Generator().manual_seed(0)
    assert len({s for s, _ in STREAM}) >= 12 and {b for _, b in STREAM} == set(range(R + 1))
    for seq_len, rows in STREAM:
        data = _data(gen, seq_len, rows)
        got = process_microbatch(data, *ARGS, options=options)
        _assert_same(got, process_microbatch(data, *ARGS))
        ref = reference_pack(data["input_ids"], data["input_lengths"].tolist(), M, 1, T)
        assert torch.equal(got.input_ids, ref.packed)
        assert torch.equal(got.input_ids_cp_sharded, reference_shard(ref.packed, ref.cu_seqlens_padded, 2, 1))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(STREAM)} microbatches"


def test_no_sequence_gives_the_core_ops_layout_compiled_and_eager(compiled_options, rank1):
    """B = 0: cu_seqlens_padded is [T] and max_seqlen is T (one padding pseudo-segment), as the core op."""
    options, counter = compiled_options
    data = _data(torch.Generator(), 6, 0)
    core = PackSequences(M, pad_full_seq_to=T)(data["input_ids"], data["input_lengths"])
    for out in (process_microbatch(data, *ARGS, options=options), process_microbatch(data, *ARGS)):
        assert out.cu_seqlens_padded.tolist() == core.cu_seqlens_padded.tolist() == [T]
        assert out.packed_seq_params.max_seqlen_q == out.packed_seq_params.max_seqlen_kv == int(core.max_seqlen) == T
    assert counter.frame_count == 1


def _both_raise(data, options) -> str:
    with pytest.raises(PackingError) as got:
        process_microbatch(data, *ARGS, options=options)
    with pytest.raises(PackingError) as want:
        process_microbatch(data, *ARGS)
    assert str(got.value) == str(want.value)
    return str(got.value)


def test_metadata_errors_raise_before_the_compiled_region(compiled_options, rank1):
    options, counter = compiled_options
    gen = torch.Generator().manual_seed(1)
    data = _data(gen, 8, 3)
    data["routed_experts"] = data["routed_experts"][:, :7]
    assert _both_raise(data, options).startswith("routed_experts has shape (3, 7, 2, 3); it must be [B, S, *] = [3, 8, *]")
    data = _data(gen, 8, 3)
    data["mtp_loss_mask"] = data["mtp_loss_mask"].to("meta")
    assert "input_ids on cpu, mtp_loss_mask on meta" in _both_raise(data, options)
    data = _data(gen, 8, 3)
    data["input_lengths"] = data["input_lengths"].float()
    assert "seq_lengths must be a 1-D integer tensor, got shape (3,) and dtype torch.float32" in _both_raise(data, options)
    assert counter.frame_count == 1  # nothing compiled for them
