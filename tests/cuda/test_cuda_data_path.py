"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on
the CPU with tiny sizes (``scripts/gpu_check.sh --dry-run``), where the CUDA-only assertions
skip. One process, torch.compile with inductor; each fixture compiles its graphs once.

The core ops' compiled data path on a CUDA GPU: one graph per compiled function for a stream
of microbatches, exact equality with eager and with the loop reference, zero host-device syncs
(H2D copies included) under ``torch.cuda.set_sync_debug_mode``, and ``mode="reduce-overhead"``
recording its CUDA graphs once and replaying them for the whole stream; fp32 and bf16 outputs.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from nn_data import pad_to_row_capacity
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.diagnostics import CudaGraphCounter, SyncCounter, forbid_syncs
from tests.cuda.stream import (
    TIER, DEVICE, DTYPES, SIZES, DataPath, Scale, cuda_only, expected_rows, make_stream,
)

pytestmark = TIER


def step(prepare, finish, model, mb, *, mark_step=False, dynamic_s=False):
    """One microbatch: rows padded to R outside the graphs, prepare | model | finish.
    Returns ``(packed [1, T], shards [C, T/C], cu_seqlens_padded [R+1], rows [R, S, H])``, cloned
    (CUDA-graph outputs are overwritten by the next replay)."""
    padded = pad_to_row_capacity(mb.x, mb.lengths, SIZES.rows)  # [R, S]
    if dynamic_s:
        torch._dynamo.maybe_mark_dynamic(padded.x, 1)
    if mark_step:
        torch.compiler.cudagraph_mark_step_begin()
    packed, shards, cu_pad = prepare(padded.x, padded.seq_lengths, padded.num_rows)
    out = finish(model(shards), padded.seq_lengths, cu_pad, padded.x)
    return tuple(t.clone() for t in (packed, shards, cu_pad, out))


def run(prepare, finish, model, stream, **kwargs) -> list:
    with torch.no_grad():
        return [step(prepare, finish, model, mb, **kwargs) for mb in stream]


def assert_same(got: list, want: list, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(("packed", "shards", "cu_seqlens_padded", "rows"), g, w):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: microbatch {i}, {name} differs"


def assert_no_syncs(prepare, finish, model, stream, **kwargs) -> None:
    """Count the syncs of one pass (with their locations), then run one more pass under the
    contract itself (``set_sync_debug_mode("error")`` on CUDA)."""
    with SyncCounter(DEVICE) as syncs:
        run(prepare, finish, model, stream, **kwargs)
    where = Counter(syncs.locations).most_common()
    assert syncs.count == 0, f"{syncs.count} host syncs over {len(stream)} microbatches, at {where}"
    with forbid_syncs(DEVICE):
        run(prepare, finish, model, stream, **kwargs)


class Compiled(NamedTuple):
    dtype: torch.dtype
    model: Scale
    path: DataPath
    stream: list
    prepare: object
    finish: object
    counter: CompileCounterWithBackend
    outputs: list
    eager: list


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def compiled(request):
    torch._dynamo.reset()
    dtype = request.param
    model, path = Scale(SIZES.hidden, dtype).to(DEVICE), DataPath(SIZES, SIZES.seq_len).to(DEVICE)
    counter = CompileCounterWithBackend("inductor")
    opts = dict(fullgraph=True, dynamic=False, backend=counter)
    prepare, finish = torch.compile(path.prepare, **opts), torch.compile(path.finish, **opts)
    stream = make_stream(SIZES, vary_seq_len=False)
    outputs = run(prepare, finish, model, stream)
    eager = run(path.prepare, path.finish, model, stream)
    yield Compiled(dtype, model, path, stream, prepare, finish, counter, outputs, eager)
    torch._dynamo.reset()


def test_stream_compiles_once_per_function(compiled):
    rows = {mb.x.shape[0] for mb in compiled.stream}
    lengths = {int(v) for mb in compiled.stream for v in mb.lengths}  # sync: test bookkeeping
    assert len(compiled.stream) >= 32 and len(rows) > 3 and len(lengths) > 10  # the stream really varies
    assert compiled.counter.frame_count == 2, f"{compiled.counter.frame_count} graphs for prepare + finish"


def test_compiled_equals_eager_and_the_loop_reference(compiled):
    assert_same(compiled.outputs, compiled.eager, "compiled vs eager")
    m, total, cp = SIZES.multiple, SIZES.total, SIZES.cp
    for mb, (packed, shards, _, out) in zip(compiled.stream, compiled.outputs):
        ref = reference_pack(mb.x, mb.lengths, m, 1, total)
        assert torch.equal(packed, ref.packed)
        for r in range(cp):
            assert torch.equal(shards[r : r + 1], reference_shard(ref.packed, ref.cu_seqlens_padded, cp, r))
        assert torch.equal(out, expected_rows(compiled.model, mb, SIZES.rows))


def test_compiled_stream_makes_no_host_syncs(compiled):
    assert_no_syncs(compiled.prepare, compiled.finish, compiled.model, compiled.stream)
    assert compiled.counter.frame_count == 2  # no recompile in the sync-checked passes


class ReduceOverhead(NamedTuple):
    model: Scale
    stream: list
    prepare: object
    finish: object
    graphs: int  # dynamo graphs compiled over both passes
    first: list  # pass 1 (warm-up, recording, replays)
    steady: list  # pass 2 (replays only)
    eager: list
    recorded_first: int
    recorded_total: int
    replays_steady: int
    skips: int


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def reduce_overhead(request):
    torch._dynamo.reset()
    counters.clear()
    model = Scale(SIZES.hidden, request.param).to(DEVICE)
    path = DataPath(SIZES, SIZES.seq_len).to(DEVICE)
    opts = dict(mode="reduce-overhead", fullgraph=True, dynamic=False)
    prepare, finish = torch.compile(path.prepare, **opts), torch.compile(path.finish, **opts)
    stream = make_stream(SIZES, vary_seq_len=False, seed=1)
    with CudaGraphCounter() as cuda_graphs:
        first = run(prepare, finish, model, stream, mark_step=True)
        recorded_first, replays_before = cuda_graphs.recorded, cuda_graphs.replays
        steady = run(prepare, finish, model, stream, mark_step=True)
    eager = run(path.prepare, path.finish, model, stream)
    yield ReduceOverhead(model, stream, prepare, finish, int(counters["stats"]["unique_graphs"]), first, steady,
                         eager, recorded_first, cuda_graphs.recorded, cuda_graphs.replays - replays_before,
                         cuda_graphs.skips)
    torch._dynamo.reset()


def test_reduce_overhead_equals_eager(reduce_overhead):
    assert_same(reduce_overhead.first, reduce_overhead.eager, "reduce-overhead (first pass) vs eager")
    assert_same(reduce_overhead.steady, reduce_overhead.eager, "reduce-overhead (replays) vs eager")
    assert reduce_overhead.graphs == 2


def test_reduce_overhead_records_cuda_graphs_once_and_replays_them(reduce_overhead):
    cuda_only("CUDA-graph recording and replay")
    ro, n = reduce_overhead, len(reduce_overhead.stream)
    assert ro.skips == 0, f"inductor skipped {ro.skips} CUDA graph(s) (counters['inductor']['cudagraph_skips'])"
    assert ro.recorded_first == 2, f"{ro.recorded_first} CUDA graphs recorded for prepare + finish"
    assert ro.recorded_total == 2, f"re-recorded in the steady pass: {ro.recorded_total} recordings in all"
    assert ro.replays_steady == 2 * n, f"{ro.replays_steady} replays for {n} microbatches x 2 graphs"


def test_reduce_overhead_replays_make_no_host_syncs(reduce_overhead):
    ro = reduce_overhead
    assert_no_syncs(ro.prepare, ro.finish, ro.model, ro.stream, mark_step=True)


def test_stream_of_row_lengths_compiles_once_per_function():
    """S varies over the stream (12 values on the GPU): still one graph per compiled function."""
    torch._dynamo.reset()
    model, path = Scale(SIZES.hidden, torch.float32).to(DEVICE), DataPath(SIZES).to(DEVICE)
    counter = CompileCounterWithBackend("inductor")
    prepare = torch.compile(path.prepare, fullgraph=True, backend=counter)
    finish = torch.compile(path.finish, fullgraph=True, backend=counter)
    stream = make_stream(SIZES, vary_seq_len=True, seed=2)
    try:
        outputs = run(prepare, finish, model, stream[:1], dynamic_s=True)
        with torch.compiler.set_stance("fail_on_recompile"):  # a recompile raises, naming the guard that failed
            outputs += run(prepare, finish, model, stream[1:], dynamic_s=True)
        assert counter.frame_count == 2, f"{counter.frame_count} graphs for {len(SIZES.seq_lens)} row lengths"
        assert_same(outputs, run(path.prepare, path.finish, model, stream), "compiled vs eager")
        for mb, out in zip(stream, outputs):
            assert torch.equal(out[3], expected_rows(model, mb, SIZES.rows))
        with torch.compiler.set_stance("fail_on_recompile"):
            assert_no_syncs(prepare, finish, model, stream, dynamic_s=True)
    finally:
        torch._dynamo.reset()
