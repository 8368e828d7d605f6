"""Invariants are numbered where they are stated and cited where they are kept, module by module.

Read from the source text. A module states its invariants either one by one
(``Invariant 2: ...``, ``Invariant 1 (the pause pass): ...``) or as a numbered list under an
``**Invariants**`` heading; it cites one as ``invariant 2`` or ``invariants 1 and 2`` (lower
case) in the comment or docstring beside the code that keeps it. A stated invariant nobody
cites is kept nowhere a reader can find; a citation of one the module does not state points
at nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "controller", "sim", "simworker", "sluice_vllm_plugin")

ONE_BY_ONE = re.compile(r"\bInvariant (\d+)(?: \([^)]*\))?:")
LISTED_UNDER = re.compile(r"\*\*Invariants\*\*[^\n]*\n((?:\s*\n|[ \t]*\d+\.[^\n]*\n|[ \t]+[^\n]*\n)+)")
LIST_ITEM = re.compile(r"^[ \t]*(\d+)\.\s", re.MULTILINE)
CITED = re.compile(r"\binvariants? (\d+(?:(?:, | and | or )\d+)*)")


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py")
                  if "invariant" in path.read_text(encoding="utf-8").lower())


def _stated(text: str) -> set[int]:
    numbers = {int(n) for n in ONE_BY_ONE.findall(text)}
    for block in LISTED_UNDER.findall(text):
        numbers |= {int(n) for n in LIST_ITEM.findall(block)}
    return numbers


# "the policy's invariant 2": a citation of another module's invariant, not of this one's.
ELSEWHERE = re.compile(r"'s invariants? \d+")


def _cited(text: str) -> set[int]:
    text = ELSEWHERE.sub("", text)
    return {int(n) for group in CITED.findall(text) for n in re.findall(r"\d+", group)}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_each_stated_invariant_is_cited_and_each_citation_is_stated(path: Path):
    text = path.read_text(encoding="utf-8")
    stated, cited = _stated(text), _cited(text)
    assert stated, "speaks of invariants but numbers none"
    assert sorted(stated - cited) == [], "stated, never cited where kept"
    assert sorted(cited - stated) == [], "cited, never stated"


def test_the_reader_finds_both_ways_of_stating():
    listed = "**Invariants** (cited where kept):\n\n1. one\n   more of one\n2. two\n\"\"\"\n"
    assert _stated(listed) == {1, 2}
    assert _stated("Invariant 3 (named): x\nInvariant 4: y") == {3, 4}
    assert _cited("keeps invariants 1 and 2; (invariant 4)") == {1, 2, 4}
    assert _cited("keeps the policy's invariant 3") == set()
