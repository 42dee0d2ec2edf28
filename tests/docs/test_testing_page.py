"""Tier: pure CPU (reads the test files, docs/testing.md and pyproject.toml; imports nothing heavy).

docs/testing.md stays true of the tree: every ``test_*.py`` under tests/ states one tier of a fixed
vocabulary in its module docstring's first line (``Tier: <tier>``), the tier agrees with where the
file lives and how it is marked, the page's folder table lists exactly the folders under tests/,
and its tier table names exactly these tiers and the markers pyproject.toml registers.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PAGE = ROOT / "docs" / "testing.md"

PURE_CPU, MULTIPROCESS, GPU_ONLY = "pure CPU", "CPU multi-process over gloo", "GPU-only"
TIERS = (PURE_CPU, MULTIPROCESS, GPU_ONLY)
# "Tier: pure CPU", then the end of the line, a comma, a full stop, a semicolon or " (".
TIER_LINE = re.compile(r"^Tier: (" + "|".join(map(re.escape, TIERS)) + r")(?=$|[,.;]| \()")
TIER_FOLDERS = {MULTIPROCESS: "multiprocess", GPU_ONLY: "cuda"}  # a tier with a folder of its own


def collect_test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def first_docstring_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return doc.splitlines()[0] if doc else ""


def tier_of(line: str) -> str | None:
    match = TIER_LINE.match(line)
    return match.group(1) if match else None


def module_marks(path: Path) -> str:
    """The source of the module-level ``pytestmark = ...`` assignment ('' if none)."""
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return ast.get_source_segment(source, node) or ""
    return ""


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown page."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/testing.md has no '## {heading}' section"
    return match.group(1)


def table_column(body: str, column: int) -> list[str]:
    """Cell ``column`` of every row of the first markdown table in ``body`` (header and rule left out)."""
    rows = [line for line in body.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    assert len(cells) > 2 and set(cells[1][0]) <= set("-: "), "no markdown table in the section"
    return [row[column] for row in cells[2:]]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_there_are_test_files_to_check():
    assert len(collect_test_files()) >= 40


@pytest.mark.parametrize("path", collect_test_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_every_test_file_states_its_tier_first(path):
    line = first_docstring_line(path)
    assert tier_of(line), (f"{path.relative_to(ROOT)}: the module docstring's first line must be "
                           f"'Tier: <tier>' with <tier> one of {TIERS}; it is {line!r}")


@pytest.mark.parametrize("path", collect_test_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_the_tier_agrees_with_the_folder_and_the_markers(path):
    tier = tier_of(first_docstring_line(path))
    folder = path.relative_to(TESTS).parts[0]
    where = str(path.relative_to(ROOT))
    if folder in TIER_FOLDERS.values():
        assert TIER_FOLDERS.get(tier) == folder, f"{where} lives in tests/{folder}/ but states {tier!r}"
    if tier == GPU_ONLY:
        assert folder == "cuda", f"{where}: a GPU-only file belongs in tests/cuda/"
    if tier == MULTIPROCESS and folder != "multiprocess":
        assert "multiprocess" in module_marks(path), f"{where}: mark it pytestmark = pytest.mark.multiprocess"


def test_the_tier_line_rule_on_examples():
    assert tier_of("Tier: pure CPU") == PURE_CPU
    assert tier_of("Tier: pure CPU, single process (one inductor compile).") == PURE_CPU
    assert tier_of("Tier: CPU multi-process over gloo (a pool of 4 ranks).") == MULTIPROCESS
    assert tier_of("Tier: GPU-only (marker ``cuda``), skipped without CUDA;") == GPU_ONLY
    for wrong in ("Worked examples. Tier: pure CPU", "Tier: CPU multi-process (gloo)", "Tier: pure CPUs",
                  "tier: pure CPU", "Tier: GPU", ""):
        assert tier_of(wrong) is None, wrong


def test_the_folder_table_lists_exactly_the_folders_under_tests():
    listed = [backticked(cell) for cell in table_column(section(PAGE.read_text(), "Test folders"), 0)]
    assert all(len(names) == 1 for names in listed), listed
    listed = [names[0].rstrip("/") for names in listed]
    present = sorted(f"tests/{p.name}" for p in TESTS.iterdir()
                     if p.is_dir() and not p.name.startswith((".", "__")))
    assert len(listed) == len(set(listed)), f"a folder is listed twice: {listed}"
    assert sorted(listed) == present, f"docs/testing.md lists {sorted(listed)}; tests/ holds {present}"


def test_the_tier_table_names_the_tiers_and_the_registered_markers():
    body = section(PAGE.read_text(), "Tiers and markers")
    tiers = [backticked(cell) for cell in table_column(body, 0)]
    assert tiers == [[f"Tier: {t}"] for t in TIERS], tiers
    documented = {m for cell in table_column(body, 2) for m in backticked(cell)
                  if not m.startswith("tests/")}
    registered = {line.split(":")[0].strip()
                  for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    assert documented == registered, f"docs/testing.md names markers {documented}; pyproject.toml registers {registered}"


def test_the_readme_says_what_ran_where():
    readme = (ROOT / "README.md").read_text()
    where = readme.split("**Where it has run.**")[1].split("\n\n")[0]
    assert "2-core CPU" in where and "dry run" in where  # the suite; the GPU check's dry run in CI
    assert "H200" in where and "results/gpu.md" in where  # the GPU check's runs, figures on their page
    assert "NCCL has not run" in where  # what a one-GPU machine cannot show
    ci_table = readme.split("What CI runs")[1].split("\n\n")[1]  # the README's table of the CI jobs
    for constraints in ("constraints.txt", "constraints-nemo-rl.txt", "constraints-newest.txt"):
        pins = dict(line.split("==") for line in (ROOT / constraints).read_text().splitlines() if "==" in line)
        assert any(all(f"| {pins[n]}" in row for n in ("torch", "transformers", "megatron-core"))
                   for row in ci_table.splitlines()), (constraints, ci_table)
