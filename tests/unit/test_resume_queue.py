"""The resume order's bookkeeping: the largest waiting program is found without a scan."""

from __future__ import annotations

from scheduler.resume_queue import IDLE, NEW, WAITING, ResumeQueue


def test_largest_waiting_demand_counts_only_programs_with_a_call_waiting() -> None:
    queue = ResumeQueue(halflife_s=60.0)
    assert queue.largest_waiting_demand() is None
    queue.put("idle-giant", IDLE, 10_000, 0.0)
    assert queue.largest_waiting_demand() is None
    queue.put("a", WAITING, 300, 1.0)
    queue.put("b", NEW, 700, 2.0)
    assert queue.largest_waiting_demand() == 700


def test_largest_waiting_demand_follows_moves_and_removals() -> None:
    queue = ResumeQueue(halflife_s=60.0)
    queue.put("a", WAITING, 300, 1.0)
    queue.put("b", WAITING, 700, 2.0)
    queue.put("b", IDLE, 700, 2.0)  # its call went away
    assert queue.largest_waiting_demand() == 300
    queue.put("a", WAITING, 250, 1.0)  # re-sized
    assert queue.largest_waiting_demand() == 250
    queue.discard("a")
    assert queue.largest_waiting_demand() is None
    for n in range(500):  # many stale entries: the heap is compacted, the answer unchanged
        queue.put("c", WAITING, n, 3.0)
    assert queue.largest_waiting_demand() == 499
    assert len(queue._largest_waiting) <= 4 * queue.with_calls + 64 + 1


def test_waiting_demand_sums_the_programs_with_a_call_waiting_through_moves_and_removals() -> None:
    queue = ResumeQueue(halflife_s=60.0)
    queue.put("idle", IDLE, 10_000, 0.0)
    queue.put("a", WAITING, 300, 1.0)
    queue.put("b", NEW, 700, 2.0)
    assert queue.waiting_demand == 1000
    queue.put("b", IDLE, 700, 2.0)  # its call went away
    queue.put("a", WAITING, 250, 1.0)  # re-sized
    assert queue.waiting_demand == 250
    queue.put("idle", WAITING, 10_000, 0.0)  # its call came
    queue.discard("a")
    assert queue.waiting_demand == 10_000
    queue.discard("idle")
    queue.discard("b")
    assert queue.waiting_demand == 0 and len(queue) == 0
