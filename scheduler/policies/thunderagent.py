"""ThunderAgent as published: the algorithm Sluice's policy grew from, kept faithful.

Source: ThunderAgent (arXiv 2602.13692), repository ThunderAgent-org/ThunderAgent,
``scheduler/router.py`` and ``backend/state.py``:

- capacity used = Σ REASONING tokens + ``acting_token_weight``·Σ ACTING tokens − shared
  + 100 per program; a backend is over capacity when used > capacity (threshold 1.0, no
  separate pause target, no hysteresis, no soft band, no retention directives);
- tick every 5 s (``--scheduler-interval``; its section's ``scheduler_interval_s``) and only
  then (no tick on completions), resume before pause;
- pause: the smallest ACTING program first while over capacity; then every REASONING
  program on that backend is marked (marking does not lower ``remaining`` upstream, so
  the loop marks until none is left);
- resume ("best fit decreasing", in effect worst fit): groups REASONING-with-a-waiting-call,
  then new programs, then ACTING, smallest first; take the prefix whose (tokens + 100) fits
  the summed remaining capacity; place it largest first, each on the backend with the most
  remaining capacity; a backend with ≤ 100 tokens left takes nothing;
- a new program queues if any program is queued (paused, or held with a call waiting);
  otherwise it goes to the backend with the fewest active tokens among those with room
  (remaining ≥ tokens + 100);
- forced resume after 1800 s, to the original backend.

Built, like program_aware, on the shared parts of ``scheduler/policies/parking.py`` (the
parking lot, idle deadlines, the pause and resume moves) and none of program_aware's rules:
no resume queue, no soft band, no retention, no bounded waiting, no dormancy. Its config
section (:class:`ThunderAgentConfig`) carries only what the published code lets one set.
"""

from __future__ import annotations

import math

from scheduler.actions import Action, Decision, Mark, Pause
from scheduler.config import ThunderAgentConfig
from scheduler.ledger import FixedTokenWeights, TokenWeights
from scheduler.policies.base import Call, Policy, admit, hold
from scheduler.policies.parking import (
    IdleDeadlines,
    ParkingLot,
    demand_when_resumed,
    force_target,
)
from scheduler.programs import Phase, Program

BUFFER_PER_PROGRAM = 100


class ThunderAgentPolicy(Policy):
    name = "thunderagent"
    config: ThunderAgentConfig
    # Upstream schedules only in its periodic loop (``_scheduler_loop``), not on completions.
    ticks_after_completion = False

    def __init__(self, config: ThunderAgentConfig) -> None:
        super().__init__(config)
        # Forced resumes are found by scanning the lot each tick, as upstream does: no
        # deadline heap to keep.
        self._lot = ParkingLot(force_after_s=None)
        self._idle = IdleDeadlines(config.idle_release_s, self.programs)

    def token_weights(self, config: ThunderAgentConfig) -> TokenWeights:  # type: ignore[override]
        # upstream: acting programs count at acting_token_weight, 100 tokens per program
        return FixedTokenWeights(acting_token_weight=config.acting_token_weight,
                                 buffer_per_program=BUFFER_PER_PROGRAM)

    def reconfigure(self, config: ThunderAgentConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        self._idle.idle_release_s = config.idle_release_s

    # -- arrivals and completions ----------------------------------------------------

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        if program.active and program.home_worker is not None:
            if self.ledger.worker(program.home_worker).healthy:
                return admit(call, program.home_worker)
            self._unhome(program, now)
        if program.paused:
            return hold(call, "program paused")
        self._lot.park(program.session_id, now)
        if program.waiting or self._anyone_queued(program):
            return hold(call, "queued")
        demand = call.request.prompt_tokens
        best, best_tokens = None, math.inf
        for load in self.ledger.workers():
            if not load.accepts_programs:
                continue
            if self._remaining(load.name) < demand + BUFFER_PER_PROGRAM:
                continue
            if load.weighted_demand < best_tokens:
                best, best_tokens = load.name, load.weighted_demand
        if best is None:
            return hold(call, "no backend has room")
        self._lot.unpark(program.session_id)
        return admit(call, best)

    def after_call(self, program: Program, now: float) -> list[Action]:
        if program.in_flight:
            return []
        self._idle.note(program, now)
        if program.marked and program.active:
            return self._pause_program(program, now)
        return []

    def after_held_call(self, program: Program) -> None:
        self._idle.held_call_gone(program)

    def release(self, session_id, now, reason):  # type: ignore[override]
        actions = super().release(session_id, now, reason)
        self._lot.unpark(session_id)
        self._idle.trim()
        return actions

    def _unhome(self, program: Program, now: float) -> list[Action]:
        was_active = program.active
        actions = super()._unhome(program, now)
        if was_active:
            self._lot.park(program.session_id, now)
        return actions

    # -- the tick --------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for session in self._idle.due(now):
            actions += self.release(session, now, "idle")
        actions += self._resume(now)
        actions += self._pause(now)
        return actions

    def _remaining(self, worker: str) -> float:
        load = self.ledger.worker(worker)
        return load.capacity_tokens - self.ledger.load_tokens(worker)

    def _anyone_queued(self, program: Program) -> bool:
        """Upstream's ``global_waiting_queue`` holds every paused program, with or without a
        request waiting, and every held new one; a new program queues if it is not empty."""
        for session in self._lot.sessions():
            other = self.programs[session]
            if session != program.session_id and (other.paused or other.waiting):
                return True
        return False

    # -- pause -----------------------------------------------------------------------

    def _pause(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for load in self.ledger.workers():
            if not load.capacity_tokens or self._remaining(load.name) >= 0:
                continue
            on_worker = [self.programs[s] for s in load.programs]
            acting = sorted(
                (p for p in on_worker if p.phase is Phase.ACTING),
                key=lambda p: (p.context_tokens, p.session_id),
            )
            for program in acting:
                if self._remaining(load.name) >= 0:
                    break
                actions += self._pause_program(program, now)
            if self._remaining(load.name) >= 0:
                continue
            for program in sorted(
                (p for p in on_worker if p.phase is Phase.REASONING and not p.marked),
                key=lambda p: (p.demand_tokens(), p.session_id),
            ):
                program.mark()
                self.stats.marks += 1
                actions.append(Mark(program.session_id, load.name))
        return actions

    def _pause_program(self, program: Program, now: float) -> list[Action]:
        worker = self._lot.pause(program, self.ledger, self.stats, now)
        return [Pause(program.session_id, worker)]  # no retention directives upstream

    # -- resume ----------------------------------------------------------------------

    def _force_resume_if_due(self, session: str, now: float) -> list[Action] | None:
        """The forced resume: a program parked ``force_resume_after_s`` goes back to its
        worker (else the emptiest), room or not; no worker takes it: nothing yet. None when it
        is not due."""
        since = self._lot.since(session)
        if since is None or now - since < self.config.force_resume_after_s:
            return None
        program = self.programs[session]
        worker = force_target(program, self.ledger)
        return [] if worker is None else self._resume_program(program, worker, now, forced=True)

    def _resume(self, now: float) -> list[Action]:
        lot = self._lot
        if not len(lot):
            return []
        actions: list[Action] = []
        candidates = []
        for session in lot.sessions():
            forced = self._force_resume_if_due(session, now)
            if forced is not None:
                actions += forced
                continue
            program = self.programs[session]
            if program.pending and not program.waiting:
                continue
            group = 0 if (program.paused and program.waiting) else (1 if program.pending else 2)
            candidates.append((group, demand_when_resumed(program, self.calls, self.config.growth_reserve_tokens),
                               session))
        remaining = {
            load.name: self._remaining(load.name)
            for load in self.ledger.workers()
            if load.accepts_programs and self._remaining(load.name) > BUFFER_PER_PROGRAM
        }
        if not candidates or not remaining:
            return actions
        candidates.sort()
        total = sum(remaining.values())
        selected = []
        used = 0.0
        for _group, demand, session in candidates:
            if used + demand + BUFFER_PER_PROGRAM > total:
                break
            used += demand + BUFFER_PER_PROGRAM
            selected.append((demand, session))
        for demand, session in sorted(selected, key=lambda item: (-item[0], item[1])):
            if not remaining:
                break
            worker = max(remaining, key=lambda w: (remaining[w], w))
            if remaining[worker] < demand + BUFFER_PER_PROGRAM:
                continue
            program = self.programs[session]
            actions += self._resume_program(program, worker, now, forced=False)
            remaining[worker] = self._remaining(worker)
            if remaining[worker] <= BUFFER_PER_PROGRAM:
                del remaining[worker]
        return actions

    def _resume_program(self, program: Program, worker: str, now: float, forced: bool) -> list[Action]:
        """Place or resume ``program`` on ``worker`` and admit its held calls, at their place
        in the engine's queue (upstream gives resumed programs no boost)."""
        was_paused = program.paused
        actions = self._lot.resume(program, worker, self.ledger, self.stats, now, forced)
        actions += self._admit_waiting(program, worker, now, was_paused, 0.0)
        if not program.in_flight:
            self._idle.note(program, now)
        return actions
