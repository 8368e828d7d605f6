"""The identity benchmark (bench/identity.py) at a smaller size: calls without identity are
grouped into their programs with pairwise precision and recall ≥ 0.99,
exactly with an id in any source, and the score is one that a wrong grouping fails."""

from __future__ import annotations

import pytest

import bench.identity as identity
from controller.conversations import Conversations

GROUPS = 40  # 150 programs, ~700 calls: every kind of program several times


def test_calls_without_identity_are_grouped_into_their_programs():
    score = identity.run_stream(seed=11, groups=GROUPS)
    assert score.programs >= 140 and score.calls >= 500
    assert score.precision >= 0.99 and score.recall >= 0.99, score


@pytest.mark.parametrize("source", sorted(identity.ID_SOURCES))
def test_with_an_id_in_any_source_the_grouping_is_exact(source):
    score = identity.run_stream(seed=11, groups=GROUPS, id_source=identity.ID_SOURCES[source])
    assert (score.precision, score.recall) == (1.0, 1.0), score


def test_grouping_calls_by_their_opening_fails_the_benchmark(monkeypatch):
    # the rule before conversations: one program per model, system prompt and first message
    monkeypatch.setattr(Conversations, "assign", lambda self, group, continues, head: group)
    score = identity.run_stream(seed=11, groups=GROUPS)
    assert score.recall == 1.0 and score.precision < 0.5


def test_pairwise_scores():
    assert identity.pairwise(["a", "a", "b"], ["x", "x", "y"]) == (1.0, 1.0)
    assert identity.pairwise(["a", "a", "b"], ["x", "x", "x"]) == (pytest.approx(1 / 3), 1.0)
    assert identity.pairwise(["a", "a", "b"], ["x", "y", "z"]) == (1.0, 0.0)
