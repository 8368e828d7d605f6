"""The program-aware policy's façade: the interface of :class:`Policy`, a tick in its
order, and the moves (pause, resume) that touch several rooms at once.

Each room decides one thing and owns its state; this class asks them in turn and carries
out what they decide. Rooms read one another one way (resume reads placement, which reads
capacity) and none calls back into the policy:

- :mod:`.capacity`: a worker's threshold (the GPU pool, or a host tier's overcommit);
- :mod:`.placement`: new programs' workers, resume targets, prefix credit, reservations;
- :mod:`.resume`: the parked programs and who resumes when (overdue, forced, reserved, in order);
- :mod:`.pausing`: pauses, marks, the soft band;
- :mod:`.dormancy`: tool-time cutoff, dormant programs, predicted tool-call ends;
- :mod:`.keep`: the retention directives (Retain, Demote, Offload, Prefetch).

Invariant 1: between two calls into the policy, a program is parked
(:class:`scheduler.policies.parking.ParkingLot`) exactly while it is not ACTIVE: a pause, a
failed worker or an arrival with no room parks it, every placement or resume takes it out
of the lot, and a release forgets it in every room.

Invariant 2: a resume that is not forced leaves its worker at ``U ≤`` its threshold less
``resume_hysteresis``.

Invariant 3: after a tick, while some worker takes programs, no call has been held
``max_wait_s`` (stretched by the oversubscription when it was held, :meth:`.resume.Resumption.
wait_stretch`; or its client's deadline) and no program has been PAUSED ``force_resume_after_s``,
unless the tick made ``max_forced_per_tick`` forced resumes: at most that many per tick, earliest
deadline first, and the rest go in the following ticks (:meth:`.resume.Resumption.begin_tick`).

Invariant 4: nothing in flight is ever aborted: a program pauses only between calls, and one
marked while reasoning pauses when its last call ends.
"""

from __future__ import annotations

from scheduler.actions import Action, Admit, Decision, Mark, Pause
from scheduler.calls import CallRequest
from scheduler.config import ProgramAwareConfig
from scheduler.ledger import TokenWeights
from scheduler.policies.base import Call, Policy, hold
from scheduler.policies.program_aware.capacity import capacity_for
from scheduler.policies.program_aware.dormancy import Dormancy
from scheduler.policies.program_aware.keep import Keep
from scheduler.policies.program_aware.pausing import Pausing
from scheduler.policies.program_aware.placement import Placement
from scheduler.policies.program_aware.resume import Resumption
from scheduler.programs import Program


class ProgramAwarePolicy(Policy):
    name = "program_aware"
    config: ProgramAwareConfig

    def __init__(self, config: ProgramAwareConfig) -> None:
        super().__init__(config)
        self._capacity = capacity_for(config, self.ledger, self.index)
        self._placement = Placement(config, self._capacity, self.ledger, self.index,
                                    self.programs, self.groups, self.calls)
        self._resume = Resumption(config, self.ledger, self._placement, self.programs, self.calls)
        self._pausing = Pausing(config, self._capacity, self.ledger, self.programs)
        self._dormancy = Dormancy(config, self.ledger, self.programs)
        self._keep = Keep(config.retention, self.index, self.programs)

    def token_weights(self, config: ProgramAwareConfig) -> TokenWeights:  # type: ignore[override]
        return config

    def reconfigure(self, config: ProgramAwareConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        # a fresh strategy: what it counts is recounted before it is next read
        self._capacity = capacity_for(config, self.ledger, self.index)
        self._placement.reconfigure(config, self._capacity)
        self._pausing.reconfigure(config, self._capacity)
        self._resume.reconfigure(config)
        self._dormancy.reconfigure(config)
        self._keep.reconfigure(config.retention)

    def forget_worker(self, name: str) -> None:
        self._placement.reservations.cancel(name)
        self._capacity.forget_worker(name)

    # -- what a shell or an admin reads --------------------------------------------------

    def prefix_credit(self, worker: str, call: Call) -> float:
        return self._placement.prefix_credit(worker, call)

    def projected_utilization(self, worker: str) -> float:
        return self._pausing.projected_utilization(worker)

    def in_soft_band(self, worker: str) -> bool:
        return worker in self._pausing.soft_band

    def tool_time_cutoff(self) -> float | None:
        return self._dormancy.cutoff()

    def adaptive_settings(self) -> dict[str, float]:
        settings = {"wait_stretch": self._resume.wait_stretch()}
        cutoff = self._dormancy.cutoff()
        if cutoff is not None:
            settings["dormancy_cutoff_s"] = cutoff
        return settings

    # -- arrivals and completions ----------------------------------------------------

    def on_arrival(self, request: CallRequest, now: float) -> Decision:
        program = self.programs.get(request.session_id)
        if program is not None:
            self._dormancy.observe_arrival(program, now)
        decision = super().on_arrival(request, now)
        if not isinstance(decision, Admit):
            held = self.programs[request.session_id]
            self._resume.held(held, request, now)
            self._keep.held(held)
        return decision

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        known = self._arrival_of_known(program, call, now)
        if known is not None:
            return known
        if program.waiting:
            return hold(call, "program waiting for room")
        if self._resume.someone_waits(program):
            return hold(call, "queued behind waiting programs")
        worker = self._placement.new_program_worker(program, call, self._pausing.soft_band)
        if worker is None:
            return hold(call, "no worker has room")
        self._resume.unpark(program)  # keeps invariant 1
        self._keep.placed(program.session_id)
        return self._admit(call, worker)

    def _arrival_of_known(self, program: Program, call: Call, now: float) -> Decision | None:
        """An ACTIVE program's call goes home; a PAUSED one's waits. None: place it anew
        (the program is then PENDING and parked)."""
        if program.active and program.home_worker is not None:
            if self.ledger.worker(program.home_worker).healthy:
                self._keep.arrived_home(program)
                return self._admit(call, program.home_worker)
            self._unhome(program, now)
        if program.paused:
            return hold(call, "program paused")
        self._resume.park(program, now)  # keeps invariant 1
        return None

    def _admit(self, call: Call, worker: str) -> Admit:
        delay = self.config.soft_band_delay_s if worker in self._pausing.soft_band else 0.0
        return Admit(call.request.request_id, call.session_id, worker, call.arrived_at + delay)

    def after_call(self, program: Program, now: float) -> list[Action]:
        self._resume.call_ended(program, now)
        if program.in_flight:
            return []
        self._dormancy.watch(program)
        if program.marked and program.active:  # keeps invariant 4
            return self._pause_program(program, now)
        return []

    def after_held_call(self, program: Program) -> None:
        self._resume.held_call_gone(program)

    def release(self, session_id, now, reason):  # type: ignore[override]
        actions = super().release(session_id, now, reason)
        self._resume.forget(session_id)  # keeps invariant 1
        self._keep.forget(session_id)
        self._dormancy.trim()
        return actions

    def _unhome(self, program: Program, now: float) -> list[Action]:
        was_active = program.active
        actions = super()._unhome(program, now)
        if was_active:
            self._resume.park(program, now)  # keeps invariant 1
        return actions

    # -- the tick --------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Release idle programs → dormancy → predicted prefetches → overdue calls → resume
        (forced, reserved, in order) → pause → soft band → retention."""
        actions: list[Action] = []
        self._resume.begin_tick()
        for session in self._resume.idle_sessions(now):
            actions += self.release(session, now, "idle")
        self._capacity.recount(self.programs.values())
        actions += self._mark_dormant(now)
        actions += [self._keep.tool_call_ends(program) for program in self._dormancy.predicted_ends(now)]
        actions += self._overdue(now)
        actions += self._resume_pass(now)
        actions += self._pause(now)
        self._pausing.update_soft_band()
        actions += self._keep.retain(now)
        return actions

    def _mark_dormant(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for program in self._dormancy.turning_dormant(now):
            self.stats.dormant += 1
            offload = self._keep.turned_dormant(program)
            if offload is not None:
                actions.append(offload)
                if self._keep.prefetches_predicted:
                    self._dormancy.predict_end(program, now)
        return actions

    def _overdue(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for program, worker in self._resume.overdue(now):  # keeps invariant 3
            actions += self._resume_program(program, worker, now, forced=True)
            self.stats.wait_limit_resumes += 1
        return actions

    def _resume_pass(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for program, worker in self._resume.forced(now):  # keeps invariant 3
            actions += self._resume_program(program, worker, now, forced=True)
        reserved = self._resume.reservation()
        if reserved is not None:
            program, worker, forced = reserved
            actions += self._resume_program(program, worker, now, forced)
        for program, worker in self._resume.in_order():  # each keeps invariant 2
            actions += self._resume_program(program, worker, now, forced=False)
        return actions

    def _pause(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for step in self._pausing.pass_over_workers():
            if isinstance(step, Mark):
                self.stats.marks += 1
                actions.append(step)
            else:
                actions += self._pause_program(step, now)
        return actions

    # -- the moves -------------------------------------------------------------------

    def _pause_program(self, program: Program, now: float) -> list[Action]:
        worker = self._resume.pause(program, self.stats, now)  # keeps invariant 1
        self._capacity.note_paused(worker, program.demand_tokens())
        return [Pause(program.session_id, worker), *self._keep.paused(program, worker)]

    def _resume_program(self, program: Program, worker: str, now: float, forced: bool) -> list[Action]:
        was_paused = program.paused
        self._keep.placed(program.session_id)
        actions = self._resume.resume(program, worker, self.stats, now, forced)  # keeps invariant 1
        boost = self.config.resume_priority_boost_s if was_paused else 0.0
        actions += self._admit_waiting(program, worker, now, was_paused, boost, self.config.held_call_lead_s)
        if not program.in_flight:
            self._resume.note_idle(program, now)
        if was_paused:
            # first, naming the prompt of the calls just admitted: the tier keeps its KV
            # until they load it
            actions[:0] = self._keep.resumed(program, worker)
        return actions
