"""The order in which parked programs are resumed (architecture.md §3 "Resume").

Groups first (a paused program with a waiting call, then a new program, then an idle
paused one); inside a group, the client's higher priority first (``CallHints.priority``, 0
when it said none); then smallest first with aging: a program's size counts half for
every ``halflife_s`` it has waited. Comparing ``size·2^(−waited/h)`` between programs is
the same as comparing ``log2(size) + parked_since/h``, which does not change with time, so
the queue stays sorted between ticks instead of being re-sorted on each one.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Iterator

from scheduler.deadline_heap import HEAP_SLACK

WAITING, NEW, IDLE = 0, 1, 2


class ResumeQueue:
    """Invariant 1: ``_order`` is sorted and holds exactly one key per entry of ``_keys``,
    and ``_demand`` one demand per entry.

    Invariant 2: ``with_calls`` counts the entries whose group is not IDLE, and
    ``waiting_demand`` sums their demands.

    Invariant 3: the lazy heaps hold at most ``2·len + HEAP_SLACK`` entries
    (``2·with_calls + HEAP_SLACK`` for the largest-waiting one), stale ones dropped when they
    would hold more; every live entry is in them.
    """

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError(f"halflife_s must be > 0, got {halflife_s}")
        self._halflife_s = halflife_s
        self._keys: dict[str, tuple[int, int, float, str]] = {}
        self._demand: dict[str, int] = {}
        self._order: list[tuple[int, int, float, str]] = []
        self._smallest: list[tuple[int, str]] = []  # lazy min-heap of (demand, session)
        # lazy max-heap of (-demand, session) over programs with a call waiting
        self._largest_waiting: list[tuple[int, str]] = []
        self._with_calls = 0
        self._waiting_demand = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, session: object) -> bool:
        return session in self._keys

    @property
    def with_calls(self) -> int:
        """How many queued programs have a call waiting (groups WAITING and NEW)."""
        return self._with_calls

    @property
    def waiting_demand(self) -> int:
        """The demand of the queued programs that have a call waiting, summed."""
        return self._waiting_demand

    def put(self, session: str, group: int, demand: int, parked_since: float,
            priority: int = 0) -> None:
        """Insert ``session`` or move it to its new place (``priority``: higher first)."""
        self.discard(session)
        key = (group, -priority, math.log2(max(demand, 1)) + parked_since / self._halflife_s,
               session)
        self._keys[session] = key
        self._demand[session] = demand
        insort(self._order, key)  # keeps invariant 1
        heapq.heappush(self._smallest, (demand, session))
        if group != IDLE:
            self._with_calls += 1  # keeps invariant 2
            self._waiting_demand += demand
            heapq.heappush(self._largest_waiting, (-demand, session))
        self._trim()  # keeps invariant 3

    def discard(self, session: str) -> None:
        key = self._keys.pop(session, None)
        if key is None:
            return
        demand = self._demand.pop(session)
        del self._order[bisect_left(self._order, key)]  # keeps invariant 1
        if key[0] != IDLE:
            self._with_calls -= 1  # keeps invariant 2
            self._waiting_demand -= demand
        self._trim()  # keeps invariant 3

    def _trim(self) -> None:
        """Rebuild a lazy heap that outgrew the entries it indexes (O(n) once per ~n changes)."""
        if len(self._smallest) > 2 * len(self._keys) + HEAP_SLACK:
            self._smallest = [(d, s) for s, d in self._demand.items()]
            heapq.heapify(self._smallest)
        if len(self._largest_waiting) > 2 * self._with_calls + HEAP_SLACK:
            self._largest_waiting = [(-self._demand[s], s) for s, key in self._keys.items()
                                     if key[0] != IDLE]
            heapq.heapify(self._largest_waiting)

    def min_demand(self) -> int | None:
        heap = self._smallest
        while heap and self._demand.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def largest_waiting_demand(self) -> int | None:
        """The largest demand among programs with a call waiting (groups WAITING and NEW)."""
        heap = self._largest_waiting
        while heap:
            demand, session = -heap[0][0], heap[0][1]
            key = self._keys.get(session)
            if key is not None and key[0] != IDLE and self._demand[session] == demand:
                return demand
            heapq.heappop(heap)
        return None

    def in_order(self) -> Iterator[tuple[str, int]]:
        """(session, demand) in resume order; a snapshot, safe to change the queue while iterating."""
        for *_, session in list(self._order):
            demand = self._demand.get(session)
            if demand is not None:
                yield session, demand
