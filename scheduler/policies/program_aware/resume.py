"""The parked programs and who of them resumes when, where and why (architecture.md §3
"Resume", design notes "Policy v2" on bounded waiting).

A program is parked while it is PAUSED, or PENDING with a call held. Four ways back, in
the tick's order:

- **overdue**: a call held ``max_wait_s`` (stretched under deep overload, shortened by the
  client's deadline) goes ahead with its program, room or not: its home, else the emptiest
  worker;
- **forced**: a program parked ``force_resume_after_s`` resumes the same way;
  these two share one budget per tick, ``max_forced_per_tick`` (:meth:`Resumption.begin_tick`):
  past it, the rest stay due and go first in the following ticks, earliest deadline first;
- **reserved**: a waiting program larger than any worker's resume limit gets a worker
  reserved for it (:class:`.placement.Reservations`) and resumes there once it fits or,
  forced, once nothing there is reasoning any more;
- **in order**: the rest by the resume queue (:mod:`scheduler.resume_queue`), each onto
  :meth:`.placement.Placement.resume_target`, while some worker has headroom for the
  smallest.

This room decides; the policy makes each move (and the rooms' bookkeeping around it)
between two of its steps. Besides, it keeps when programs with nothing to run may be
released as idle.

Invariant 1: a session is in the resume queue exactly while it is parked and not PENDING
with nothing to run, at the place its current group, demand and priority give
(:meth:`Resumption.requeue` runs after every change of those).

Invariant 2: every held call with a wait limit has a live ``(deadline, request_id)`` in
``_wait_deadlines`` until it is admitted or gone; an overdue one that could not go ahead
stays due (it is pushed back and retried at the next tick), and so does one the tick's
budget of forced resumes left (never popped).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from scheduler.actions import Action
from scheduler.calls import CallRequest
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.deadline_heap import DeadlineHeap
from scheduler.ledger import Ledger
from scheduler.policies.base import Call, PolicyStats
from scheduler.policies.parking import (
    IdleDeadlines,
    ParkingLot,
    demand_when_resumed,
    force_target,
    free_room,
)
from scheduler.policies.program_aware.placement import Placement
from scheduler.programs import Program
from scheduler.resume_queue import IDLE, NEW, WAITING, ResumeQueue


class Resumption:
    """The parking lot, the resume order, held calls' wait limits and idle deadlines.
    Reads the program and call tables; changes a program only by parking, pausing, placing
    or resuming it."""

    def __init__(self, config: ProgramAwareConfig, ledger: Ledger, placement: Placement,
                 programs: Mapping[SessionId, Program], calls: Mapping[str, Call]) -> None:
        self.config = config
        self.lot = ParkingLot(config.force_resume_after_s)
        self._idle = IdleDeadlines(config.idle_release_s, programs)
        self._queue = ResumeQueue(config.resume_aging_halflife_s)
        # (deadline, request_id): when a held call reaches its wait limit
        self._wait_deadlines: DeadlineHeap[tuple[float, str]] = DeadlineHeap(
            self._still_held, lambda: len(calls))
        self._ledger = ledger
        self._placement = placement
        self._programs = programs
        self._calls = calls
        self._forced_left: float = math.inf  # this tick's budget of forced resumes

    def reconfigure(self, config: ProgramAwareConfig) -> None:
        halflife = self.config.resume_aging_halflife_s
        self.config = config
        self.lot.reconfigure(config.force_resume_after_s)
        self._idle.idle_release_s = config.idle_release_s
        if config.resume_aging_halflife_s != halflife:
            # The resume order's keys depend on the half-life: rebuild it.
            self._queue = ResumeQueue(config.resume_aging_halflife_s)
            for session in self.lot.sessions():
                self.requeue(self._programs[session])

    # -- parking and unparking -----------------------------------------------------------

    def park(self, program: Program, now: float) -> None:
        self.lot.park(program.session_id, now)
        self.requeue(program)  # keeps invariant 1

    def unpark(self, program: Program) -> None:
        """A new program is placed at once."""
        self.lot.unpark(program.session_id)
        self._queue.discard(program.session_id)  # keeps invariant 1

    def pause(self, program: Program, stats: PolicyStats, now: float) -> str:
        """ACTIVE+ACTING → PAUSED and parked; returns the worker it left."""
        worker = self.lot.pause(program, self._ledger, stats, now)
        self.requeue(program)  # keeps invariant 1
        return worker

    def resume(self, program: Program, worker: str, stats: PolicyStats, now: float,
               forced: bool) -> list[Action]:
        """Place or resume ``program`` on ``worker``, out of the lot; its held calls are the
        caller's to admit."""
        self._queue.discard(program.session_id)  # keeps invariant 1
        return self.lot.resume(program, worker, self._ledger, stats, now, forced)

    def requeue(self, program: Program) -> None:
        """Put a parked program at its place in the resume order (or take it out)."""
        session = program.session_id
        since = self.lot.since(session)
        if since is None or (program.pending and not program.waiting):
            self._queue.discard(session)  # not parked, or nothing to run yet
            return
        demand = self.demand_when_resumed(program)
        if program.waiting:
            group = WAITING if program.paused else NEW
        else:
            group = IDLE
            demand = int(demand * self.config.acting_token_weight)
        self._queue.put(session, group, demand, since, program.priority)

    def demand_when_resumed(self, program: Program) -> int:
        return demand_when_resumed(program, self._calls, self.config.growth_reserve_tokens)

    def oversubscription(self) -> float:
        """What the programs that want to run ask of the fleet's KV, in pools: the load of
        the workers that take programs (as ``U`` counts it) and the demand of the parked
        programs with a call waiting, over those workers' capacity (0 with no capacity)."""
        capacity = load = 0
        for worker in self._ledger.workers():
            if worker.accepts_programs:
                capacity += worker.capacity_tokens or 0
                load += self._ledger.load_tokens(worker.name)
        return (load + self._queue.waiting_demand) / capacity if capacity else 0.0

    def someone_waits(self, program: Program) -> bool:
        """Whether another program waits with a call (a new one then queues behind it)."""
        own = 1 if program.session_id in self._queue and program.waiting else 0
        return self._queue.with_calls - own > 0

    # -- calls coming and going ----------------------------------------------------------

    def held(self, program: Program, request: CallRequest, now: float) -> None:
        """A call of ``program`` was held."""
        self.requeue(program)
        wait = self._longest_wait(request)
        if wait is not None:
            self._wait_deadlines.push((now + wait, request.request_id))  # keeps invariant 2

    def _longest_wait(self, request: CallRequest) -> float | None:
        """How long a held call may wait before it goes ahead: ``max_wait_s`` stretched by
        :meth:`wait_stretch`, shortened by the client's deadline (``CallHints.deadline_s``,
        never stretched); None: until there is room."""
        deadline = request.hints.deadline_s if request.hints is not None else None
        own = self.config.max_wait_s
        if own is not None:
            own *= self.wait_stretch()
        if deadline is None:
            return own
        if own is None:
            return deadline
        return min(deadline, own)

    def wait_stretch(self) -> float:
        """How much longer than ``max_wait_s`` a call held now may wait: the fleet's
        :meth:`oversubscription` over ``wait_stretch_from``, between 1 and
        ``max_wait_stretch``. Under deep overload a program must spend most of its life
        waiting (Little's law); bounded below that, each overdue call resumes its program by
        force into a full pool, and the pause pass evicts another to make room for it."""
        start = self.config.wait_stretch_from
        if start is None:
            return 1.0
        return min(self.config.max_wait_stretch, max(1.0, self.oversubscription() / start))

    def call_ended(self, program: Program, now: float) -> None:
        """A call of ``program`` ended (completed or aborted)."""
        if program.session_id in self.lot:
            self.requeue(program)  # a re-homed program's call ended: its demand changed
        if not program.in_flight:
            self._idle.note(program, now)

    def held_call_gone(self, program: Program) -> None:
        self.requeue(program)  # its waiting demand changed
        self._idle.held_call_gone(program)

    def note_idle(self, program: Program, now: float) -> None:
        self._idle.note(program, now)

    def idle_sessions(self, now: float) -> Iterator[str]:
        return self._idle.due(now)

    def forget(self, session: str) -> None:
        """The program was released."""
        self.lot.unpark(session)
        self._idle.trim()
        self._queue.discard(session)
        self._wait_deadlines.trim()

    # -- the ways back, in the tick's order -------------------------------------------------

    def begin_tick(self) -> None:
        """A tick starts: its budget of forced resumes is ``max_forced_per_tick``."""
        cap = self.config.max_forced_per_tick
        self._forced_left = math.inf if cap is None else cap

    @property
    def forced_budget_spent(self) -> bool:
        """Whether this tick has made all the forced resumes ``max_forced_per_tick`` allows
        (then overdue calls and programs may be left for the following ticks)."""
        return self._forced_left <= 0

    def overdue(self, now: float) -> Iterator[tuple[Program, str]]:
        """(program, worker) for each call held past its wait limit, to resume by force,
        earliest deadline first, while the tick's budget lasts (the rest stay in the heap, due
        at the next tick). Retried at every tick while no worker accepts programs (a worker
        may come back between two ticks)."""
        retry: list[tuple[float, str]] = []
        room: dict[str, float] | None = None  # kept across this tick's forced resumes
        for entry in self._wait_deadlines.pop_due(now) if self._forced_left > 0 else ():
            call = self._calls.get(entry[1])
            if call is None or call.worker is not None:
                continue  # admitted or gone
            program = self._programs[call.session_id]
            if room is None:
                room = free_room(self._ledger)
            worker = force_target(program, self._ledger, room)
            if worker is None:
                retry.append(entry)  # overdue still: due again at the very next tick
                continue
            yield program, worker
            self._forced_left -= 1
            if worker in room:  # only its worker's room changed
                capacity = self._ledger.worker(worker).capacity_tokens
                room[worker] = capacity - self._ledger.load_tokens(worker)
            if self._forced_left <= 0:
                break  # the rest stay in the heap (invariant 2)
        for entry in retry:
            self._wait_deadlines.push(entry)  # keeps invariant 2

    def forced(self, now: float) -> Iterator[tuple[Program, str]]:
        """(program, worker) for each program parked ``force_resume_after_s``, room or not,
        earliest deadline first, while the tick's budget lasts (the rest stay due)."""
        retry = []
        for entry in self.lot.due(now) if self._forced_left > 0 else ():
            program = self._programs[entry[1]]
            worker = force_target(program, self._ledger)
            if worker is None:
                retry.append(entry)  # nothing to run yet, or no worker: try again next tick
                continue
            yield program, worker
            self._forced_left -= 1
            if self._forced_left <= 0:
                break  # the rest stay in the lot's heap, due at the next tick
        for entry in retry:
            self.lot.retry(entry)

    def reservation(self) -> tuple[Program, str, bool] | None:
        """A waiting program larger than any worker's resume limit would only ever run by a
        forced resume. Reserve a worker for it (its home, else the largest): nothing else is
        placed there, and it resumes as soon as it fits under the resume limit or, forced,
        once nothing there is reasoning any more (the worker has drained all it can). One
        reservation at a time: the first such program in the resume order. Returns
        (program, worker, forced) when the reserved program resumes now."""
        reservations, config = self._placement.reservations, self.config
        limit = config.pause_threshold - config.resume_hysteresis
        for worker, session in reservations.held().items():
            program = self._programs.get(session)
            load = self._ledger.worker(worker)
            if program is None or program.active or not program.waiting or not load.accepts_programs:
                reservations.cancel(worker)  # keeps invariant 1 of Reservations
                continue
            demand = self.demand_when_resumed(program)
            reasoning = any(self._programs[s].in_flight for s in load.programs)
            fits = self._placement.fits(worker, demand, limit)
            if fits or not reasoning:
                reservations.cancel(worker)
                return program, worker, not fits
            return None
        largest = max((load.capacity_tokens for load in self._ledger.workers() if load.accepts_programs),
                      default=0)
        if not largest:
            return None  # no worker takes programs: nothing to reserve
        biggest = self._queue.largest_waiting_demand()
        if biggest is None or biggest + config.buffer_per_program <= limit * largest:
            return None  # every waiting program fits somewhere: no need to walk the queue
        for session, demand in self._queue.in_order():
            program = self._programs[session]
            if not program.waiting:
                break  # the waiting groups come first
            if demand + config.buffer_per_program > limit * largest:
                home = program.home_worker
                if home is None or not self._ledger.worker(home).accepts_programs:
                    home = max((load for load in self._ledger.workers() if load.accepts_programs),
                               key=lambda load: (load.capacity_tokens, load.name)).name
                reservations.reserve(home, session)
                break
        return None

    def in_order(self) -> Iterator[tuple[Program, str]]:
        """(program, worker) in resume order, each one that fits somewhere, while some
        worker has headroom for the smallest; the caller resumes each before the next."""
        queue, placement = self._queue, self._placement
        if not len(queue):
            return
        limit = placement.capacity.highest_threshold() - self.config.resume_hysteresis
        buffer = self.config.buffer_per_program
        headroom = placement.max_headroom(limit)
        smallest = queue.min_demand()
        if smallest is None or smallest + buffer > headroom:
            return
        # Only the entries that fit the headroom are read (ResumeQueue.fitting), in resume
        # order: a resume takes only its own program out of the queue and adds load, so the
        # headroom shrinks and what did not fit still does not; should it grow (a resumed
        # program sharing much of a worker's prefix), what follows is read again.
        after = None
        while True:
            bound = headroom
            fresh = True
            for key, demand in queue.fitting(bound - buffer + 1, after):  # a token of slack
                session = key[3]
                if demand + buffer > headroom or queue.demand(session) != demand:
                    continue  # too large for the headroom left, or resumed meanwhile
                program = self._programs[session]
                worker = placement.resume_target(program, demand)
                if worker is None:
                    continue
                yield program, worker
                headroom = placement.max_headroom(limit)
                smallest = queue.min_demand()
                if smallest is None or smallest + buffer > headroom:
                    return
                if headroom > bound:
                    after, fresh = key, False  # more may fit now: read what follows again
                    break
            if fresh:
                return

    def _still_held(self, entry: tuple[float, str]) -> bool:
        call = self._calls.get(entry[1])
        return call is not None and call.worker is None
