"""Tier: pure CPU (each page's blocks run in one fresh interpreter, a subprocess; seconds).

Every python block of ``README.md`` and ``docs/*.md`` whose info string is exactly ``python`` runs as
written, each in a fresh namespace; a block marked ``python fragment`` (it needs a model, a GPU, a
process group, or names defined elsewhere) is skipped. The convention is in docs/testing.md,
"Runnable docs".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^`\s]*)\s*(.*?)\s*$")
RUNNABLE, FRAGMENT = "python", "python fragment"


class Block(NamedTuple):
    page: str
    line: int  # 1-based line of the opening fence
    info: str  # the info string: "python", "python fragment", "bash", ...
    code: str


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` (indented fences too: a block inside a list item)."""
    found, open_fence, start, info, body = [], None, 0, "", []
    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        match = FENCE.match(line)
        if open_fence is None:
            if match:
                indent, fence, lang, rest = match.groups()
                open_fence, start, info, body = (indent, fence), number, " ".join(filter(None, [lang, rest])), []
        elif match and match.group(2).startswith(open_fence[1]) and not match.group(3):
            found.append(Block(page, start, info, "\n".join(body)))
            open_fence = None
        else:
            indent = open_fence[0]
            body.append(line[len(indent):] if line.startswith(indent) else line)
    assert open_fence is None, f"{page}:{start}: a code block is never closed"
    return found


# Runs each block of one page in a fresh namespace, in this one interpreter; prints one JSON line per
# block: its stdout and, if it raised, the traceback.
RUNNER = r"""
import contextlib, io, json, sys, traceback
for source, name in json.load(sys.stdin):
    out, error = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(source, name, "exec"), {"__name__": "__main__"})
        except BaseException:
            error = traceback.format_exc()
    print(json.dumps({"name": name, "stdout": out.getvalue(), "error": error}), flush=True)
"""


def run_page(page: str) -> dict[str, dict]:
    """Every runnable block of ``page``: ``{"<page>:<line>": {"stdout", "error"}}``."""
    runnable = [b for b in blocks(page) if b.info == RUNNABLE]
    if not runnable:
        return {}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([(b.code, f"{page}:{b.line}") for b in runnable]),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results = {r["name"]: r for r in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert len(results) == len(runnable), f"{page}: the runner stopped (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return results


@pytest.fixture(scope="module")
def readme_results():
    return run_page("README.md")


@pytest.mark.parametrize("page", [p for p in PAGES if p != "README.md"])
def test_every_runnable_python_block_of_a_docs_page_runs_as_written(page):
    failed = {name: r["error"] for name, r in run_page(page).items() if r["error"]}
    assert not failed, "\n\n".join(f"{name} raised:\n{error}" for name, error in failed.items())


def test_every_runnable_python_block_of_the_readme_runs_as_written(readme_results):
    assert len(readme_results) >= 2
    failed = {name: r["error"] for name, r in readme_results.items() if r["error"]}
    assert not failed, "\n\n".join(f"{name} raised:\n{error}" for name, error in failed.items())


def test_the_readmes_first_code_block_is_the_runnable_quickstart_and_prints_what_it_says(readme_results):
    first = blocks("README.md")[0]
    assert first.info == RUNNABLE, f"README.md:{first.line}: the first code block is {first.info!r}, not runnable python"
    printed = readme_results[f"README.md:{first.line}"]["stdout"]
    assert "[[11, 12, 13,  0, 21, 22,  0,  0, 31, 32, 33, 34, 35,  0,  0,  0]]" in printed
    assert "tensor([[11,  0, 21,  0, 31, 32,  0,  0]])" in printed
    assert printed.splitlines()[-1] == "True"


def test_the_readmes_nemo_rl_drop_in_prints_the_fields_it_quotes(readme_results):
    dropin = next(b for b in blocks("README.md") if "process_microbatch(" in b.code)
    assert dropin.info == RUNNABLE
    printed = readme_results[f"README.md:{dropin.line}"]["stdout"].splitlines()
    assert printed == ["[[5, 6, 7, 0, 8, 9, 1, 2, 3, 4]] [0, 4, 6, 10]", "thd 4",
                       "[[1, 2, 3, 4, 5, 6, 7]] [0, 4, 7] 4", "[[8, 9]] [0, 2] 2"]


def test_every_python_block_is_marked_runnable_or_fragment():
    """A typo in the marker (``python fragments``, ``py``) would silently skip a block."""
    odd = [f"{b.page}:{b.line} {b.info!r}" for page in PAGES for b in blocks(page)
           if b.info.split(" ")[0] in {"python", "py", "python3"} and b.info not in {RUNNABLE, FRAGMENT}]
    assert not odd, odd


def test_the_block_parser_reads_info_strings_and_indented_fences(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("x\n```python\nprint(1)\n```\n1. item\n   ```python fragment\n   model(x)\n   ```\n~~~bash\nls\n~~~\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert blocks("page.md") == [Block("page.md", 2, "python", "print(1)"),
                                 Block("page.md", 6, "python fragment", "model(x)"),
                                 Block("page.md", 9, "bash", "ls")]
