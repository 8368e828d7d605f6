"""Recent tool-call durations, observed by the core, and their quantiles.

A tool call's duration is what the core sees between a program's response (its last call in
flight ended) and its next request. program_aware reads a quantile of the recent ones
(``dormant_quantile``) as "a program still in its tool call after this long is in one of
the long ones" (a test run, not a file view): it stops counting in ``U``; with a host tier
it reads :meth:`ToolTimes.median_beyond` as when such a call will end. continuum reads their
distribution for how long to pin a program's KV. A sliding window, so the estimate follows the traffic; no
clock, the shells' ``now`` only.

Invariant 1: ``_sorted`` holds exactly the values of ``_recent``, in ascending order, and at
most ``window`` of them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque


class ToolTimes:
    def __init__(self, window: int, min_samples: int = 20) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be ≥ 1, got {window}, {min_samples}")
        self._window = window
        self._min_samples = min_samples
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a tool call cannot take {seconds} s")
        self._recent.append(seconds)
        insort(self._sorted, seconds)
        if len(self._recent) > self._window:
            oldest = self._recent.popleft()
            del self._sorted[bisect_left(self._sorted, oldest)]  # keeps invariant 1

    def ascending(self) -> list[float]:
        """The window's durations in ascending order (the caller reads, never changes it)."""
        return self._sorted

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the window; None until ``min_samples`` are in."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        n = len(self._sorted)
        if n < self._min_samples:
            return None
        return self._sorted[min(n - 1, int(q * n))]

    def median_beyond(self, elapsed: float) -> float | None:
        """The median of the window's tool calls that lasted longer than ``elapsed``: when a
        call already ``elapsed`` long is predicted to end. None until ``min_samples`` are in,
        or when none lasted that long."""
        n = len(self._sorted)
        if n < self._min_samples:
            return None
        first = bisect_right(self._sorted, elapsed)
        if first == n:
            return None
        return self._sorted[(first + n - 1) // 2]
