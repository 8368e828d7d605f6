"""The house as docs/architecture.md §1 draws it: rooms a newcomer can hold in their head, no
import circle, and a layout that names every room there is.

Read statically from the source files; nothing is imported.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "controller", "sim", "simworker", "sluice_vllm_plugin", "entry",
            "ray_fleet", "bench")
MAX_LINES = 600
# The plugin's hot path inside vLLM's scheduler step, pinned line by line by the fidelity
# tests against vLLM's own classes: split, it would cost an indirection per block.
OVER_THE_LIMIT = {"sluice_vllm_plugin/retention.py"}
# The layout lists the core, the two shells and the simworker room by room.
LISTED_ROOM_BY_ROOM = ("scheduler", "controller", "sim", "simworker")


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules ``path`` imports, anywhere in it (a function-local or
    type-checking import closes a circle as surely as one at the top)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            # the module itself, else the package that defines the imported name
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _circles() -> list[list[str]]:
    paths = {_module_name(path): path for path in _sources()}
    known = set(paths)
    graph = {name: sorted(_imports(path, known) - {name}) for name, path in paths.items()}
    # A package's __init__ that re-exports its rooms is not a room importing them back.
    graph = {name: [to for to in targets if not name.startswith(to + ".")] for name, targets in graph.items()}
    circles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            if state[target] == 1:
                circles.append([*path[path.index(target):], target])
            elif state[target] == 0:
                visit(target, [*path, target])
        state[name] = 2

    for name in graph:
        if state[name] == 0:
            visit(name, [name])
    return circles


def test_no_module_is_over_600_lines_but_the_plugins_hot_path():
    long = {str(path.relative_to(REPO)): n for path in _sources()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert set(long) - OVER_THE_LIMIT == set(), long


def test_no_import_circle():
    assert _circles() == []


def test_the_circle_finder_finds_one(tmp_path, monkeypatch):
    package = tmp_path / "scheduler"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from scheduler import b\n")
    (package / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _circles() == [["scheduler.a", "scheduler.b", "scheduler.a"]]


def _layout() -> str:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## 1. Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _listed_rooms(layout: str) -> set[str]:
    """Paths the layout names. A top-level folder starts at column 0; its rooms are named at
    column 2, a sub-folder's at 4 (and 6), each line's names before its description."""
    rooms: set[str] = set()
    folders: dict[int, str] = {}
    for line in layout.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > 6 or indent % 2:
            continue  # blank, or a description carried over to the next line
        name_field = line.strip().split("  ", 1)[0]
        names = re.findall(r"[\w.-]+/|\w+\.py", name_field)
        if indent == 0:
            folders = {0: names[0].rstrip("/")} if names and names[0].endswith("/") else {}
            continue
        parent = folders.get(indent - 2)
        if parent is None:
            continue
        for name in names:
            path = f"{parent}/{name.rstrip('/')}"
            rooms.add(path)
            if name.endswith("/"):
                folders[indent] = path
    return rooms


def test_the_layout_names_every_room_of_the_core_and_the_shells_and_nothing_else():
    listed = _listed_rooms(_layout())
    there = {f"{package}/{path.name}" for package in LISTED_ROOM_BY_ROOM for path in (REPO / package).iterdir()
             if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").exists()}
    assert sorted(there - listed) == [], "rooms the layout does not name"
    assert sorted(room for room in listed if not (REPO / room).exists()) == [], \
        "the layout names rooms that are not there"
