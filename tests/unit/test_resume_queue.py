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


def test_fitting_reads_only_what_fits_in_resume_order_and_after_a_key() -> None:
    queue = ResumeQueue(halflife_s=60.0)
    queue.put("idle-small", IDLE, 100, 0.0)
    queue.put("big", WAITING, 9_000, 0.0)
    queue.put("a", WAITING, 300, 1.0)
    queue.put("b", NEW, 200, 2.0)
    queue.put("c", WAITING, 200, 3.0)
    fit = queue.fitting(300)
    assert [(key[3], demand) for key, demand in fit] == [("c", 200), ("a", 300), ("b", 200),
                                                       ("idle-small", 100)]
    assert [key[3] for key, _ in fit] == [s for s, d in queue.in_order() if d <= 300]
    assert [key[3] for key, _ in queue.fitting(300, after=fit[1][0])] == ["b", "idle-small"]
    queue.discard("c")
    assert queue.min_demand() == 100 and [key[3] for key, _ in queue.fitting(250)] == ["b", "idle-small"]
    queue.discard("idle-small")
    assert queue.min_demand() == 200 and queue.fitting(150) == []


def test_fitting_gives_the_same_answer_whether_few_or_most_entries_fit() -> None:
    queue = ResumeQueue(halflife_s=60.0)
    for n in range(40):
        queue.put(f"s{n}", (WAITING, NEW, IDLE)[n % 3], 100 + 37 * (n % 11), float(n % 7))
    for most in (100, 150, 300, 400, 10_000):
        expected = [(s, d) for s, d in queue.in_order() if d <= most]
        fit = queue.fitting(most)
        assert [(key[3], demand) for key, demand in fit] == expected
        if len(fit) > 2:
            assert [key[3] for key, _ in queue.fitting(most, after=fit[1][0])] == [s for s, _ in expected[2:]]
