"""The order in which parked programs are resumed (architecture.md §3 "Resume").

Groups first (a paused program with a waiting call, then a new program, then an idle
paused one); inside a group, the client's higher priority first (``CallHints.priority``, 0
when it said none); then smallest first with aging: a program's size counts half for
every ``halflife_s`` it has waited. Comparing ``size·2^(−waited/h)`` between programs is
the same as comparing ``log2(size) + parked_since/h``, which does not change with time, so
the queue stays sorted between ticks instead of being re-sorted on each one. The entries are
also kept by size, so that a resume pass with little headroom reads only the programs that
could fit it (:meth:`ResumeQueue.fitting`), not a queue of thousands too large for it.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator

from scheduler.deadline_heap import HEAP_SLACK

WAITING, NEW, IDLE = 0, 1, 2
Key = tuple[int, int, float, str]  # (group, -priority, log2(size) + parked_since/h, session)
# compares above every (group, -priority, rank, session) key: a group is 0, 1 or 2
_PAST_EVERY_KEY = (math.inf,)


class ResumeQueue:
    """Invariant 1: ``_order`` is sorted and holds exactly one key per entry of ``_keys``,
    ``_demand`` one demand per entry, and ``_by_demand`` one ``(demand, key)`` per entry,
    sorted (the entries that fit a headroom are a prefix of it: :meth:`fitting`).

    Invariant 2: ``with_calls`` counts the entries whose group is not IDLE, and
    ``waiting_demand`` sums their demands.

    Invariant 3: the lazy heap of the largest waiting holds at most
    ``2·with_calls + HEAP_SLACK`` entries, stale ones dropped when it would hold more; every
    live entry is in it.
    """

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError(f"halflife_s must be > 0, got {halflife_s}")
        self._halflife_s = halflife_s
        self._keys: dict[str, Key] = {}
        self._demand: dict[str, int] = {}
        self._order: list[Key] = []
        self._by_demand: list[tuple[int, Key]] = []  # (demand, key)
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
        insort(self._by_demand, (demand, key))
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
        del self._by_demand[bisect_left(self._by_demand, (demand, key))]
        if key[0] != IDLE:
            self._with_calls -= 1  # keeps invariant 2
            self._waiting_demand -= demand
        self._trim()  # keeps invariant 3

    def _trim(self) -> None:
        """Rebuild the lazy heap if it outgrew the entries it indexes (O(n) once per ~n changes)."""
        if len(self._largest_waiting) > 2 * self._with_calls + HEAP_SLACK:
            self._largest_waiting = [(-self._demand[s], s) for s, key in self._keys.items()
                                     if key[0] != IDLE]
            heapq.heapify(self._largest_waiting)

    def min_demand(self) -> int | None:
        return self._by_demand[0][0] if self._by_demand else None

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

    def demand(self, session: str) -> int | None:
        """The demand ``session`` is queued with (None: not queued)."""
        return self._demand.get(session)

    def fitting(self, most: float,
                after: Key | None = None) -> list[tuple[Key, int]]:
        """(key, demand) of the entries of at most ``most`` tokens (placed after ``after``
        in resume order, if given), in resume order: a bisection and a sort of what fits, so
        a long queue of programs too large for the headroom left costs nothing to pass over
        (when most of the queue fits, a pass over the order instead of the sort)."""
        end = bisect_right(self._by_demand, (most, _PAST_EVERY_KEY))
        if 4 * end > len(self._by_demand):
            demands = self._demand
            fit = [(key, demands[key[3]]) for key in self._order if demands[key[3]] <= most]
        else:
            fit = sorted((key, demand) for demand, key in self._by_demand[:end])
        if after is not None:
            fit = fit[bisect_right(fit, (after, math.inf)):]
        return fit

    def in_order(self) -> Iterator[tuple[str, int]]:
        """(session, demand) in resume order; a snapshot, safe to change the queue while iterating."""
        for *_, session in list(self._order):
            demand = self._demand.get(session)
            if demand is not None:
                yield session, demand
