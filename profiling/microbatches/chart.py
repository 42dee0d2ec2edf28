"""The main job's chart.png: what one microbatch costs per mode, read at a glance (lower is better).

Four panels:
* **per microbatch of the stream** (wide, top): x is the microbatch's place in the stream, 1 to N
  (the subtitle's N); y is the median over the ``--passes`` timed passes of that microbatch's
  latency, per mode (log scale, plain millisecond ticks), with the number of sequences in each
  microbatch on the right axis (the loop's cost follows it). Microbatch 1 of the first pass is each
  mode's first call (it compiles) and is timed apart, so microbatch 1's median is over the other
  passes.
* **median per microbatch** (p10-p90 bars) with the speed-ups of the run (``report.speedups``).
* **first call**: each mode's first microbatch in seconds, compile included, kept off the other
  panels' axes.
* **time per training step** of every timed step, by mode (mean and spread in the legend).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from profiling.microbatches.measure import ModeResult

WHAT_RUNS = "one microbatch = pack -> CP shard -> model -> unshard -> unpack"


def per_stream_position(samples: list, n: int, passes: int) -> list[Optional[float]]:
    """Median over the passes of each stream position's samples. ``samples`` is pass after pass
    without the first pass's first microbatch (timed apart): n = 3, passes = 2 ->
    ``[b, c | a', b', c']`` -> ``[a', median(b, b'), median(c, c')]``."""
    padded = [None] + list(samples)  # [passes * n]: the first call's place left empty
    if len(padded) != passes * n:
        raise ValueError(f"samples={len(samples)} is not passes * n - 1 = {passes * n - 1} (passes={passes}, n={n})")
    out = []
    for i in range(n):
        values = [padded[p * n + i] for p in range(passes) if padded[p * n + i] is not None]
        out.append(statistics.median(values) if values else None)
    return out


def _ms_axis(ax) -> None:
    """Log y axis with plain millisecond ticks (0.2, 0.5, 1, 2, 5 ...), no powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _stream_panel(ax, results: list[ModeResult], rows: list, passes: int, step_of: Optional[list]) -> None:
    from matplotlib.ticker import MaxNLocator

    n = len(rows)
    x = list(range(1, n + 1))
    starts = [i for i in range(1, n) if step_of and step_of[i] != step_of[i - 1]]
    for k, i in enumerate(starts):  # a training step begins after position i (1-based)
        ax.axvline(i + 0.5, color="0.6", linewidth=0.8, linestyle="--", label="new training step" if k == 0 else None)
    for i, r in enumerate(results):
        y = [math.nan if v is None else v * 1e3 for v in per_stream_position(r.samples_s, n, passes)]
        ax.plot(x, y, label=r.name, color=f"C{i}", linewidth=1.3, marker="." if n <= 64 else None)
    _ms_axis(ax)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 1.7)  # room for the legend above the highest line
    ax.set_xlim(0.5, n + 0.5)
    ax.set_xlabel(f"microbatch of the stream (1-{n}; each point the median of its {passes} timed passes, "
                  f"microbatch 1 of the first pass timed apart as the first call)")
    ax.set_ylabel("ms per microbatch (log)")
    handles, labels = ax.get_legend_handles_labels()
    twin = ax.twinx()
    (line,) = twin.plot(x, rows, color="grey", linestyle=":", linewidth=1, label="sequences in it (right axis)")
    twin.set_ylabel("sequences in the microbatch")
    twin.set_ylim(0, max(rows) * 1.25 if rows else 1)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles + [line], labels + [line.get_label()], fontsize=8, loc="upper left", ncol=len(handles) + 1)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title("latency of each microbatch (lower is better)", fontsize=10)


def _median_panel(ax, results: list[ModeResult], ratios: dict) -> None:
    names = [r.name for r in results]
    medians = [r.median_s * 1e3 for r in results]
    errors = [[(r.median_s - r.p10_s) * 1e3 for r in results], [(r.p90_s - r.median_s) * 1e3 for r in results]]
    ax.bar(names, medians, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(results))])
    for i, value in enumerate(medians):
        ax.annotate(f"{value:.2f}", (i, value), xytext=(14, 2), textcoords="offset points", ha="left",
                    va="bottom", fontsize=8)
    ax.set_ylabel("median ms per microbatch (p10-p90 bars)")
    ax.tick_params(axis="x", labelsize=8 if len(results) > 3 else 10)
    ax.set_ylim(0, max(r.p90_s for r in results) * 1e3 * 1.45)
    pairs = [name[: -len(" (median)")] for name in ratios if name.endswith(" (median)")]
    lines = [f"{pair}: {ratios[pair + ' (median)']:.2f}x median, {ratios[pair + ' (mean)']:.2f}x mean"
             for pair in pairs]
    if lines:
        ax.text(0.02, 0.97, "speed-up (slower's ms / faster's ms)\n" + "\n".join(lines),
                transform=ax.transAxes, va="top", ha="left", fontsize=8,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.9, edgecolor="0.7"))
    ax.set_title("steady microbatch, median", fontsize=10)


def _first_call_panel(ax, results: list[ModeResult]) -> None:
    names = [r.name for r in results]
    firsts = [r.first_s for r in results]
    ax.bar(names, firsts, color=[f"C{i}" for i in range(len(results))])
    for i, value in enumerate(firsts):
        ax.annotate(f"{value:.2f} s" if value >= 0.1 else f"{value * 1e3:.1f} ms", (i, value), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (first microbatch)")
    ax.tick_params(axis="x", labelsize=8 if len(results) > 3 else 10)
    ax.set_ylim(0, max(firsts) * 1.2 if firsts else 1)
    ax.set_title("first call: microbatch 1, compiling included", fontsize=10)


def _steps_panel(ax, results: list[ModeResult]) -> None:
    timed = [r for r in results if r.step_s]
    for i, r in enumerate(results):
        if r.step_s:
            label = f"{r.name}: mean {r.step_mean_s * 1e3:.1f} ms" + (
                f" +- {r.step_std_s / r.step_mean_s:.0%}" if r.step_std_s is not None else "")
            ax.plot(range(1, len(r.step_s) + 1), [s * 1e3 for s in r.step_s], marker="o", markersize=3,
                    linewidth=1, label=label, color=f"C{i}")
    if timed:
        from matplotlib.ticker import MaxNLocator

        ax.set_ylim(0, max(max(r.step_s) for r in timed) * 1e3 * 1.35)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, loc="upper right")
        ax.set_xlabel("timed training step (all passes; the first, which compiled, left out)")
    else:
        ax.text(0.5, 0.5, "no complete training step in the stream\n(--steps N times whole steps)",
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_ylabel("ms per training step" if timed else "")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title("time per training step (sum of its microbatches)", fontsize=10)


def write_chart(path: str, results: list[ModeResult], subtitle: str, *, rows: list, passes: int,
                ratios: dict, step_of: Optional[list] = None) -> None:
    """Write chart.png. ``rows``: the number of sequences of each microbatch of the stream, in order;
    ``passes``: the timed passes; ``ratios``: ``report.speedups``; ``step_of``: each microbatch's
    training step (dashed lines where a new one begins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 9))
    grid = fig.add_gridspec(2, 3, height_ratios=[1.15, 1])
    _stream_panel(fig.add_subplot(grid[0, :]), results, rows, passes, step_of)
    _median_panel(fig.add_subplot(grid[1, 0]), results, ratios)
    _first_call_panel(fig.add_subplot(grid[1, 1]), results)
    _steps_panel(fig.add_subplot(grid[1, 2]), results)
    fig.suptitle(f"nn_data per microbatch by mode: {WHAT_RUNS}; milliseconds, lower is better\n{subtitle}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
