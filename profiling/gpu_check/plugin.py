"""pytest plugin for ``profiling.gpu_check``: one JSON line per test outcome, written as each test
ends (a step killed at its time limit still leaves what ran), to ``$NN_DATA_GPU_CHECK_REPORT``.

Outcomes: ``passed``, ``failed``, ``error`` (set-up or tear-down failed), ``skipped`` (with the
reason), ``xfailed`` (a known failure; ``reason`` is its mark's), ``xpassed``.

    NN_DATA_GPU_CHECK_REPORT=tests.jsonl python -m pytest -p profiling.gpu_check.plugin tests/cuda
"""

from __future__ import annotations

import json
import os


def _message(report) -> str:
    """The short reason of a failure or skip: the exception line, or the skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # skip: (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(longrepr or "").strip().splitlines()[-1] if longrepr else ""


def _outcome(report) -> str | None:
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None  # a set-up or tear-down that passed: the call phase reports the test


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("NN_DATA_GPU_CHECK_REPORT")
    outcome = _outcome(report)
    if not path or outcome is None:
        return
    record = dict(test=report.nodeid, outcome=outcome, phase=report.when, seconds=round(report.duration, 3),
                  message=_message(report) if outcome != "passed" else "",
                  reason=getattr(report, "wasxfail", ""))
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
