"""Tier: pure CPU (reads the repository's markdown; imports nothing heavy).

Every relative link in the repository's markdown resolves: the file (or folder) exists, and a
``#anchor`` names a heading of the target file, with GitHub's heading slugs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    """The markdown files git tracks or would track (new, not ignored: nothing in .venv or build folders)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return sorted({ROOT / line for line in out.stdout.splitlines() if line and (ROOT / line).is_file()})


def prose_lines(path: Path):
    """``(line number, text)`` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-``. Example: ``Differences from NeMo-RL, and why`` -> ``differences-from-nemo-rl-and-why``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links() -> list[tuple[Path, int, str]]:
    found = []
    for path in markdown_files():
        for number, line in prose_lines(path):
            for target in LINK.findall(line):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                    found.append((path, number, target))
    return found


def test_the_repository_has_relative_links_to_check():
    assert len(relative_links()) >= 4


def test_every_results_page_is_checked():
    """profiling/results/*.md are read like every other page, and link back to the tool's section."""
    pages = sorted((ROOT / "profiling" / "results").glob("*.md"))
    assert pages and set(pages) <= set(markdown_files())
    linking = {path for path, _, target in relative_links() if "#" in target}
    assert set(pages) - {ROOT / "profiling" / "results" / "README.md"} <= linking


@pytest.mark.parametrize("path, line, target", relative_links(),
                         ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else str(v))
def test_relative_link_resolves(path, line, target):
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.relative_to(ROOT)}:{line} links {target!r}"
    assert dest.exists(), f"{where}: {dest} does not exist"
    if anchor:
        assert dest.is_file() and dest.suffix == ".md", f"{where}: an anchor into a file that is not markdown"
        assert anchor in anchors(dest), f"{where}: no heading with the anchor #{anchor} in {dest.name}"


def test_slugs_follow_githubs_rule():
    assert slug("Differences from NeMo-RL, and why") == "differences-from-nemo-rl-and-why"
    assert slug("Sync budget") == "sync-budget"
    assert slug("`PackedForward` and `S`") == "packedforward-and-s"
    assert slug("The main job: `profiling/microbatches/`") == "the-main-job-profilingmicrobatches"


def test_an_anchor_that_names_no_heading_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section\n\n```\n## not a heading\n```\n\n## A section\n")
    assert anchors(page) == {"title", "a-section", "a-section-1"}
