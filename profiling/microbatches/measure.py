"""Measure the modes over the planned stream: latency per microbatch, compiles, host syncs,
profiler trace (ops per microbatch, peak memory).

Three passes, all counted for recompiles:
1. timed: each mode's first call (it compiles; reduce-overhead on CUDA: its first two calls, the
   second records the CUDA graphs) is timed on its own; then ``passes`` times over
   the stream with the modes **taking turns pass by pass** (mode after mode over the whole
   stream, then again), one wall-clock sample per microbatch and mode (the device synchronised
   around each), so a load change on a shared machine hits every mode alike while each mode
   still runs microbatch after microbatch, as a training loop does (interleaving microbatch by
   microbatch made every mode pay for the others' cache traffic). With ``guard_eval="skip-unsafe"`` the
   compiled modes' steady calls run under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``:
   Dynamo then checks only the guards that tell a code object's cache entries apart (none here:
   one graph per region), instead of every guard on every call;
2. host syncs: ``sync_steps`` microbatches per mode under :class:`nn_data.diagnostics.HostSyncCounter`
   (and ``torch.cuda.set_sync_debug_mode("warn")`` on CUDA, its warnings counted), full guards;
3. traced: ``trace_steps`` microbatches (after one warm-up step) under ``torch.profiler``
   with ``tensorboard_trace_handler`` into ``<run>/<mode>/``, full guards (so the trace shows
   what guard evaluation costs: ``TorchDynamo Cache Lookup``). Ops per microbatch are the
   trace's ``cpu_op`` events per step; on CPU the peak memory is the highest "Total Allocated"
   of the trace's memory events within a step, above its value when the step began (tensors
   the torch CPU allocator hands out while profiling; Python objects are not counted). On
   CUDA it is ``torch.cuda.max_memory_allocated`` above the allocation at the step's start.

``skip-unsafe`` is safe only when nothing a guard checks changes after the first microbatch,
which holds for this stream (the same shapes, dtypes and modules throughout); passes 2 and 3
evaluate every guard, so a recompile would still be counted there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import statistics
import sys
import warnings
from typing import Optional

import torch
from torch._dynamo.utils import counters

from nn_data.diagnostics import HostSyncCounter, cuda_sync_warnings
from profiling.microbatches.stream import Mode, Stream
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
    step_s: list = dataclasses.field(default_factory=list)  # per training step: its microbatches' time
    step_mean_s: Optional[float] = None
    step_std_s: Optional[float] = None


def step_times(samples: list, stream: Stream, passes: int) -> list:
    """Seconds per training step: the sum of its microbatches' samples, pass after pass, for every
    complete step of the stream (``stream.steps``) but the first step of the first pass (whose first
    microbatch was timed apart, with its compile). Example: 2 steps of 2 microbatches, 2 passes ->
    samples ``[b, c, d | a', b', c', d']`` -> ``[c + d, a' + b', c' + d']``."""
    keys = [(p, mb.step) for p in range(passes) for i, mb in enumerate(stream.microbatches) if p or i]
    sums: dict = {}
    for key, value in zip(keys, samples):
        sums[key] = sums.get(key, 0.0) + value
    first = stream.microbatches[0].step
    return [v for (p, step), v in sums.items() if step < stream.steps and (p, step) != (0, first)]


def graph_count() -> int:
    return int(counters["stats"]["unique_graphs"])


GUARD_EVAL = ("skip-unsafe", "full")


FIRST_COMPILE = "15-75 s on 2 CPU cores, more under load"  # what the announcement says to expect


def first_call(mode: Mode, stream: Stream, device) -> tuple[float, int]:
    """Time ``mode``'s first microbatch (it compiles; ``mode.first_calls`` calls of it, so that
    reduce-overhead's CUDA-graph recording is timed here, not in the steady samples): ``(seconds,
    graphs it compiled)``. A compiled mode says so on stderr before and after, since nothing else
    prints while inductor works."""
    if mode.compiled:
        print(f"mode {mode.name}: compiling its first microbatch (the first compile takes {FIRST_COMPILE}) ...",
              file=sys.stderr, flush=True)
    before = graph_count()
    with torch.no_grad():
        first = timed_call(lambda: [mode.step(stream.microbatches[0]) for _ in range(mode.first_calls)], device)
    graphs = graph_count() - before
    if mode.compiled:
        print(f"mode {mode.name}: first microbatch compiled and run in {first:.1f} s ({graphs} graph(s))",
              file=sys.stderr, flush=True)
    return first, graphs


def steady_calls(modes: int, stream: Stream, passes: int) -> int:
    """Timed calls of the steady passes, all modes together (what the progress bar counts): every
    microbatch of every pass but the first pass's first, per mode. 3 modes, 32 microbatches, 3
    passes -> 3 * (3 * 32 - 1) = 285."""
    return modes * (passes * len(stream.microbatches) - 1)


def steady_samples(modes: list, stream: Stream, passes: int, device, guard_eval: str = "skip-unsafe",
                   progress=None) -> dict:
    """``{mode name: [seconds per microbatch]}`` over ``passes`` passes, the modes taking turns
    pass by pass (the stream's first microbatch of the first pass is skipped: each mode's first
    call was timed apart). ``progress`` (a tqdm bar) advances once per timed call:
    ``steady_calls`` in all."""
    if guard_eval not in GUARD_EVAL:
        raise ValueError(f"--guard-eval={guard_eval!r} is invalid; expected one of {GUARD_EVAL}")
    samples: dict = {m.name: [] for m in modes}
    with torch.no_grad():
        for p in range(passes):
            for mode in modes:
                skip = mode.compiled and guard_eval == "skip-unsafe"
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext():
                    for i, mb in enumerate(stream.microbatches):
                        if p == 0 and i == 0:
                            continue
                        samples[mode.name].append(timed_call(lambda: mode.step(mb), device))
                        if progress is not None:
                            progress.update(1)
    return samples


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
        cuda_syncs = len(cuda_sync_warnings(caught)) / steps
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


def measure_mode(mode: Mode, stream: Stream, *, first: tuple, samples: list, steady_graphs: int, sync_steps: int,
                 trace_steps: int, device, run_dir: str) -> ModeResult:
    """Passes 2 and 3 for one mode (module docstring), with its first call ``(s, graphs)``, its
    steady ``samples`` from pass 1 and the graphs compiled during pass 1 (``steady_graphs``,
    counted against every compiled mode), as a :class:`ModeResult`."""
    first_s, graphs = first
    graphs_before = graph_count()
    with torch.no_grad():
        syncs, cuda_syncs = _count_syncs(mode, stream, sync_steps, device)
        out_dir = os.path.join(run_dir, mode.name)
        cuda_peak = _trace(mode, stream, trace_steps, device, out_dir)
    ops, cpu_peak, _ = read_trace(out_dir)
    median, p10, p90 = spread(samples)
    steps = step_times(samples, stream, (len(samples) + 1) // len(stream.microbatches))  # passes
    tokens = [mb.tokens for mb in stream.microbatches]
    mean_tokens = sum(tokens) / len(tokens)
    compiled = mode.compiled
    return ModeResult(
        name=mode.name, first_s=first_s, samples_s=samples, median_s=median, mean_s=sum(samples) / len(samples),
        p10_s=p10, p90_s=p90, tokens_per_s=mean_tokens / (sum(samples) / len(samples)), ops_per_microbatch=ops,
        graphs=graphs if compiled else None,
        recompiles=steady_graphs + graph_count() - graphs_before if compiled else None,
        graph_breaks=sum(counters["graph_break"].values()) if compiled else None,
        syncs_per_microbatch=syncs, cuda_syncs_per_microbatch=cuda_syncs,
        peak_bytes=cuda_peak if cuda_peak is not None else cpu_peak,
        cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]) if compiled else None,
        trace_dir=out_dir, step_s=steps, step_mean_s=statistics.fmean(steps) if steps else None,
        step_std_s=statistics.stdev(steps) if len(steps) > 1 else None,
    )
