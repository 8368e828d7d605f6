"""program_aware's rooms (scheduler/policies/program_aware/): each a module a
newcomer can hold in their head, saying what it owns, read by the façade and by one another
one way only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scheduler.policies.program_aware as package

PACKAGE_DIR = Path(package.__file__).resolve().parent
PREFIX = "scheduler.policies.program_aware."
# room -> the rooms it may import; what is not listed may import no room.
MAY_IMPORT = {
    "policy": {"capacity", "placement", "resume", "pausing", "dormancy", "keep"},
    "resume": {"placement"},
    "placement": {"capacity"},
    "pausing": {"capacity"},
}
ROOMS = sorted(path.stem for path in PACKAGE_DIR.glob("*.py") if path.stem != "__init__")


def _rooms_imported(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            rooms.add(node.module.removeprefix(PREFIX).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.name}: a relative import; name the room in full")
    return rooms


def test_the_rooms_are_the_ones_the_layout_names() -> None:
    assert ROOMS == ["capacity", "dormancy", "keep", "pausing", "placement", "policy", "resume"]


@pytest.mark.parametrize("room", ROOMS)
def test_rooms_read_one_another_one_way(room: str) -> None:
    assert _rooms_imported(PACKAGE_DIR / f"{room}.py") <= MAY_IMPORT.get(room, set())


@pytest.mark.parametrize("room", [*ROOMS, "__init__"])
def test_every_room_is_small_and_says_what_it_owns(room: str) -> None:
    source = (PACKAGE_DIR / f"{room}.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) <= (300 if room == "policy" else 600)
    assert ast.get_docstring(ast.parse(source)), f"{room}.py has no module docstring"


def test_the_package_hands_on_the_policy() -> None:
    from scheduler.policies import POLICIES

    assert POLICIES["program_aware"] is package.ProgramAwarePolicy


# Each step of the documented tick, and what marks it in the tick's source.
TICK_STEPS = {
    "release idle programs": "self._resume.idle_sessions(",
    "dormancy": "self._mark_dormant(",
    "predicted prefetches": "self._dormancy.predicted_ends(",
    "overdue calls": "self._overdue(",
    "resume (forced, reserved, in order)": "self._resume_pass(",
    "pause": "self._pause(",
    "soft band": "self._pausing.update_soft_band(",
    "retention": "self._keep.retain(",
}
TICK_ORDER = " → ".join(TICK_STEPS)


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_tick_runs_its_steps_in_the_documented_order() -> None:
    import inspect

    from scheduler.policies.program_aware.policy import ProgramAwarePolicy

    source = inspect.getsource(ProgramAwarePolicy.tick)
    where = [source.find(call) for call in TICK_STEPS.values()]
    assert -1 not in where and where == sorted(where), dict(zip(TICK_STEPS, where))
    architecture = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    for text in (architecture, package.__doc__ or "", ProgramAwarePolicy.tick.__doc__ or ""):
        assert TICK_ORDER.lower() in _words(text).lower()
