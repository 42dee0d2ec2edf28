"""Tier: pure CPU (reads source files; one subprocess runs every benchmark's ``--help``).

profiling/ as three tools (profiling/README.md): the main job in profiling/microbatches,
the benchmarks in profiling/bench named ``bench_<subject>.py``, the GPU check in
profiling/gpu_check, shared code at the top, their dated figures in profiling/results (one page per
subject, listed in profiling/results/README.md); every benchmark answers ``--help`` when run as
``python -m profiling.bench.bench_<subject>``, and none reads a clock itself: timing goes through
``profiling.timing``, the one timer.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROFILING = ROOT / "profiling"
BENCHES = sorted(p.stem for p in (PROFILING / "bench").glob("*.py") if p.name != "__init__.py")
CLOCKS = {"perf_counter", "perf_counter_ns", "process_time", "process_time_ns", "monotonic", "monotonic_ns",
          "time", "time_ns", "thread_time"}


def test_profiling_is_three_tools_and_shared_code():
    top = sorted(p.name for p in PROFILING.iterdir() if not p.name.startswith((".", "__pycache__"))
                 and p.name not in ("runs", "gpu_runs"))
    assert top == ["README.md", "__init__.py", "bench", "gpu_check", "microbatches", "results", "timing.py"]
    assert all(p.suffix == ".md" for p in (PROFILING / "results").iterdir()), "results/ holds figure pages only"
    for tool in ("microbatches", "gpu_check"):
        assert (PROFILING / tool / "__main__.py").is_file(), f"python -m profiling.{tool} needs a __main__.py"
    assert BENCHES and all(name.startswith("bench_") for name in BENCHES), BENCHES


def test_every_results_page_is_listed_and_linked_from_its_tool():
    """profiling/results/<subject>.md: listed in results/README.md, linked from profiling/README.md."""
    pages = sorted(p.name for p in (PROFILING / "results").glob("*.md") if p.name != "README.md")
    listed = sorted(set(re.findall(r"\]\(([\w.-]+\.md)\)", (PROFILING / "results" / "README.md").read_text())))
    assert pages and listed == pages, f"results/README.md lists {listed}; results/ holds {pages}"
    manual = (PROFILING / "README.md").read_text()
    assert [p for p in pages if f"](results/{p})" not in manual] == [], "link each page from its tool's section"


def test_the_manual_holds_no_dated_figure():
    """Dated figures live in profiling/results/, not in profiling/README.md (no date in it)."""
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", (PROFILING / "README.md").read_text())
    assert dates == [], f"move the figures of {dates} to profiling/results/<subject>.md"


def _clock_reads(path: Path) -> list[str]:
    """``import time`` / ``from time import ...`` of a clock, and ``time.<clock>`` attribute reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"from time import {a.name}" for a in node.names if a.name in CLOCKS]
        if (isinstance(node, ast.Attribute) and node.attr in CLOCKS and isinstance(node.value, ast.Name)
                and node.value.id == "time"):
            found.append(f"time.{node.attr} (line {node.lineno})")
    return found


@pytest.mark.parametrize("folder", ["bench", "microbatches"])
def test_no_benchmark_reads_a_clock_itself(folder):
    offenders = {p.name: _clock_reads(p) for p in sorted((PROFILING / folder).glob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}, "time through profiling.timing instead"


def test_the_clock_check_sees_a_direct_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import time\nfrom time import perf_counter\nstart = time.process_time()\n")
    assert _clock_reads(probe) == ["from time import perf_counter", "time.process_time (line 3)"]


def test_every_benchmark_has_a_help_that_runs():
    """Each ``python -m profiling.bench.<name> --help``, in one fresh process (torch imported once)."""
    script = (
        "import contextlib, io, runpy, sys\n"
        "for name in sys.argv[1:]:\n"
        "    sys.argv = [name, '--help']\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            runpy.run_module('profiling.bench.' + name, run_name='__main__', alter_sys=True)\n"
        "        code = 'no exit'\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    print(name, code, 'usage:' in out.getvalue(), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *BENCHES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.split(" ")[0] in BENCHES]
    assert lines == [f"{name} 0 True" for name in BENCHES], done.stdout + done.stderr[-3000:]
