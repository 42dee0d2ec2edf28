"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on
the CPU with tiny sizes. Needs megatron-core (``PackedSeqParams``): skipped with "megatron-core
not installed" without it (gpu_check counts that as not checked).

The NeMo-RL-compatible layer's compiled switch (``PackOptions(compile=True)``) on a CUDA GPU:
a stream of microbatches with varying lengths, row counts (1..R) and row lengths compiles once, equals
the eager path exactly, and makes exactly one host-device sync per microbatch (its planning
read) and no more, H2D copies included; fp32 and bf16 ``mtp_loss_mask``. CP rank 1 of 2.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.nemo_rl.megatron_data import PackOptions, process_microbatch
from nn_data.nemo_rl import megatron_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data.graph import reset_compiled
from nn_data.diagnostics import SyncCounter
from tests.cuda.stream import TIER, DEVICE, DTYPES, SIZES, make_stream

pytestmark = TIER

ARGS = ("input_lengths", SIZES.multiple, 1, SIZES.total, True)  # key, m, p, pad_full_seq_to, pack


class Run(NamedTuple):
    options: PackOptions
    data: list
    counter: CompileCounterWithBackend
    outputs: list
    eager: list
    syncs: list  # one SyncCounter per microbatch of a second compiled pass


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def compat(request):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    torch._dynamo.reset()
    reset_compiled()
    patch = pytest.MonkeyPatch()
    patch.setattr(megatron_data, "get_context_parallel_rank", lambda: 1)
    patch.setattr(megatron_data, "get_context_parallel_world_size", lambda: SIZES.cp)
    counter = CompileCounterWithBackend("inductor")
    options = PackOptions(compile=True, row_capacity=SIZES.rows, backend=counter)
    data = [BatchedDataDict(input_ids=mb.x, input_lengths=mb.lengths, mtp_loss_mask=(mb.x % 5 != 0).to(request.param))
            for mb in make_stream(SIZES, vary_seq_len=True, seed=6, min_rows=1)]
    with torch.no_grad():
        outputs = [process_microbatch(d, *ARGS, options=options) for d in data]
        eager = [process_microbatch(d, *ARGS) for d in data]
        syncs = []
        for d in data:
            with SyncCounter(DEVICE) as counted:
                process_microbatch(d, *ARGS, options=options)
            syncs.append(counted)
    yield Run(options, data, counter, outputs, eager, syncs)
    patch.undo()
    torch._dynamo.reset()
    reset_compiled()


def test_compat_stream_compiles_once(compat):
    assert len({d["input_ids"].shape[1] for d in compat.data}) == len(SIZES.seq_lens)  # S really varies
    assert compat.counter.frame_count == 1


def assert_same(i, got, want) -> None:
    for field in dataclasses.fields(got):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if field.name == "packed_seq_params":
            assert (a.max_seqlen_q, a.max_seqlen_kv) == (b.max_seqlen_q, b.max_seqlen_kv), i
            assert torch.equal(a.cu_seqlens_q, b.cu_seqlens_q) and torch.equal(a.cu_seqlens_kv, b.cu_seqlens_kv), i
        elif a is None or b is None:
            assert a is None and b is None, f"microbatch {i}: {field.name}"
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"microbatch {i}: {field.name} differs"


def test_compat_compiled_equals_eager(compat):
    for i, (got, want) in enumerate(zip(compat.outputs, compat.eager)):
        assert_same(i, got, want)


def test_compat_empty_microbatch_equals_eager(compat):
    """B = 0 through the compiled switch (the same graph): eager gives cu_seqlens_padded = [T]."""
    empty = BatchedDataDict({key: value[:0] for key, value in compat.data[0].items()})
    with torch.no_grad():
        assert_same(0, process_microbatch(empty, *ARGS, options=compat.options), process_microbatch(empty, *ARGS))
    assert compat.counter.frame_count == 1


def test_compat_makes_one_sync_per_microbatch_and_no_more(compat):
    counts = [s.count for s in compat.syncs]
    extra = [(i, s.locations) for i, s in enumerate(compat.syncs) if s.count != 1]
    assert counts == [1] * len(counts), f"syncs per microbatch {counts}; where they differ from 1: {extra[:3]}"
    assert compat.counter.frame_count == 1
