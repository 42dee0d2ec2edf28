"""Tier: pure CPU (reads docs/design.md and the package's sources; imports nothing heavy).

docs/design.md's checkable claims held against the code: "Where things live" lists every module and
nothing that is not there, the "Floors" table is the import graph's order (nothing imports upward),
and "One word per concept" is what the code names.
"""

from __future__ import annotations

import ast
import re
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


@pytest.mark.parametrize("folder", ["nn_data/layout/", "nn_data/nemo_rl/"])
def test_the_rows_name_every_submodule_of_their_folder(folder):
    """A folder's row names each of its modules (`rules`, `build`, ..., recursively for nemo_rl)."""
    row = next(r for r in WHERE if r[0] == f"`{folder}`")
    named = set(re.findall(r"`([a-z_0-9]+)/?`", row[1])) | set(re.findall(r"`([a-z_0-9]+) \(", row[1]))
    modules = {p.stem if p.stem != "__init__" else p.parent.name for p in (ROOT / folder).rglob("*.py")}
    modules -= {folder.rstrip("/").split("/")[-1]}
    assert modules <= named, f"{folder}: not named in its row: {sorted(modules - named)}"


# ---- Floors ------------------------------------------------------------------------------------------

FLOORS = {name.strip("` "): int(row[0]) for row in _table_rows(_section("Floors"))
          for name in row[1].split(",") if name.strip()}
FLOORS = {("nn_data" if name.startswith("nn_data") else f"nn_data.{name}"): floor
          for name, floor in ((n.split(" ")[0], f) for n, f in FLOORS.items())}


def _unit(module: str) -> str:
    """The top-level unit of a module: ``nn_data.layout.build`` -> ``nn_data.layout``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PKG.rglob("*.py"):
        src = _unit(_module(path))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "nn_data":
                    targets = [f"nn_data.{a.name}" for a in node.names]
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
    SharedPrefixLayout, which is a PackLayout over a shared-prefix microbatch's slots (its ``layout``)."""
    classes = sorted(n.name for _, n in _definitions() if isinstance(n, ast.ClassDef) and "Layout" in n.name)
    assert classes == ["PackLayout", "SharedPrefixLayout"], classes
    import typing

    from nn_data.layout import PackLayout, SharedPrefixLayout

    assert typing.get_type_hints(SharedPrefixLayout)["layout"] is PackLayout


LAYOUT_SIDE = [PKG / "layout", *(PKG / f"{m}.py" for m in ("pack", "unpack", "context_parallel", "targets", "logprobs",
                                                             "cp_comm", "rows", "packed_forward")),
               *(PKG / "nemo_rl" / "megatron_data" / f"{m}.py" for m in ("dispatch", "graph", "options", "packed"))]


def test_plan_is_never_a_layouts_name():
    """"plan" is a step's plan (nn_data.planning, and the NeMo-RL container's microbatch plans): no class,
    function or module of the layout, the ops or the compat engine is named for it."""
    def on_layout_side(path: Path) -> bool:
        return any(path == side or side in path.parents for side in LAYOUT_SIDE)

    stray = sorted(f"{p.relative_to(ROOT)}:{n.name}" for p, n in _definitions()
                   if on_layout_side(p) and p.name != "_deprecated.py" and re.search(r"(^|_)plan(_|s?$)|Plan", n.name))
    assert not stray, stray
    assert not [p for p in PKG.rglob("*.py") if on_layout_side(p) and "plan" in p.stem]


def test_the_fixed_packed_length_is_not_called_packed_length():
    """Inside nn_data the fixed packed length is ``fixed_total`` and the resolved one ``total``; the only
    ``packed_length`` parameters left are the 0.1.x spellings that warn."""
    users = sorted(f"{p.relative_to(ROOT)}:{n.name}" for p, n in _definitions() if isinstance(n, ast.FunctionDef)
                   and "packed_length" in [a.arg for a in n.args.args + n.args.kwonlyargs])
    assert users == ["nn_data/layout/_deprecated.py:_layout_spec", "nn_data/megatron_parallel.py:make_packed_seq_params"]


def test_the_named_types_exist():
    from nn_data.layout import PackLayout, PackSpec
    from nn_data.planning import Parallelism, StepPlan

    table = _section("One word per concept")
    for cls, home in ((PackLayout, "nn_data.layout"), (PackSpec, "nn_data.layout"), (StepPlan, "nn_data.planning"),
                      (Parallelism, "nn_data.planning")):
        assert f"`{home}.{cls.__name__}`" in table, cls.__name__
