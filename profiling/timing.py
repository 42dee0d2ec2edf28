"""The one timer of profiling/: every benchmark and the main job time through these helpers (wall
clock with the device synchronised, or a process's CPU time; medians of repeats, calls interleaved
side by side), plus the machine line every figure carries and the allocator setting for CPU runs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple, TypeVar

import torch

T = TypeVar("T")

#: The inductor options of the profiler's compiled CPU modes (the main job's ``compiled``, the benchmarks'
#: ``compiled+``): inductor calls the kernels from C++ instead of Python, and plans the graph's temporaries into
#: one allocation. Side by side with the default options: profiling/results/compiled_call.md.
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True, "memory_planning": True}


class Timing(NamedTuple):
    median_s: float
    p10_s: float
    p90_s: float
    first_s: float  # the first call (includes compilation for compiled callables)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_result(fn: Callable[[], T], device="cpu") -> tuple[T, float]:
    """``(fn(), seconds)``: one call's result and wall time, the device synchronised before and after."""
    device = torch.device(device)
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def timed_call(fn: Callable[[], object], device="cpu") -> float:
    """Seconds one call of ``fn()`` takes, the device synchronised before and after."""
    return timed_result(fn, device)[1]


def cpu_time_call(fn: Callable[[], object]) -> float:
    """CPU seconds this process spends in one call of ``fn()`` (``time.process_time``: its own
    threads' time, not the time it waits for another process or for other jobs on the machine)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def spread(samples) -> tuple[float, float, float]:
    """``(median, p10, p90)`` of a non-empty sequence of samples."""
    ordered = sorted(samples)
    p10 = ordered[max(0, int(0.1 * (len(ordered) - 1)))]
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return statistics.median(ordered), p10, p90


def time_calls(fn: Callable[[], object], *, warmup: int = 2, reps: int = 10, device="cpu") -> Timing:
    """Time ``fn()``: first call separately, then ``warmup`` untimed calls, then ``reps`` timed ones."""
    first = timed_call(fn, device)
    for _ in range(warmup):
        fn()
    samples = [timed_call(fn, device) for _ in range(reps)]
    return Timing(*spread(samples), first)


def time_calls_cuda(fn: Callable[[], object], *, warmup: int = 3, reps: int = 50) -> Timing:
    """Time ``fn()`` on the current CUDA stream with CUDA events: the first call separately (wall
    clock, it compiles or captures), ``warmup`` untimed calls, then ``reps`` calls, each between
    two events; one synchronisation at the end. Host work inside ``fn`` (a loop's syncs, kernel
    launches) shows as the GPU waiting between the events, so it is counted."""
    first = timed_call(fn, "cuda")
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return Timing(*spread([start.elapsed_time(end) / 1e3 for start, end in events]), first)


def machine_description() -> str:
    """One line naming the machine a figure was taken on."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


def time_side_by_side(fns: dict, *, warmup: int = 2, reps: int = 30, device="cpu") -> dict:
    """Time several callables against each other: ``{name: Timing}``.

    Each is called once on its own first (compiles), then ``warmup`` untimed rounds, then ``reps``
    rounds in each of which every callable runs once, in turn. A load change on a shared machine
    then slows every callable alike, and the ratios of the medians stay meaningful.
    """
    first = {name: timed_call(fn, device) for name, fn in fns.items()}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(timed_call(fn, device))
    return {name: Timing(*spread(s), first[name]) for name, s in samples.items()}


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (``mallopt``: the largest mmap threshold
    and no trimming), so a benchmark's steady state is not dominated by page faults on freshly
    mapped output buffers: what torch's caching allocator does on CUDA. Applies to every mode
    of a run alike. Returns False where it cannot be set (not glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)  # glibc's maximum on 64-bit
        return bool(ok) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False
