"""Measure one mode over the planned stream: latency per microbatch, compiles, host syncs,
profiler trace (ops per microbatch, peak memory).

Each mode runs three passes, in this order, all counted for recompiles:
1. timed: ``passes`` times over the stream, one wall-clock sample per microbatch (the device
   synchronised around each), the very first call timed apart (it compiles);
2. host syncs: ``sync_steps`` microbatches under :class:`nn_data.diagnostics.HostSyncCounter`
   (and ``torch.cuda.set_sync_debug_mode("warn")`` on CUDA, its warnings counted);
3. traced: ``trace_steps`` microbatches (after one warm-up step) under ``torch.profiler``
   with ``tensorboard_trace_handler`` into ``<run>/<mode>/``. Ops per microbatch are the
   trace's ``cpu_op`` events per step; on CPU the peak memory is the highest "Total Allocated"
   of the trace's memory events within a step, above its value when the step began (tensors
   the torch CPU allocator hands out while profiling; Python objects are not counted). On
   CUDA it is ``torch.cuda.max_memory_allocated`` above the allocation at the step's start.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import warnings
from typing import Optional

import torch
from torch._dynamo.utils import counters

from nn_data.diagnostics import HostSyncCounter
from profiling.microbatch_stream import Mode, Stream
from profiling.timing import spread, timed_call


@dataclasses.dataclass
class ModeResult:
    """Everything the table, summary.json and the chart show for one mode (seconds, bytes)."""

    name: str
    first_s: float
    samples_s: list
    median_s: float
    mean_s: float  # total steady time / microbatches: the stream's throughput per microbatch
    p10_s: float
    p90_s: float
    tokens_per_s: float
    ops_per_microbatch: float
    graphs: Optional[int]  # compiled graphs after the first microbatch (None: not compiled)
    recompiles: Optional[int]  # graphs compiled after the first microbatch, over all passes
    graph_breaks: Optional[int]
    syncs_per_microbatch: float
    cuda_syncs_per_microbatch: Optional[float]
    peak_bytes: Optional[int]
    cudagraph_skips: Optional[int]
    trace_dir: str


def _graph_count() -> int:
    return int(counters["stats"]["unique_graphs"])


def _timed_passes(mode: Mode, stream: Stream, passes: int, device, progress) -> tuple[float, list, int]:
    """``(first call s, steady samples s, graphs after the first call)``."""
    mbs = stream.microbatches
    first = timed_call(lambda: mode.step(mbs[0]), device)
    graphs = _graph_count()
    samples = []
    if progress is not None:
        progress.update(1)
    for p in range(passes):
        for i, mb in enumerate(mbs):
            if p == 0 and i == 0:
                continue
            samples.append(timed_call(lambda: mode.step(mb), device))
            if progress is not None:
                progress.update(1)
    return first, samples, graphs


def _count_syncs(mode: Mode, stream: Stream, steps: int, device) -> tuple[float, Optional[float]]:
    """Host syncs per microbatch counted from Python, and (CUDA) by the sync debug mode."""
    mbs = [stream.microbatches[i % len(stream.microbatches)] for i in range(steps)]
    cuda = torch.device(device).type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter() as syncs:
                for mb in mbs:
                    mode.step(mb)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    cuda_syncs = None
    if cuda:
        cuda_syncs = sum("synchroniz" in str(w.message) for w in caught) / steps
    return syncs.count / steps, cuda_syncs


def _trace(mode: Mode, stream: Stream, steps: int, device, out_dir: str) -> Optional[int]:
    """Record ``steps`` microbatches (after 1 warm-up) into ``out_dir``; CUDA peak bytes or None."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    mbs = stream.microbatches
    peak = 0
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(out_dir, worker_name=mode.name),
                 record_shapes=True, profile_memory=True) as prof:
        for i in range(steps + 1):
            mb = mbs[i % len(mbs)]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            mode.step(mb)
            if cuda:
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() - start)
            prof.step()
    return peak if cuda else None


def read_trace(out_dir: str) -> tuple[float, int, int]:
    """``(cpu_op events per step, peak CPU bytes above each step's start, steps)`` of the newest
    trace in ``out_dir``."""
    paths = sorted(glob.glob(os.path.join(out_dir, "*.pt.trace.json*")), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.pt.trace.json) was written to {out_dir}")
    with open(paths[-1]) as f:
        events = json.load(f)["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    ops = [e["ts"] for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    n_ops, peak = 0, 0
    for lo, hi in steps:
        n_ops += sum(lo <= t <= hi for t in ops)
        inside = [(total, nbytes) for t, total, nbytes in memory if lo <= t <= hi]
        if inside:
            base = inside[0][0] - inside[0][1]  # allocated just before the step's first event
            peak = max(peak, max(total for total, _ in inside) - base)
    return n_ops / max(len(steps), 1), peak, len(steps)


def measure_mode(mode: Mode, stream: Stream, *, passes: int, sync_steps: int, trace_steps: int,
                 device, run_dir: str, progress=None) -> ModeResult:
    """Run the three passes for one mode (module docstring) and collect a :class:`ModeResult`."""
    counters.clear()
    graphs_before = _graph_count()
    with torch.no_grad():
        first, samples, graphs_after_first = _timed_passes(mode, stream, passes, device, progress)
        syncs, cuda_syncs = _count_syncs(mode, stream, sync_steps, device)
        out_dir = os.path.join(run_dir, mode.name)
        cuda_peak = _trace(mode, stream, trace_steps, device, out_dir)
    ops, cpu_peak, _ = read_trace(out_dir)
    median, p10, p90 = spread(samples)
    tokens = [mb.tokens for mb in stream.microbatches]
    mean_tokens = sum(tokens) / len(tokens)
    compiled = mode.compiled
    return ModeResult(
        name=mode.name, first_s=first, samples_s=samples, median_s=median, mean_s=sum(samples) / len(samples),
        p10_s=p10, p90_s=p90, tokens_per_s=mean_tokens / (sum(samples) / len(samples)), ops_per_microbatch=ops,
        graphs=graphs_after_first - graphs_before if compiled else None,
        recompiles=_graph_count() - graphs_after_first if compiled else None,
        graph_breaks=sum(counters["graph_break"].values()) if compiled else None,
        syncs_per_microbatch=syncs, cuda_syncs_per_microbatch=cuda_syncs,
        peak_bytes=cuda_peak if cuda_peak is not None else cpu_peak,
        cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]) if compiled else None,
        trace_dir=out_dir,
    )
