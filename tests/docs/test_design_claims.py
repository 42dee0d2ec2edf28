"""Tier: pure CPU (reads docs/*.md, the package's sources and the tests' sources; one subprocess imports nn_data).

docs/design.md is a map every claim of which a test holds: "Where things live" lists every module and
nothing that is not there, and every name a row puts in a module is bound there; the "Floors" table is
the import graph's order (nothing imports upward); "One word per concept" is what the code names; every
rule names the test that holds it, and every test the page names exists; every section that code, tests
and docs cite ("docs/design.md, Zigzag") is a heading of the page; the page stays a map (at most 250
lines) and no docs table row runs over 400 characters.
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
PKG = ROOT / "nn_data"
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _section(title: str) -> str:
    """The text of ``## title`` (or ``### title``) up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^#{{1,{3}}} )", DESIGN + "\n# end", re.S | re.M)
    assert match, f"docs/design.md has no section {title!r}"
    level = len(match.group(1))
    body = match.group(2)
    stop = re.search(rf"^#{{1,{level}}} ", body, re.M)
    return body[: stop.start()] if stop else body


def _table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # after the header and ---


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ---- Where things live -------------------------------------------------------------------------------

WHERE = _table_rows(_section("Where things live"))
LISTED = {p for row in WHERE for p in re.findall(r"`(nn_data/[^`]*)`", row[0])}


def test_every_path_the_table_lists_exists():
    missing = sorted(p for p in LISTED if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_in_the_table(path):
    rel = str(path.relative_to(ROOT))
    folders = {p for p in LISTED if p.endswith("/")}
    assert rel in LISTED or any(rel.startswith(f) for f in folders), f"{rel} is not in 'Where things live'"


FOLDER_ROWS = [row for row in WHERE if re.fullmatch(r"`nn_data/[^`]*/`", row[0])]
SUBMODULE = re.compile(r"`([a-z_0-9]+)/?`")


def _children(folder: Path) -> set[str]:
    """A folder's direct modules and packages: ``rules`` for ``rules.py``, ``megatron_data`` for a package."""
    return ({p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()})


def test_every_package_is_listed_in_a_rows_paths():
    """Each package (``nn_data/nemo_rl/megatron_data/`` too) is a path of a row, so its row names its modules."""
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in PKG.rglob("__init__.py") if p.parent != PKG}
    listed = {p for row in WHERE for p in re.findall(r"`(nn_data/[^`]*/)`", row[0])}
    assert packages <= listed, sorted(packages - listed)


@pytest.mark.parametrize("row", FOLDER_ROWS, ids=lambda r: r[0].strip("`"))
def test_a_folders_row_names_each_of_its_modules(row):
    """A folder's row names each of its direct modules and packages (`rules`, `build`, ..., `megatron_data/`);
    a package inside it has a row of its own."""
    folder = ROOT / row[0].strip("`")
    named = set(SUBMODULE.findall(row[1]))
    assert _children(folder) <= named, f"{row[0]}: not named in its row: {sorted(_children(folder) - named)}"


# ---- every name a row puts in a module is bound there ------------------------------------------------

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _bound(path: Path) -> set[str]:
    """The names a module's source binds at its top level: defs, classes, assignments, imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _source(module: str) -> Path | None:
    """The file of a dotted ``nn_data`` module (its ``__init__.py`` for a package), or None."""
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _resolves(token: str, homes: list[Path]) -> bool:
    """``token`` is a path that exists, a dotted ``nn_data`` module (or a name bound in one), a module or
    package inside one of the row's folders, or a name bound in one of the row's modules."""
    if "/" in token:
        return (ROOT / token.rstrip("/")).exists()
    if token.startswith("nn_data."):
        module, _, attr = token.rpartition(".")
        return _source(token) is not None or (_source(module) is not None and attr in _bound(_source(module)))
    return any(token in _bound(home) for home in homes if home.suffix == ".py")


def _homes(row: list[str]) -> list[Path]:
    """The sources a row speaks for: each file it lists; for a folder, its ``__init__`` and every module
    inside it the row names."""
    homes = []
    for path in re.findall(r"`(nn_data/[^`]*)`", row[0]):
        where = ROOT / path.rstrip("/")
        if where.is_dir():
            homes.append(where / "__init__.py")
            for sub in SUBMODULE.findall(row[1]):
                homes += [p for p in (where / f"{sub}.py", where / sub / "__init__.py") if p.exists()]
        else:
            homes.append(where)
    return homes


@pytest.mark.parametrize("row", WHERE, ids=lambda r: r[0].strip("`").split("`")[0])
def test_every_name_a_row_puts_in_a_module_is_bound_there(row):
    homes = _homes(row)
    folders = [ROOT / p.rstrip("/") for p in re.findall(r"`(nn_data/[^`]*/)`", row[0])]
    missing = []
    for token in re.findall(r"`([^`]+)`", row[1]):
        name = token.rstrip("/")
        if any((f / f"{name}.py").exists() or (f / name / "__init__.py").exists() for f in folders):
            continue  # a module or package of the folder
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./]*", token), f"{row[0]}: `{token}` is not a name the test can check"
        if not _resolves(token, homes):
            missing.append(token)
    assert not missing, f"{row[0]}: not bound in its module(s): {missing}"


# ---- Floors ------------------------------------------------------------------------------------------

FLOORS = {name.strip("` "): int(row[0]) for row in _table_rows(_section("Floors"))
          for name in row[1].split(",") if name.strip()}
FLOORS = {("nn_data" if name.startswith("nn_data") else f"nn_data.{name}"): floor
          for name, floor in ((n.split(" ")[0], f) for n, f in FLOORS.items())}


def _unit(module: str) -> str:
    """The top-level unit of a module: ``nn_data.layout.build`` -> ``nn_data.layout``."""
    parts = module.split(".")
    return ".".join(parts[:2])


MODULE_NAMES = {_module(p) for p in PKG.rglob("*.py")}


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PKG.rglob("*.py"):
        src = _unit(_module(path))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "nn_data":  # a submodule, or a name of the package's __init__
                    targets = [f"nn_data.{a.name}" if f"nn_data.{a.name}" in MODULE_NAMES else "nn_data"
                               for a in node.names]
                elif node.module.startswith("nn_data."):
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("nn_data.")]
            edges |= {(src, _unit(t)) for t in targets if _unit(t) != src}
    return edges


def test_every_unit_has_a_floor():
    units = {_unit(_module(p)) for p in PKG.rglob("*.py")}
    assert units == set(FLOORS), (sorted(units - set(FLOORS)), sorted(set(FLOORS) - units))


@pytest.mark.parametrize("edge", sorted(_edges()), ids=lambda e: f"{e[0]}->{e[1]}")
def test_no_import_goes_up_or_sideways(edge):
    src, dst = edge
    assert FLOORS[src] > FLOORS[dst], f"{src} (floor {FLOORS[src]}) imports {dst} (floor {FLOORS[dst]})"


# ---- One word per concept ----------------------------------------------------------------------------

def _definitions():
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                yield path, node


def test_layout_names_one_type():
    """"layout" is PackLayout: no other class's name says Layout (the deprecated names are aliases), but
    TreeLayout, which is a PackLayout over a rollout tree's node slots (its ``layout``; TreeLayout,
    the shared prompt's name for it, is an alias)."""
    classes = sorted(n.name for _, n in _definitions() if isinstance(n, ast.ClassDef) and "Layout" in n.name)
    assert classes == ["PackLayout", "TreeLayout"], classes
    import typing

    from nn_data.layout import PackLayout, TreeLayout

    assert typing.get_type_hints(TreeLayout)["layout"] is PackLayout


LAYOUT_SIDE = [PKG / "layout", *(PKG / f"{m}.py" for m in ("pack", "unpack", "context_parallel", "targets", "logprobs",
                                                             "cp_comm", "rows", "packed_forward")),
               *(PKG / "nemo_rl" / "megatron_data" / f"{m}.py" for m in ("dispatch", "graph", "options", "packed"))]


def test_plan_is_never_a_layouts_name():
    """"plan" is a step's plan (nn_data.planning, and the NeMo-RL container's microbatch plans): no class,
    function or module of the layout, the ops or the compat engine is named for it."""
    def on_layout_side(path: Path) -> bool:
        return any(path == side or side in path.parents for side in LAYOUT_SIDE)

    stray = sorted(f"{p.relative_to(ROOT)}:{n.name}" for p, n in _definitions()
                   if on_layout_side(p) and re.search(r"(^|_)plan(_|s?$)|Plan", n.name))
    assert not stray, stray
    assert not [p for p in PKG.rglob("*.py") if on_layout_side(p) and "plan" in p.stem]


def test_the_fixed_packed_length_is_not_called_packed_length():
    """Inside nn_data the fixed packed length is ``fixed_total`` and the resolved one ``total``; the only
    ``packed_length`` parameters left are the 0.1.x spellings that warn."""
    users = sorted(f"{p.relative_to(ROOT)}:{n.name}" for p, n in _definitions() if isinstance(n, ast.FunctionDef)
                   and "packed_length" in [a.arg for a in n.args.args + n.args.kwonlyargs])
    assert users == ["nn_data/megatron_parallel.py:make_packed_seq_params"]


def test_the_named_types_exist():
    from nn_data.layout import PackLayout, PackSpec
    from nn_data.planning import Parallelism, StepPlan

    table = _section("One word per concept")
    for cls, home in ((PackLayout, "nn_data.layout"), (PackSpec, "nn_data.layout"), (StepPlan, "nn_data.planning"),
                      (Parallelism, "nn_data.planning")):
        assert f"`{home}.{cls.__name__}`" in table, cls.__name__


# ---- every rule names the test that holds it, and every test named exists ---------------------------

TESTS = ROOT / "tests"
# `test_name` or `file.py::test_name` (a test file's basename is unique under tests/).
TEST_REF = re.compile(r"`(?:([A-Za-z0-9_]+\.py)::)?(test_[A-Za-z0-9_]+)`")
RULE_SECTIONS = ["One word per concept", "Packed layout (THD)", "Zigzag", "Unpacking", "Row capacity",
                 "Static-shape rules", "Layouts and executors", "Validation", "Alignment and the step plan",
                 "Process groups", "megatron-core", "Differences from NeMo-RL, and why", "Gradients across ranks",
                 "NeMo-RL's log-prob conventions"]


def _test_definitions() -> dict[str, set[str]]:
    """``{test file basename: the test functions and classes it defines}`` over every test file."""
    found: dict[str, set[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        assert path.name not in found, f"two test files named {path.name}: a reference by basename is ambiguous"
        found[path.name] = {n.name for n in ast.walk(ast.parse(path.read_text()))
                            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return found


DEFINED = _test_definitions()


def _bullets(text: str) -> list[str]:
    """The list items of a section, each with its continuation lines."""
    items: list[str] = []
    for line in text.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        elif not line.strip() or not line.startswith("  "):
            items.append("") if items and items[-1] else None
    return [item for item in items if item]


def test_the_page_names_tests():
    assert len(TEST_REF.findall(DESIGN)) >= 40


@pytest.mark.parametrize("ref", sorted(set(TEST_REF.findall(DESIGN))), ids=lambda r: "::".join(filter(None, r)))
def test_every_test_the_page_names_exists(ref):
    file, name = ref
    if file:
        assert file in DEFINED, f"no test file {file} under tests/"
        assert name in DEFINED[file], f"{file} defines no {name}"
    else:
        where = [f for f, names in DEFINED.items() if name in names]
        assert len(where) == 1, f"`{name}` is defined in {where or 'no test file'}: name it as `file.py::{name}`"


@pytest.mark.parametrize("title", RULE_SECTIONS)
def test_every_rule_names_the_test_that_holds_it(title):
    bullets = _bullets(_section(title))
    assert bullets, f"{title!r} states no rule as a list item"
    bare = [b[:80] for b in bullets if not TEST_REF.search(b)]
    assert not bare, f"{title!r}: rules that name no test: {bare}"


def test_every_row_of_the_sync_budget_names_its_test():
    rows = _table_rows(_section("Sync budget"))
    assert len(rows) >= 5
    assert all(TEST_REF.fullmatch(row[2]) for row in rows), [row[0] for row in rows if not TEST_REF.fullmatch(row[2])]


def test_the_bullet_parser_joins_continuation_lines():
    assert _bullets("intro\n- a rule\n  (`test_x`)\n- another\n\ntext\n") == ["- a rule (`test_x`)", "- another"]


# ---- every section cited is a heading of the page ----------------------------------------------------

HEADINGS = [h.strip() for h in re.findall(r"^#{2,3} (.*)$", DESIGN, re.M)]
# ``docs/design.md``, "Zigzag", "Row capacity"  /  docs/design.md ("Alignment and the step plan")  /
# ([docs/design.md](design.md), "Packed layout", ...)
CITATION = re.compile(r"design\.md`*\)?,? \(?((?:\"[^\"]+\"(?:, )?)+)")


def _citations() -> list[tuple[str, str]]:
    """``(file, section)`` for every section name cited after a mention of design.md, in the package, the
    tests, the scripts, the profiling tools and the markdown (whitespace folded: a citation may wrap)."""
    found = []
    paths = [*PKG.rglob("*.py"), *TESTS.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
             *(ROOT / "profiling").rglob("*.py"), *ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    for path in paths:
        if path == Path(__file__).resolve():
            continue  # this file's examples of the forms
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for names in CITATION.findall(text):
            found += [(str(path.relative_to(ROOT)), name) for name in re.findall(r"\"([^\"]+)\"", names)]
    return found


def _is_heading(name: str) -> bool:
    """A cited name is a heading, or a heading's start before its parenthesis or comma
    ("Packed layout" for "Packed layout (THD)")."""
    return any(h == name or h.startswith((f"{name} (", f"{name},")) for h in HEADINGS)


def test_the_code_cites_sections():
    assert len(_citations()) >= 20


@pytest.mark.parametrize("cited", sorted(set(_citations())), ids=lambda c: f"{c[0]}:{c[1]}")
def test_every_section_cited_is_a_heading_of_the_page(cited):
    path, name = cited
    assert _is_heading(name), f"{path} cites docs/design.md, {name!r}: no such section (headings: {HEADINGS})"


def test_the_citation_parser_reads_each_form():
    text = ('(``docs/design.md``, "Packed layout", "Zigzag") and docs/design.md ("Alignment") and '
            '([docs/design.md](design.md), "Unpacking")')
    assert [n for names in CITATION.findall(text) for n in re.findall(r"\"([^\"]+)\"", names)] == [
        "Packed layout", "Zigzag", "Alignment", "Unpacking"]
    assert _is_heading("Packed layout") and _is_heading("Differences from NeMo-RL") and not _is_heading("Packed")


# ---- a map, not a treatise ---------------------------------------------------------------------------

def test_the_design_page_is_at_most_300_lines():
    assert len(DESIGN.splitlines()) <= 300, len(DESIGN.splitlines())


# ---- the architecture's rings ------------------------------------------------------------------------

RINGS = {row[0]: row for row in _table_rows(_section("Architecture"))}


def _ring_files() -> dict:
    """Each ring's Python files: the ``modules`` column's paths under ``nn_data/``; "every other module" the rest."""
    files, rest = {}, set(PKG.rglob("*.py"))
    for name, row in RINGS.items():
        paths = [PKG / p.rstrip("/") for p in re.findall(r"`([^`]+\.py|[^`]+/)`", row[2])]
        files[name] = {f for p in paths for f in ([p] if p.suffix == ".py" else p.rglob("*.py"))}
        assert all(p.exists() for p in paths), [p for p in paths if not p.exists()]
    (other,) = [name for name, row in RINGS.items() if row[2] == "every other module"]
    files[other] = rest - set().union(*files.values())
    return files


def test_every_module_is_in_one_ring_and_each_rings_size_is_its_lines():
    """The rings' table names core, runtime and wings; no module is in two; each ring's lines (the table's
    figure) are within 10% of ``wc -l`` over its files today."""
    assert list(RINGS) == ["core", "runtime", "wings"], list(RINGS)
    files = _ring_files()
    named = [f for name in ("core", "wings") for f in files[name]]
    assert len(named) == len(set(named)), "a module is in two rings"
    for name, row in RINGS.items():
        lines = sum(len(f.read_text().splitlines()) for f in files[name])
        stated = int(row[3].replace(",", ""))
        assert abs(lines - stated) <= stated / 10, f"ring {name}: the page says {stated} lines, wc -l gives {lines}"


def test_the_architecture_section_comes_first():
    assert HEADINGS[0] == "Architecture" and _section("Architecture").count("```") == 2, HEADINGS[:2]


@pytest.mark.parametrize("page", [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"], ids=lambda p: p.name)
def test_no_docs_page_holds_a_dated_figure(page):
    """A measurement with its date (and its machine and load) lives on its subject's page in profiling/results/;
    a docs page states the fact and links there."""
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", page.read_text())
    assert dates == [], f"{page.name}: move the figures of {dates} to profiling/results/<subject>.md"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_no_table_row_of_a_docs_page_is_over_400_characters(page):
    long = [(n, len(line)) for n, line in enumerate(page.read_text().splitlines(), 1)
            if line.startswith("|") and len(line) > 400]
    assert not long, f"{page.name}: table rows over 400 characters (line, length): {long}"


# ---- megatron-core stays out of a plain import -------------------------------------------------------

def test_importing_nn_data_does_not_import_megatron_core():
    """``import nn_data`` and the NeMo-RL layer's import leave megatron-core unimported (docs/design.md,
    "megatron-core"): a fresh interpreter, so nothing another test imported counts."""
    code = ("import sys, nn_data, nn_data.nemo_rl.megatron_data; "
            "loaded = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
            "print(loaded); sys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


# ---- claims of the page no other test states as such -------------------------------------------------

@pytest.mark.parametrize("cp", [2, 4])
def test_a_ranks_places_follow_its_local_boundaries(cp):
    """docs/design.md, "Zigzag": a rank's local boundaries are ``cu_seqlens_padded // C``, and its places
    (``local_places``) are where the reference shard puts each packed position."""
    import torch

    from nn_data import PackSequences
    from nn_data.testing.reference import reference_shard

    lengths = torch.tensor([5, 0, 16, 3])
    r = PackSequences(2 * cp, pad_full_seq_to=64)(torch.ones(4, 16, dtype=torch.long), lengths)
    bounds = r.cu_seqlens_padded.to(torch.int64)
    for rank in range(cp):
        places = r.layout.local_places(cp, rank)
        want = reference_shard(torch.arange(64)[None], r.cu_seqlens_padded, cp, rank)[0]
        assert torch.equal(places.source, want)
        per_segment = torch.bincount(places.segment, minlength=lengths.numel())
        assert torch.equal(per_segment, bounds.diff() // cp)
