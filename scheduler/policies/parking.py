"""The parking lot the pausing policies (program_aware, thunderagent) are both built from.

- :class:`ParkingLot`: the programs that are not running and wait to be resumed or placed,
  each with when it was parked and (optionally) when it must be forced back; and the two
  moves across its edge, pausing a running program into it and placing or resuming one out
  of it, made alike by both policies.
- :class:`IdleDeadlines`: when a program with nothing to run may be released as idle.

Each policy composes them itself (thunderagent in its own module, program_aware in
``scheduler/policies/program_aware/resume.py``), with the functions below for the numbers
both read. Each policy keeps its own rules (when to pause, whom to resume where).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from scheduler.actions import Action, Resume
from scheduler.coordinates import SessionId
from scheduler.deadline_heap import DeadlineHeap
from scheduler.ledger import Ledger
from scheduler.policies.base import Call, PolicyStats
from scheduler.programs import Program


class ParkingLot:
    """Programs that are not running and wait for a worker: PAUSED ones, and PENDING ones
    with a call waiting to be placed. Per program, when it was parked (a forced resume counts
    from there), oldest first.

    With ``force_after_s``, it also keeps when each parked program is due for a forced resume
    (:meth:`due`). Invariant 1: every parked program has exactly one live deadline
    ``(since + force_after_s, session, since)`` (``force_after_s`` as when it was parked), and
    the heap's other entries are stale. Invariant 2: a parked session names a program of its
    owner's table that is not ACTIVE (placing or resuming one unparks it here, and the owner
    unparks a program it releases).
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
            self._deadlines.push((now + self._force_after_s, session, now))  # keeps invariant 1

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
        if self._deadlines is None:
            raise RuntimeError("a parking lot without force-resume deadlines has none to retry")
        self._deadlines.push(entry)

    # -- the moves across the lot's edge ---------------------------------------------------

    def pause(self, program: Program, ledger: Ledger, stats: PolicyStats, now: float) -> str:
        """ACTIVE+ACTING → PAUSED and parked; returns the worker it left."""
        worker = program.home_worker
        if worker is None:
            raise ValueError(f"{program.session_id}: an unplaced program cannot pause")
        program.pause()
        ledger.refresh(program)
        self.park(program.session_id, now)
        stats.pauses += 1
        return worker

    def resume(self, program: Program, worker: str, ledger: Ledger, stats: PolicyStats,
               now: float, forced: bool) -> list[Action]:
        """Place a PENDING program or resume a PAUSED one on ``worker``, out of the lot;
        returns :class:`Resume` for a paused one. The caller admits its held calls."""
        was_paused = program.paused
        if program.pending:
            program.place(worker, now)
        else:
            program.resume(worker, now)
        self.unpark(program.session_id)  # keeps invariant 2: ACTIVE again, parked no more
        ledger.refresh(program)
        if forced:
            stats.forced_resumes += 1
        if not was_paused:
            return []
        stats.resumes += 1
        return [Resume(program.session_id, worker, forced)]


class IdleDeadlines:
    """When each program with nothing to run may be released as idle: ``idle_release_s``
    after its last activity. A deadline is live while it is its program's latest; the program
    table (read, never changed) tells the stale ones."""

    def __init__(self, idle_release_s: float, programs: Mapping[SessionId, Program]) -> None:
        self.idle_release_s = idle_release_s
        self._programs = programs
        # (deadline, session), live while deadline ≥ last activity + idle_release_s
        self._heap: DeadlineHeap[tuple[float, str]] = DeadlineHeap(self._wanted, lambda: len(programs))

    def note(self, program: Program, now: float) -> None:
        """``program`` has nothing to run from ``now`` on: release it after idle_release_s."""
        self._heap.push((now + self.idle_release_s, program.session_id))

    def held_call_gone(self, program: Program) -> None:
        """A held call of ``program`` went away: if that left it nothing to run, it is idle
        from its last activity on (without a deadline it would never be released)."""
        if not program.in_flight and not program.waiting:
            self.note(program, program.last_activity)

    def due(self, now: float) -> Iterator[str]:
        """Programs whose idle deadline passed and that stayed idle, deadline order."""
        for _, session in self._heap.pop_due(now):
            program = self._programs.get(session)
            if program is None or program.in_flight or program.waiting:
                continue
            if program.last_activity + self.idle_release_s > now:
                # Active again since; a newer deadline is in the heap. (Same arithmetic as
                # the deadline itself: ``now - last < idle`` can disagree by a rounding
                # hair, and the dropped deadline would never come back.)
                continue
            yield session

    def trim(self) -> None:
        """A program was released: its deadlines may go."""
        self._heap.trim()

    def _wanted(self, entry: tuple[float, str]) -> bool:
        program = self._programs.get(entry[1])
        return program is not None and entry[0] >= program.last_activity + self.idle_release_s


def demand_when_resumed(program: Program, calls: Mapping[str, Call], growth_reserve_tokens: int) -> int:
    """The tokens a parked program needs once its held calls are admitted."""
    return program.waiting_demand_tokens(growth_reserve_tokens, lambda rid: calls[rid].request.prompt_tokens)


def free_room(ledger: Ledger) -> dict[str, float]:
    """Free tokens of each worker that takes programs, in the ledger's order."""
    return {load.name: load.capacity_tokens - ledger.load_tokens(load.name)
            for load in ledger.workers() if load.accepts_programs}


def force_target(program: Program, ledger: Ledger, room: dict[str, float] | None = None) -> str | None:
    """Where a forced resume of ``program`` goes: its home if it takes programs, else the
    emptiest worker; None when no worker takes programs or a PENDING program has nothing to
    run yet. ``room``: each worker's free tokens (:func:`free_room`), when the caller keeps
    them."""
    if program.pending and not program.waiting:
        return None
    worker = program.home_worker
    if worker is None or not ledger.worker(worker).accepts_programs:
        worker = emptiest_worker(room if room is not None else free_room(ledger))
    return worker


def emptiest_worker(room: dict[str, float]) -> str | None:
    """The worker with the most free tokens, the first of equals in ``room``'s order."""
    return max(room, key=room.__getitem__) if room else None
