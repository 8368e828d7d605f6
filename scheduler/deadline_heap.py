"""A heap of deadlines that may go stale, validated when popped and cleaned as it grows.

The policies keep several "when is X due" heaps (force resumes, idle releases, held calls'
wait limits, dormancy checks, predicted tool-call ends, retention refreshes). Removing an
entry from a heap when what it is about changes would cost a search; instead an entry stays
until it is popped, and its owner checks then whether it still matters. What keeps such a
heap from growing without bound is :meth:`DeadlineHeap.trim`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Entry = TypeVar("Entry", bound=tuple)

# How far a lazily cleaned heap may run past twice what its owner still tracks before it
# drops its stale entries (a fixed margin keeps a heap of a few entries from compacting on
# every push).
HEAP_SLACK = 16


class DeadlineHeap(Generic[Entry]):
    """A min-heap of ``(deadline, ...)`` entries, validated lazily: an entry can go stale
    (its program resumed, released, reasoning again), and the owner checks each one it pops.

    ``wanted(entry)`` says whether an entry can still matter; ``tracked()`` how many things
    the owner tracks that can each want an entry (its programs, its held calls).

    Invariant 1: after every :meth:`push`, :meth:`pop_due` and :meth:`trim`, the heap holds
    at most ``2·tracked() + HEAP_SLACK`` entries, or only wanted ones (an owner whose tracked
    things each want at most one entry gets the bound). Stale entries are dropped when it
    would hold more, which costs O(n) once per ~n pushes.

    Invariant 2: no wanted entry is ever dropped: :meth:`trim` keeps every entry for which
    ``wanted`` holds, so whatever the owner would act on is popped at its deadline.
    """

    def __init__(self, wanted: Callable[[Entry], bool], tracked: Callable[[], int]) -> None:
        self._heap: list[Entry] = []
        self._wanted = wanted
        self._tracked = tracked

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, entry)
        self.trim()  # keeps invariant 1

    def pop_due(self, now: float) -> Iterator[Entry]:
        """Pop every entry whose deadline is ``≤ now``, earliest first (stale ones too: the
        owner checks them). Entries pushed meanwhile that are due are popped as well."""
        # self._heap is read afresh each time: the owner may trim it between two entries
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)
        self.trim()  # keeps invariant 1

    def trim(self) -> None:
        """Drop stale entries if the heap has outgrown what its owner tracks."""
        if len(self._heap) > 2 * self._tracked() + HEAP_SLACK:
            # A set: an entry pushed twice (the same deadline twice in one instant) counts once.
            # Only unwanted entries go (invariant 2).
            self._heap = [entry for entry in set(self._heap) if self._wanted(entry)]
            heapq.heapify(self._heap)
