"""Turn the outputs of ``gpu_check``'s steps into checks: one line each, PASS or FAIL, or not
checked with the reason (a missing package, or a CUDA-only assertion in the CPU dry run).

Statuses
    PASS            checked and holds
    FAIL            checked and does not hold, or could not run (the run exits 1)
    KNOWN FAIL      a test marked as failing until an open issue lands (printed as FAIL; the
                    run does not exit 1 for it)
    NOT CHECKED     skipped: a package is missing, or (dry run) the assertion needs CUDA
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

PASS, FAIL, KNOWN, NOT_CHECKED = "PASS", "FAIL", "KNOWN FAIL", "NOT CHECKED"


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str = ""

    def line(self) -> str:
        head = {KNOWN: "FAIL (known)", NOT_CHECKED: "SKIPPED (not checked)"}.get(self.status, self.status)
        return f"{head:<22} {self.name}" + (f": {self.detail}" if self.detail else "")


def tier_checks(report_path: str, rc: Optional[int], *, cuda: bool, timed_out: bool) -> list[Check]:
    """One check per test of the CUDA tier (from the plugin's JSON lines), plus one for the run."""
    records = []
    if os.path.exists(report_path):
        with open(report_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    checks = [_test_check(r, cuda) for r in records]
    if timed_out:
        checks.append(Check("tests: the CUDA tier finished", FAIL,
                            f"killed at its time limit after {len(records)} tests"))
    elif rc not in (0, 1) or not records:
        checks.append(Check("tests: the CUDA tier ran", FAIL, f"pytest exit code {rc}, {len(records)} tests reported"))
    return checks


def _test_check(record: dict, cuda: bool) -> Check:
    name = "test " + record["test"].split("::", 1)[-1]
    outcome, message = record["outcome"], _short(record["message"])
    if outcome == "passed":
        return Check(name, PASS)
    if outcome == "xpassed":
        return Check(name, PASS, f"passes now although marked ({record['reason']}): remove the mark")
    if outcome == "xfailed":
        return Check(name, KNOWN, f"{record['reason']}; {_short(message, 200)}")
    if outcome == "skipped":
        if "not installed" in message:
            return Check(name, NOT_CHECKED, f"skipped: {message}")
        if message.startswith("dry run:") and not cuda:
            return Check(name, NOT_CHECKED, message)
        return Check(name, FAIL, f"skipped although it should have run here: {message}")
    return Check(name, FAIL, f"{outcome}: {message}")


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bench_checks(results: Optional[list], *, cuda: bool) -> list[Check]:
    """The op benchmark: it ran for every op and B; compiled (and captured) ops never sync;
    on CUDA every op was captured once and replayed."""
    if not results:
        return [Check("bench: the op benchmark ran", FAIL, "no results (see bench.log)")]
    errors = [f"{r['op']} B={r['B']} {r['mode']}: {r['error']}" for r in results if "error" in r]
    checks = [Check("bench: the op benchmark ran", FAIL if errors else PASS,
                    _short("; ".join(errors)) if errors else f"{len(results)} rows")]
    results = [r for r in results if "error" not in r]
    for mode in ("compiled", "cudagraph"):
        rows = [r for r in results if r["mode"] == mode]
        if mode == "cudagraph" and not cuda:
            checks.append(Check("bench: compiled op captured in a CUDA graph once and replayed", NOT_CHECKED,
                                "dry run: CUDA graphs need CUDA"))
            continue
        if not rows:
            checks.append(Check(f"bench: {mode} mode ran", FAIL, "no rows"))
            continue
        syncing = [f"{r['op']} B={r['B']}: {r['syncs']}/{r['cuda_syncs']}" for r in rows
                   if r["syncs"] or r.get("cuda_syncs")]
        checks.append(Check(f"bench: {mode} ops make 0 host syncs per call", FAIL if syncing else PASS,
                            "; ".join(syncing)))
        if mode == "cudagraph":
            bad = [f"{r['op']} B={r['B']}: {r['captures']}" for r in rows if r["captures"] != 1]
            checks.append(Check("bench: compiled op captured in a CUDA graph once and replayed", FAIL if bad else PASS,
                                "captures " + "; ".join(bad) if bad else f"{len(rows)} ops x B, 1 capture each"))
    return checks


def profiler_checks(summary: Optional[dict], *, cuda: bool) -> list[Check]:
    """The profiler's main job: its own targets, plus (CUDA) reduce-overhead's CUDA graphs."""
    if not summary:
        return [Check("profiler: the main job ran", FAIL, "no summary.json (see profiler.log)")]
    modes = {m["name"]: m for m in summary["modes"]}
    checks = [Check("profiler: the main job ran", PASS, f"modes {', '.join(modes)}; outputs agree across modes "
                    f"(max |difference| {summary['outputs_max_abs_difference']:.1e})")]
    for target in summary["targets"]:
        met, text = target["met"], target["target"]
        if ("faster" in text or "as fast as" in text) and not cuda:  # a speed target
            checks.append(Check(f"profiler target: {text}", NOT_CHECKED, "dry run: speed is not judged on the CPU"))
        else:
            checks.append(Check(f"profiler target: {text}", PASS if met else FAIL, "not run" if met is None else ""))
    ro = modes.get("reduce-overhead")
    if not cuda:
        checks.append(Check("profiler: reduce-overhead replays CUDA graphs without syncs", NOT_CHECKED,
                            "dry run: CUDA graphs need CUDA"))
    elif ro is None:
        checks.append(Check("profiler: reduce-overhead replays CUDA graphs without syncs", FAIL, "mode not run"))
    else:
        bad = {k: ro[k] for k in ("cudagraph_skips", "recompiles", "syncs_per_microbatch", "cuda_syncs_per_microbatch")
               if ro[k]}
        checks.append(Check("profiler: reduce-overhead replays CUDA graphs without syncs", FAIL if bad else PASS,
                            ", ".join(f"{k}={v}" for k, v in bad.items())))
        ratio = summary["speedups"].get("reduce-overhead vs loop (median)")
        checks.append(Check(f"profiler target: reduce-overhead at least {RO_VS_LOOP_TARGET:g}x faster than the loop per "
                            "microbatch (median)", PASS if ratio and ratio >= RO_VS_LOOP_TARGET else FAIL,
                            f"{ratio:.2f}x" if ratio else "no ratio"))
        compiled = modes.get("compiled")
        vs_compiled = compiled["median_s"] / ro["median_s"] if compiled and ro["median_s"] else None
        checks.append(Check("profiler target: reduce-overhead faster than compiled per microbatch (median)",
                            PASS if vs_compiled and vs_compiled > 1 else FAIL,
                            f"{vs_compiled:.2f}x" if vs_compiled else "no compiled mode"))
    return checks


#: reduce-overhead vs the loop, by median (profiling/README.md, "The GPU check", says why not 20x by mean).
RO_VS_LOOP_TARGET = 4.0


def trace_checks(run_dir: str, modes: list, *, cuda: bool) -> list[Check]:
    """Each mode's trace loads in torch-tb-profiler (in-process parse, as its plugin does) and
    shows its views; on CUDA the Kernel view (GPU kernels) too."""
    name = "profiler: traces load in torch-tb-profiler" + (" with GPU kernels" if cuda else "")
    try:
        from torch_tb_profiler.profiler.data import RunProfileData
        from torch_tb_profiler.profiler.run_generator import RunGenerator
    except ImportError as error:
        return [Check(name, NOT_CHECKED, f"skipped: torch-tb-profiler not installed ({error})")]
    import glob
    import tempfile

    problems, seen = [], []
    with tempfile.TemporaryDirectory() as cache:
        for mode in modes:
            paths = sorted(glob.glob(os.path.join(run_dir, mode, "*.pt.trace.json*")))
            if not paths:
                problems.append(f"{mode}: no trace")
                continue
            try:
                data = RunProfileData.parse(mode, None, paths[-1], cache)
                views = [v.display_name for v in RunGenerator(mode, None, data).generate_run_profile().views]
            except Exception as error:  # noqa: BLE001 - any parse failure is the finding
                problems.append(f"{mode}: {type(error).__name__}: {error}")
                continue
            seen.append(f"{mode} ({'/'.join(views)})")
            if cuda and "Kernel" not in views:
                problems.append(f"{mode}: no GPU kernels in the trace")
    return [Check(name, FAIL if problems else PASS, "; ".join(problems) if problems else ", ".join(seen))]


#: The speed target of the graphs step (issue: replay of data path + forward vs eager at B = 64).
GRAPH_SPEEDUP_TARGET = 3.0


def graph_checks(result: Optional[dict], *, cuda: bool) -> list[Check]:
    """The CUDA-graph benchmark (profiling/bench/bench_cuda_graph.py): it ran; the staged path equals
    eager; on CUDA the captured graph replays the stream equal to eager with no host sync and no new
    allocation, at least :data:`GRAPH_SPEEDUP_TARGET` times faster than eager per microbatch."""
    if not result:
        return [Check("graphs: the CUDA-graph benchmark ran", FAIL, "no results (see graphs.log)")]
    diffs = result["max_abs_difference"]
    checks = [Check("graphs: the CUDA-graph benchmark ran", PASS,
                    f"B = {result['rows']}, S = {result['seq_len']}, T = {result['total']}, "
                    f"{result['microbatches']} microbatches"),
              Check("graphs: staged microbatches equal the eager path", PASS if diffs["staged"] <= 1e-5 else FAIL,
                    f"max |difference| {diffs['staged']:.1e}")]
    replay = "graphs: a graph captured once replays the stream equal to eager, 0 host syncs, 0 new allocations"
    target = (f"graphs target: graph replay of data path + forward at least {GRAPH_SPEEDUP_TARGET:g}x faster than "
              f"eager per microbatch (median, B = {result['rows']})")
    if not cuda:
        return checks + [Check(replay, NOT_CHECKED, "dry run: CUDA graphs need CUDA"),
                         Check(target, NOT_CHECKED, "dry run: speed is not judged on the CPU")]
    if "graph (steady state)" not in diffs:
        return checks + [Check(replay, FAIL, "the graph mode did not run"), Check(target, FAIL, "no graph timing")]
    bad = diffs["graph (steady state)"] > 1e-5 or result["graph_syncs"] or result["graph_new_allocations"]
    checks.append(Check(replay, FAIL if bad else PASS,
                        f"max |difference| {diffs['graph (steady state)']:.1e}, {result['graph_syncs']} syncs "
                        f"{result['graph_sync_locations'][:3]}, {result['graph_new_allocations']} new allocations"))
    speedup = result["graph_vs_eager_speedup"]
    checks.append(Check(target, PASS if speedup >= GRAPH_SPEEDUP_TARGET else FAIL, f"{speedup:.2f}x"))
    return checks
