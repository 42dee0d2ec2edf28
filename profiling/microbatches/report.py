"""What ``profiling.microbatches`` prints and keeps: one table, the speed-up ratios, the targets and
summary.json (the chart is ``profiling.microbatches.chart``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from profiling.microbatches.measure import ModeResult

_MIB = 1024 * 1024


def _opt(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def _share(part: Optional[float], whole: Optional[float]) -> Optional[float]:
    return None if part is None or not whole else part / whole


def format_table(results: list[ModeResult]) -> str:
    """The table, one row per mode (times in ms, except the first call in s; ``step std`` is the
    standard deviation of the time per training step as a share of its mean)."""
    head = (f"{'mode':<16} {'first call s':>12} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'mean ms':>8} "
            f"{'step ms':>8} {'step std':>8} {'tokens/s':>10} {'ops/mb':>7} {'graphs':>6} {'recompiles':>10} "
            f"{'breaks':>6} {'syncs/mb':>8} {'peak MiB':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        syncs = f"{r.syncs_per_microbatch:.1f}"
        if r.cuda_syncs_per_microbatch is not None:
            syncs += f"/{r.cuda_syncs_per_microbatch:.1f}"
        lines.append(
            f"{r.name:<16} {r.first_s:>12.2f} {r.median_s * 1e3:>10.2f} {r.p10_s * 1e3:>8.2f} "
            f"{r.p90_s * 1e3:>8.2f} {r.mean_s * 1e3:>8.2f} {_opt(_ms(r.step_mean_s), '.2f'):>8} "
            f"{_opt(_share(r.step_std_s, r.step_mean_s), '.1%'):>8} {r.tokens_per_s:>10.3g} {r.ops_per_microbatch:>7.0f} "
            f"{_opt(r.graphs, 'd'):>6} "
            f"{_opt(r.recompiles, 'd'):>10} {_opt(r.graph_breaks, 'd'):>6} {syncs:>8} "
            f"{_opt(None if r.peak_bytes is None else r.peak_bytes / _MIB, '.1f'):>8}"
        )
    return "\n".join(lines)


def speedups(results: list[ModeResult]) -> dict[str, float]:
    """``"<fast> vs <slow> (median|mean)"``: the latency of ``slow`` over that of ``fast`` per
    microbatch (> 1: fast is faster), for every compiled mode against eager and loop, and eager
    against the loop. The median is the typical microbatch; the mean is the whole stream's time per
    microbatch."""
    by_name = {r.name: r for r in results}
    out = {}
    for fast, slow in (("compiled", "eager"), ("compiled", "loop"), ("reduce-overhead", "eager"),
                       ("reduce-overhead", "loop"), ("eager", "loop")):
        if fast in by_name and slow in by_name:
            for stat in ("median", "mean"):
                out[f"{fast} vs {slow} ({stat})"] = (getattr(by_name[slow], f"{stat}_s")
                                                     / getattr(by_name[fast], f"{stat}_s"))
    return out


def targets(results: list[ModeResult], ratios: dict[str, float],
            model_syncs: float = 0.0, steps: int = 1, packed_lengths: int = 1) -> list[tuple[str, Optional[bool]]]:
    """The targets for the ``compiled`` and ``eager`` modes, each met (True), missed (False) or not run
    (None). ``model_syncs``: host syncs per microbatch of a real model's own eager forward (not the
    data path's); ``steps``, ``packed_lengths``: training steps in the stream and distinct packed lengths ``T``."""
    by_name = {r.name: r for r in results}
    c = by_name.get("compiled")
    if c is None:
        return [("compiled mode run", False)]
    e = by_name.get("eager")
    eager = [] if e is None else [
        ("eager: at most 1 host sync per microbatch" + (f" beyond the model's own {model_syncs:g}" if model_syncs else ""),
         e.syncs_per_microbatch <= 1 + model_syncs),
        ("eager at least as fast as the loop per microbatch (median)",
         None if "eager vs loop (median)" not in ratios else ratios["eager vs loop (median)"] >= 1),
    ]
    checks = eager + [
        ("compiled: 0 recompiles after the first microbatch", c.recompiles == 0),
        (f"compiled: one packed length and 0 recompiles across {steps} steps", packed_lengths == 1
         and c.recompiles == 0) if steps > 1 else ("compiled: one packed length across steps (1 step)", None),
        ("compiled: 0 host syncs per microbatch" + (f" beyond the model's own {model_syncs:g}" if model_syncs else ""),
         c.syncs_per_microbatch == model_syncs and (not c.cuda_syncs_per_microbatch or bool(model_syncs))),
    ]
    for slow in ("eager", "loop"):
        for stat in ("median", "mean"):
            key = f"compiled vs {slow} ({stat})"
            checks.append((f"compiled faster than {slow} per microbatch ({stat})",
                           None if key not in ratios else ratios[key] > 1))
    key = "compiled vs loop (median)"
    measured = f" (measured {ratios[key]:.2f}x)" if key in ratios else ""
    checks.append((f"compiled at least 2x faster than the loop per microbatch (median){measured}",
                   None if key not in ratios else ratios[key] >= 2))
    return checks


def format_report(results: list[ModeResult], ratios: dict[str, float], checks) -> str:
    lines = [format_table(results), ""]
    lines += [f"speed-up {name}: {value:.2f}x" for name, value in ratios.items()]
    lines += [f"target  {'met' if ok else ('not run' if ok is None else 'MISSED')}: {text}" for text, ok in checks]
    missed = sum(ok is False for _, ok in checks)
    lines.append(f"targets: {sum(ok is True for _, ok in checks)} met, {missed} MISSED, "
                 f"{sum(ok is None for _, ok in checks)} not run (a missed target is reported, not an error: "
                 "the exit status is 0 unless the run itself fails; docs/testing.md)")
    return "\n".join(lines)


def write_summary(path: str, *, header: dict, results: list[ModeResult], ratios, checks) -> dict:
    """Write and return the summary: the run's header, each mode's figures, ratios and targets."""
    summary = dict(header)
    summary["modes"] = [dataclasses.asdict(r) for r in results]
    summary["speedups"] = ratios
    summary["targets"] = [{"target": text, "met": ok} for text, ok in checks]
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary
