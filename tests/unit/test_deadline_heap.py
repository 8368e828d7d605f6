"""The lazily validated deadline heap (scheduler/deadline_heap.py): due entries come out
earliest first, and stale entries go once the heap outgrows what its owner tracks, wanted
ones never."""

from __future__ import annotations

from scheduler.deadline_heap import HEAP_SLACK, DeadlineHeap


def test_due_entries_come_out_earliest_first_and_later_ones_stay() -> None:
    heap: DeadlineHeap[tuple[float, str]] = DeadlineHeap(lambda entry: True, lambda: 10)
    for entry in ((3.0, "c"), (1.0, "a"), (5.0, "e"), (2.0, "b")):
        heap.push(entry)
    assert list(heap.pop_due(3.0)) == [(1.0, "a"), (2.0, "b"), (3.0, "c")]
    assert len(heap) == 1
    assert list(heap.pop_due(4.9)) == []
    assert list(heap.pop_due(5.0)) == [(5.0, "e")]


def test_stale_entries_go_when_the_heap_outgrows_its_owner_and_wanted_ones_stay() -> None:
    live = {"a", "b"}
    heap: DeadlineHeap[tuple[float, str]] = DeadlineHeap(lambda entry: entry[1] in live, lambda: len(live))
    bound = 2 * len(live) + HEAP_SLACK
    heap.push((1.0, "a"))
    heap.push((2.0, "b"))
    for k in range(3 * bound):
        heap.push((10.0 + k, f"gone{k}"))
        assert len(heap) <= bound  # invariant 1
    assert list(heap.pop_due(2.0)) == [(1.0, "a"), (2.0, "b")]  # invariant 2


def test_an_entry_pushed_twice_counts_once_when_trimmed() -> None:
    heap: DeadlineHeap[tuple[float, str]] = DeadlineHeap(lambda entry: True, lambda: 0)
    for _ in range(HEAP_SLACK + 1):
        heap.push((1.0, "a"))
    assert list(heap.pop_due(1.0)) == [(1.0, "a")]
