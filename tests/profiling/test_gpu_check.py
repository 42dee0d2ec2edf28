"""Tier: pure CPU, single process, no compile (the judging functions on hand-made step outputs).

How profiling.gpu_check judges what its steps report: every check is PASS or FAIL, or not
checked with its reason; a skip that hides a CUDA step on a GPU fails; a missing package is
never a pass. The steps themselves run in CI as ``bash scripts/gpu_check.sh --dry-run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.gpu_check import run as gpu_check
from profiling.gpu_check.checks import (
    FAIL, KNOWN, NOT_CHECKED, PASS, bench_checks, graph_checks, profiler_checks, tier_checks, trace_checks,
)


def _report(tmp_path, *records):
    path = tmp_path / "tests.jsonl"
    path.write_text("".join(json.dumps({**dict(phase="call", seconds=0.1, reason="", message=""), **r}) + "\n"
                            for r in records))
    return str(path)


def _status(checks):
    return {c.name.removeprefix("test "): c.status for c in checks}


def test_test_outcomes_map_to_checks(tmp_path):
    path = _report(
        tmp_path,
        dict(test="t.py::test_ok", outcome="passed"),
        dict(test="t.py::test_bad", outcome="failed", message="AssertionError: 2 graphs"),
        dict(test="t.py::test_known", outcome="xfailed", reason="known: a symbolic S", message="RuntimeError: recompile"),
        dict(test="t.py::test_fixed", outcome="xpassed", reason="known: a symbolic S"),
        dict(test="t.py::test_pkg", outcome="skipped", message="megatron-core not installed"),
        dict(test="t.py::test_graphs", outcome="skipped", message="dry run: CUDA-graph recording needs CUDA"),
        dict(test="t.py::test_tier", outcome="skipped", message="needs CUDA (GPU-only tier)"),
        dict(test="t.py::test_setup", outcome="error", message="RuntimeError: CUDA error"),
    )
    dry = _status(tier_checks(path, 1, cuda=False, timed_out=False))
    assert dry == {"test_ok": PASS, "test_bad": FAIL, "test_known": KNOWN, "test_fixed": PASS, "test_pkg": NOT_CHECKED,
                   "test_graphs": NOT_CHECKED, "test_tier": FAIL, "test_setup": FAIL}
    gpu = tier_checks(path, 1, cuda=True, timed_out=False)
    assert _status(gpu)["test_graphs"] == FAIL  # a CUDA-only assertion skipped while a GPU is present
    pkg = next(c for c in gpu if c.name.endswith("test_pkg"))
    assert pkg.detail == "skipped: megatron-core not installed" and pkg.line().startswith("SKIPPED (not checked)")
    assert next(c for c in gpu if c.name.endswith("test_known")).line().startswith("FAIL (known)")
    assert "remove the mark" in next(c for c in gpu if c.name.endswith("test_fixed")).detail


def test_a_step_that_did_not_finish_or_reported_nothing_fails(tmp_path):
    path = _report(tmp_path, dict(test="t.py::test_ok", outcome="passed"))
    assert tier_checks(path, None, cuda=True, timed_out=True)[-1].status == FAIL
    assert [c.status for c in tier_checks(str(tmp_path / "none.jsonl"), 4, cuda=True, timed_out=False)] == [FAIL]


def test_run_kind_fails_loudly_where_cuda_steps_would_be_skipped():
    assert gpu_check.run_kind_check(dry=True, cuda=True).status == FAIL
    assert gpu_check.run_kind_check(dry=False, cuda=False).status == FAIL
    assert gpu_check.run_kind_check(dry=True, cuda=False).status == PASS


def _bench_row(mode, **kw):
    return {**dict(op="pack", B=8, S=64, mode=mode, us=1.0, syncs=0, cuda_syncs=0, captures=None), **kw}


def test_bench_checks():
    rows = [_bench_row("reference", syncs=9), _bench_row("compiled"), _bench_row("floor")]
    assert {c.status for c in bench_checks(rows, cuda=False)} == {PASS, NOT_CHECKED}
    on_gpu = _status(bench_checks(rows, cuda=True))
    assert on_gpu["bench: cudagraph mode ran"] == FAIL  # the GPU run must have the captured mode
    syncing = [_bench_row("compiled", cuda_syncs=1), _bench_row("cudagraph", captures=2)]
    assert [c.status for c in bench_checks(syncing, cuda=True)].count(FAIL) == 2
    assert [c.status for c in bench_checks(None, cuda=True)] == [FAIL]
    failed_capture = dict(op="pack", B=8, S=64, mode="cudagraph", error="RuntimeError: operation not permitted")
    ran = bench_checks(rows + [failed_capture], cuda=True)[0]
    assert ran.status == FAIL and "operation not permitted" in ran.detail


def test_profiler_checks_judge_speed_only_on_cuda():
    summary = dict(outputs_max_abs_difference=0.0, speedups={}, modes=[dict(name="compiled")],
                   targets=[dict(target="compiled: 0 recompiles after the first microbatch", met=True),
                            dict(target="compiled faster than loop per microbatch (mean)", met=False),
                            dict(target="eager at least as fast as the loop per microbatch (median)", met=False),
                            dict(target="eager: at most 1 host sync per microbatch", met=False)])
    dry = _status(profiler_checks(summary, cuda=False))
    assert dry["profiler target: compiled faster than loop per microbatch (mean)"] == NOT_CHECKED
    assert dry["profiler target: eager at least as fast as the loop per microbatch (median)"] == NOT_CHECKED
    assert dry["profiler target: eager: at most 1 host sync per microbatch"] == FAIL  # a sync count, not a speed
    gpu = _status(profiler_checks(summary, cuda=True))
    assert gpu["profiler target: compiled faster than loop per microbatch (mean)"] == FAIL
    assert gpu["profiler: reduce-overhead replays CUDA graphs without syncs"] == FAIL  # the mode did not run
    assert [c.status for c in profiler_checks(None, cuda=True)] == [FAIL]


def _ro_summary(ro_median_s, loop_vs_ro, **ro):
    mode = dict(name="reduce-overhead", median_s=ro_median_s, cudagraph_skips=0, recompiles=0, syncs_per_microbatch=0.0,
                cuda_syncs_per_microbatch=0.0)
    return dict(outputs_max_abs_difference=0.0, targets=[], speedups={"reduce-overhead vs loop (median)": loop_vs_ro},
                modes=[dict(name="compiled", median_s=1.0e-3), {**mode, **ro}])


def test_reduce_overhead_is_judged_against_compiled_and_the_loop_by_median():
    ro = "profiler: reduce-overhead replays CUDA graphs without syncs"
    vs_loop = "profiler target: reduce-overhead at least 4x faster than the loop per microbatch (median)"
    vs_compiled = "profiler target: reduce-overhead faster than compiled per microbatch (median)"
    checks = {c.name: c for c in profiler_checks(_ro_summary(0.4e-3, 5.7), cuda=True)}
    assert [checks[n].status for n in (ro, vs_loop, vs_compiled)] == [PASS] * 3
    assert checks[vs_loop].detail == "5.70x" and checks[vs_compiled].detail == "2.50x"
    slow = _status(profiler_checks(_ro_summary(1.2e-3, 3.9), cuda=True))
    assert slow[vs_loop] == FAIL and slow[vs_compiled] == FAIL
    syncing = {c.name: c for c in profiler_checks(_ro_summary(0.4e-3, 5.7, cuda_syncs_per_microbatch=1.0), cuda=True)}
    assert syncing[ro].status == FAIL and syncing[ro].detail == "cuda_syncs_per_microbatch=1.0"
    assert vs_loop not in _status(profiler_checks(_ro_summary(0.4e-3, 5.7), cuda=False))  # CUDA graphs need CUDA


def _graphs(**kw):
    base = dict(rows=64, seq_len=32, total=2048, microbatches=16, device="cuda", graph_vs_eager_speedup=4.1,
                max_abs_difference={"staged": 0.0, "graph": 0.0, "graph (steady state)": 0.0}, graph_syncs=0,
                graph_sync_locations=[], graph_new_allocations=0)
    return {**base, **kw}


def test_graph_checks_judge_replay_and_speed_only_on_cuda():
    assert [c.status for c in graph_checks(None, cuda=False)] == [FAIL]
    dry = graph_checks(_graphs(device="cpu", graph_vs_eager_speedup=None, max_abs_difference={"staged": 0.0}),
                       cuda=False)
    assert [c.status for c in dry] == [PASS, PASS, NOT_CHECKED, NOT_CHECKED]
    assert [c.status for c in graph_checks(_graphs(), cuda=True)] == [PASS] * 4
    slow = graph_checks(_graphs(graph_vs_eager_speedup=2.5), cuda=True)
    assert slow[-1].status == FAIL and "3x faster" in slow[-1].name and slow[-1].detail == "2.50x"
    syncing = graph_checks(_graphs(graph_syncs=1, graph_sync_locations=["staging.py:90"]), cuda=True)
    assert syncing[2].status == FAIL and "staging.py:90" in syncing[2].detail
    assert graph_checks(_graphs(graph_new_allocations=3), cuda=True)[2].status == FAIL
    unequal = _graphs(max_abs_difference={"staged": 0.5, "graph (steady state)": 0.0})
    assert graph_checks(unequal, cuda=True)[1].status == FAIL
    no_graph = graph_checks(_graphs(max_abs_difference={"staged": 0.0}), cuda=True)
    assert [c.status for c in no_graph][2:] == [FAIL, FAIL]


def test_traces_without_the_profiler_plugin_are_not_checked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tb_profiler", None)  # import fails as if not installed
    (check,) = trace_checks(str(tmp_path), ["compiled"], cuda=True)
    assert check.status == NOT_CHECKED and check.detail.startswith("skipped: torch-tb-profiler not installed")


@pytest.mark.parametrize("argv", [["--steps", "fast"], ["--budget-s", "x"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2


ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_without_a_python_that_has_torch_says_what_to_run():
    env = {**os.environ, "PYTHON": "false"}  # an interpreter that cannot import torch
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr
    assert "false has no torch" in run.stderr and "--dry-run" in run.stderr
    assert "ModuleNotFoundError" not in run.stderr
