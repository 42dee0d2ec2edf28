"""Small timing helpers shared by the benchmarks (wall clock, median of repeats)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch


class Timing(NamedTuple):
    median_s: float
    p10_s: float
    p90_s: float
    first_s: float  # the first call (includes compilation for compiled callables)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], *, warmup: int = 2, reps: int = 10, device="cpu") -> Timing:
    """Time ``fn()``: first call separately, then ``warmup`` untimed calls, then ``reps`` timed ones."""
    device = torch.device(device)
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    samples.sort()
    p10 = samples[max(0, int(0.1 * (len(samples) - 1)))]
    p90 = samples[min(len(samples) - 1, int(round(0.9 * (len(samples) - 1))))]
    return Timing(statistics.median(samples), p10, p90, first)


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
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc
