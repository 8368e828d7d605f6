"""The window of recent tool-call durations the policy takes its dormancy cutoff from."""

from __future__ import annotations

import pytest

from scheduler.tool_times import ToolTimes


def test_quantile_is_unknown_until_enough_samples() -> None:
    times = ToolTimes(window=100, min_samples=3)
    times.observe(1.0)
    times.observe(2.0)
    assert times.quantile(0.5) is None
    times.observe(3.0)
    assert times.quantile(0.5) == 2.0


def test_quantile_is_the_nearest_rank_of_the_window() -> None:
    times = ToolTimes(window=100, min_samples=1)
    for seconds in (5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 8.0, 7.0, 9.0):
        times.observe(seconds)
    assert times.quantile(0.0) == 1.0
    assert times.quantile(0.9) == 10.0
    assert times.quantile(0.5) == 6.0
    assert times.quantile(1.0) == 10.0


def test_the_window_forgets_the_oldest_durations() -> None:
    times = ToolTimes(window=3, min_samples=1)
    for seconds in (100.0, 1.0, 2.0, 3.0):
        times.observe(seconds)
    assert len(times) == 3
    assert times.quantile(1.0) == 3.0  # the 100 s call fell out


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        ToolTimes(window=0)
    times = ToolTimes(window=3, min_samples=1)
    with pytest.raises(ValueError):
        times.observe(-1.0)
    with pytest.raises(ValueError):
        times.quantile(1.5)


def test_median_beyond_is_the_median_of_the_calls_longer_than_the_elapsed_time() -> None:
    times = ToolTimes(window=100, min_samples=4)
    for seconds in (1.0, 2.0, 3.0):
        times.observe(seconds)
    assert times.median_beyond(0.0) is None  # too few samples yet
    for seconds in (10.0, 20.0, 30.0, 40.0):
        times.observe(seconds)
    assert times.median_beyond(0.0) == 10.0  # all seven: 1, 2, 3, 10, 20, 30, 40
    assert times.median_beyond(3.0) == 20.0  # the four longer than 3 s: lower median
    assert times.median_beyond(25.0) == 30.0
    assert times.median_beyond(40.0) is None  # nothing lasted longer
