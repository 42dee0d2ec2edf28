"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on
the CPU with tiny sizes (``scripts/gpu_check.sh --dry-run``). One process, torch.compile with
inductor; the fixture compiles once per dtype.

PackedForward(compile_packing=True) on a CUDA GPU: a stream of microbatches (row capacity,
varying lengths and row counts) compiles the packing and unpacking sides once, gives exactly the
eager wrapper's output and the model's output on each token in place, and makes no host-device
sync (H2D copies included); fp32 and bf16 models.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackedForward
from nn_data.diagnostics import SyncCounter, forbid_syncs
from tests.cuda.stream import (
    TIER, DEVICE, DTYPES, SIZES, Scale, expected_rows, make_stream,
)

pytestmark = TIER


class ContractModel(nn.Module):
    """PackedForward's model contract around :class:`Scale`: ``(ids [1, T/C], position_ids
    [1, T/C], packed) -> [1, T/C, H]`` = ids * w + position."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.scale = Scale(hidden, dtype)

    def forward(self, input_ids, position_ids, packed):
        return self.scale(input_ids, position_ids)


def wrapper(model, counter=None, dynamic=False) -> PackedForward:
    kwargs = dict(pad_individual_seqs_to_multiple_of=SIZES.multiple, pad_full_seq_to=SIZES.total,
                  row_capacity=SIZES.rows)
    if counter is None:
        return PackedForward(model, **kwargs)
    compile_kwargs = {"backend": counter, **({"dynamic": False} if not dynamic else {})}
    return PackedForward(model, compile_packing=True, compile_kwargs=compile_kwargs, **kwargs)


def run(forward, stream) -> list:
    with torch.no_grad():
        return [forward(mb.x, mb.lengths).clone() for mb in stream]


class Run(NamedTuple):
    model: ContractModel
    stream: list
    compiled: PackedForward
    counter: CompileCounterWithBackend
    outputs: list
    eager: list


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def packed_forward(request):
    torch._dynamo.reset()
    model = ContractModel(SIZES.hidden, request.param).to(DEVICE)
    counter = CompileCounterWithBackend("inductor")
    compiled = wrapper(model, counter)
    stream = make_stream(SIZES, vary_seq_len=False, seed=4)
    yield Run(model, stream, compiled, counter, run(compiled, stream), run(wrapper(model), stream))
    torch._dynamo.reset()


def test_packed_forward_compiles_once(packed_forward):
    assert packed_forward.counter.frame_count == 2, "packing side + unpacking side"


def test_packed_forward_equals_eager_and_the_model_in_place(packed_forward):
    for i, (mb, got, want) in enumerate(zip(packed_forward.stream, packed_forward.outputs, packed_forward.eager)):
        assert got.dtype == want.dtype and torch.equal(got, want), f"microbatch {i}: compiled vs eager"
        oracle = expected_rows(packed_forward.model.scale, mb, mb.x.shape[0], positions=True)
        assert torch.equal(got, oracle), f"microbatch {i}: not the model's output on each token in place"


def test_packed_forward_makes_no_host_syncs(packed_forward):
    with SyncCounter(DEVICE) as syncs:
        run(packed_forward.compiled, packed_forward.stream)
    where = Counter(syncs.locations).most_common()
    assert syncs.count == 0, f"{syncs.count} host syncs over {len(packed_forward.stream)} microbatches, at {where}"
    with forbid_syncs(DEVICE):
        run(packed_forward.compiled, packed_forward.stream)
    assert packed_forward.counter.frame_count == 2


def test_packed_forward_stream_of_row_lengths_compiles_once():
    torch._dynamo.reset()
    try:
        model = ContractModel(SIZES.hidden, torch.float32).to(DEVICE)
        counter = CompileCounterWithBackend("inductor")
        compiled = wrapper(model, counter, dynamic=True)
        stream = make_stream(SIZES, vary_seq_len=True, seed=5)
        outputs = run(compiled, stream[:1])
        with torch.compiler.set_stance("fail_on_recompile"):  # a recompile raises, naming the guard that failed
            outputs += run(compiled, stream[1:])
        assert counter.frame_count == 2, f"{counter.frame_count} graphs for {len(SIZES.seq_lens)} row lengths"
        for mb, got, want in zip(stream, outputs, run(wrapper(model), stream)):
            assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()
