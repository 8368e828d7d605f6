"""Parts the pausing policies (program_aware, thunderagent) are both built from.

- :class:`DeadlineHeap`: a heap of deadlines that may go stale, which cleans itself so it
  never outgrows what its owner still tracks.
- :class:`ParkingLot`: the programs that are not running and wait to be resumed or placed,
  each with when it was parked, and (optionally) when it must be forced back.
- :class:`Parking`: the moves between running and parked that both policies make the same
  way (pause, resume, where a forced resume goes, idle release, the demand a parked program
  resumes with), on a policy's program table and ledger.

Each policy composes these and keeps its own rules (when to pause, whom to resume where).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from scheduler.actions import Action, Resume
from scheduler.programs import Program

Entry = TypeVar("Entry", bound=tuple)

# How far a deadline heap may run past twice what its owner still tracks before it drops
# its stale entries (a fixed margin keeps a heap of a few entries from compacting on every push).
HEAP_SLACK = 16


class DeadlineHeap(Generic[Entry]):
    """A min-heap of ``(deadline, ...)`` entries, validated lazily: an entry can go stale
    (its program resumed, released, reasoning again), and the owner checks each one it pops.

    ``wanted(entry)`` says whether an entry can still matter; ``tracked()`` how many things
    the owner tracks that can each want an entry (its programs, its held calls).

    Invariant (after every :meth:`push`, :meth:`pop_due` and :meth:`trim`): the heap holds
    at most ``2·tracked() + HEAP_SLACK`` entries. Stale entries are dropped when it would
    hold more, which costs O(n) once per ~n pushes.
    """

    def __init__(self, wanted: Callable[[Entry], bool], tracked: Callable[[], int]) -> None:
        self._heap: list[Entry] = []
        self._wanted = wanted
        self._tracked = tracked

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, entry)
        self.trim()

    def pop_due(self, now: float) -> Iterator[Entry]:
        """Pop every entry whose deadline is ``≤ now``, earliest first (stale ones too: the
        owner checks them). Entries pushed meanwhile that are due are popped as well."""
        # self._heap is read afresh each time: the owner may trim it between two entries
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)
        self.trim()

    def trim(self) -> None:
        """Drop stale entries if the heap has outgrown what its owner tracks."""
        if len(self._heap) > 2 * self._tracked() + HEAP_SLACK:
            # A set: an entry pushed twice (the same deadline twice in one instant) counts once.
            self._heap = [entry for entry in set(self._heap) if self._wanted(entry)]
            heapq.heapify(self._heap)


class ParkingLot:
    """Programs that are not running and wait for a worker: PAUSED ones, and PENDING ones
    with a call waiting to be placed. Per program, when it was parked (a forced resume counts
    from there), oldest first.

    With ``force_after_s``, it also keeps when each parked program is due for a forced resume
    (:meth:`due`). Invariant: every parked program has exactly one live deadline
    ``(since + force_after_s, session, since)``, and the heap's other entries are stale.
    """

    def __init__(self, force_after_s: float | None) -> None:
        self._since: dict[str, float] = {}
        self._force_after_s = force_after_s
        self._deadlines: DeadlineHeap[tuple[float, str, float]] | None = None
        if force_after_s is not None:
            self._deadlines = DeadlineHeap(lambda entry: self._since.get(entry[1]) == entry[2],
                                           lambda: len(self._since))

    def __contains__(self, session: object) -> bool:
        return session in self._since

    def __len__(self) -> int:
        return len(self._since)

    def sessions(self) -> list[str]:
        """The parked sessions, oldest first (a snapshot: safe to park and unpark meanwhile)."""
        return list(self._since)

    def since(self, session: str) -> float | None:
        return self._since.get(session)

    def reconfigure(self, force_after_s: float | None) -> None:
        """A new force-resume delay applies to programs parked from now on."""
        self._force_after_s = force_after_s

    def park(self, session: str, now: float) -> None:
        """Park ``session`` (a no-op if it is parked already: it keeps its first time)."""
        if session in self._since:
            return
        self._since[session] = now
        if self._deadlines is not None and self._force_after_s is not None:
            self._deadlines.push((now + self._force_after_s, session, now))

    def unpark(self, session: str) -> None:
        self._since.pop(session, None)
        if self._deadlines is not None:
            self._deadlines.trim()

    def due(self, now: float) -> Iterator[tuple[float, str, float]]:
        """Live deadlines that have passed, earliest first: ``(deadline, session, since)``,
        each checked when it is reached (acting on one may make a later one stale). One the
        caller could not act on goes back with :meth:`retry` once the iteration is over."""
        if self._deadlines is None:
            return
        for entry in self._deadlines.pop_due(now):
            if self._since.get(entry[1]) == entry[2]:
                yield entry  # else resumed (and maybe parked again) since

    def retry(self, entry: tuple[float, str, float]) -> None:
        assert self._deadlines is not None
        self._deadlines.push(entry)


class Parking:
    """The running ↔ parked moves of a pausing policy, on its program table and ledger.

    The owner passes what it counts by (``programs``, ``calls``, ``ledger``, ``stats``) and
    how it admits held calls (``admit_waiting``); this class keeps the parking lot and the
    idle deadlines. Invariant: a parked session names a program of the table that is not
    ACTIVE (the owner unparks a program whenever it places or resumes it, and on release).
    """

    def __init__(self, programs: dict, calls: dict, ledger, stats, admit_waiting: Callable,
                 force_after_s: float | None, idle_release_s: float, growth_reserve_tokens: int) -> None:
        self.lot = ParkingLot(force_after_s)
        self._programs = programs
        self._calls = calls
        self._ledger = ledger
        self._stats = stats
        self._admit_waiting = admit_waiting
        self.idle_release_s = idle_release_s
        self.growth_reserve_tokens = growth_reserve_tokens
        # (deadline, session): when a program with nothing to run may be released as idle;
        # live while it is the program's latest (last activity + idle_release_s)
        self._idle = DeadlineHeap(self._idle_deadline_wanted, lambda: len(self._programs))

    def reconfigure(self, force_after_s: float | None, idle_release_s: float,
                    growth_reserve_tokens: int) -> None:
        self.lot.reconfigure(force_after_s)
        self.idle_release_s = idle_release_s
        self.growth_reserve_tokens = growth_reserve_tokens

    # -- pause and resume ----------------------------------------------------------------

    def pause(self, program: Program, now: float) -> str:
        """ACTIVE+ACTING → PAUSED and parked; returns the worker it left."""
        worker = program.home_worker
        assert worker is not None
        program.pause()
        self._ledger.refresh(program)
        self.lot.park(program.session_id, now)
        self._stats.pauses += 1
        return worker

    def resume(self, program: Program, worker: str, now: float, forced: bool,
               boost_s: float) -> list[Action]:
        """Place a PENDING program or resume a PAUSED one on ``worker`` and admit its held
        calls (a resumed program's ``boost_s`` earlier in the engine's queue)."""
        was_paused = program.paused
        if program.pending:
            program.place(worker, now)
        else:
            program.resume(worker, now)
        self.lot.unpark(program.session_id)
        self._ledger.refresh(program)
        actions: list[Action] = []
        if forced:
            self._stats.forced_resumes += 1
        if was_paused:
            self._stats.resumes += 1
            actions.append(Resume(program.session_id, worker, forced))
        actions += self._admit_waiting(program, worker, now, was_paused, boost_s if was_paused else 0.0)
        if not program.in_flight:
            self.note_idle(program, now)
        return actions

    def force_target(self, program: Program, room: dict[str, float] | None = None) -> str | None:
        """Where a forced resume of ``program`` goes: its home if it takes programs, else the
        emptiest worker; None when no worker takes programs or a PENDING program has nothing
        to run yet. ``room``: each worker's free tokens, when the caller keeps them."""
        if program.pending and not program.waiting:
            return None
        worker = program.home_worker
        if worker is None or not self._ledger.worker(worker).accepts_programs:
            worker = self.emptiest_worker(room)
        return worker

    def demand_when_resumed(self, program: Program) -> int:
        return program.waiting_demand_tokens(
            self.growth_reserve_tokens, lambda rid: self._calls[rid].request.prompt_tokens)

    def free_room(self) -> dict[str, float]:
        """Free tokens of each worker that takes programs, in the ledger's order."""
        return {load.name: load.capacity_tokens - self._ledger.load_tokens(load.name)
                for load in self._ledger.workers() if load.accepts_programs}

    def emptiest_worker(self, room: dict[str, float] | None = None) -> str | None:
        best, best_free = None, -math.inf
        for name, free in (room if room is not None else self.free_room()).items():
            if free > best_free:
                best, best_free = name, free
        return best

    # -- idle release --------------------------------------------------------------------

    def note_idle(self, program: Program, now: float) -> None:
        """``program`` has nothing to run from ``now`` on: release it after idle_release_s."""
        self._idle.push((now + self.idle_release_s, program.session_id))

    def held_call_gone(self, program: Program) -> None:
        """A held call of ``program`` went away: if that left it nothing to run, it is idle
        from its last activity on (without a deadline it would never be released)."""
        if not program.in_flight and not program.waiting:
            self.note_idle(program, program.last_activity)

    def idle_sessions(self, now: float) -> Iterator[str]:
        """Programs whose idle deadline passed and that stayed idle, deadline order."""
        for _, session in self._idle.pop_due(now):
            program = self._programs.get(session)
            if program is None or program.in_flight or program.waiting:
                continue
            if program.last_activity + self.idle_release_s > now:
                # Active again since; a newer deadline is in the heap. (Same arithmetic as
                # the deadline itself: ``now - last < idle`` can disagree by a rounding
                # hair, and the dropped deadline would never come back.)
                continue
            yield session

    def _idle_deadline_wanted(self, entry: tuple[float, str]) -> bool:
        program = self._programs.get(entry[1])
        return program is not None and entry[0] >= program.last_activity + self.idle_release_s

    def forget(self, session: str) -> None:
        """The program was released."""
        self.lot.unpark(session)
        self._idle.trim()
