"""ThunderAgent as published: the algorithm Sluice's policy grew from, kept faithful.

Source: ThunderAgent (arXiv 2602.13692), repository ThunderAgent-org/ThunderAgent,
``scheduler/router.py`` and ``backend/state.py``:

- capacity used = Σ REASONING tokens + ``acting_token_weight``·Σ ACTING tokens − shared
  + 100 per program; a backend is over capacity when used > capacity (threshold 1.0, no
  separate pause target, no hysteresis, no soft band, no retention directives);
- tick every 5 s (``--scheduler-interval``; ``baselines.thunderagent_tick_s``) and only
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
"""

from __future__ import annotations

import math

from scheduler.actions import Action, Decision, Mark
from scheduler.config import PolicyConfig
from scheduler.programs import Phase, Program
from scheduler.policies.base import Call, hold
from scheduler.policies.program_aware import ProgramAwarePolicy

BUFFER_PER_PROGRAM = 100


class ThunderAgentPolicy(ProgramAwarePolicy):
    name = "thunderagent"
    # Upstream schedules only in its periodic loop (``_scheduler_loop``), not on completions.
    ticks_after_completion = False

    def __init__(self, config: PolicyConfig) -> None:
        faithful = config.model_copy(
            update={
                "pause_threshold": 1.0,
                "pause_target": 1.0,
                "resume_hysteresis": 0.0,
                "buffer_per_program": BUFFER_PER_PROGRAM,
                "soft_band_penalty": 0.0,
                "resume_priority_boost_s": 0.0,
                "tick_interval_s": config.baselines.thunderagent_tick_s,
                "retention": config.retention.model_copy(update={"enabled": False}),
                # Sluice v2's additions, which upstream does not have
                "max_wait_s": None,
                "dormant_quantile": None,
            }
        )
        super().__init__(faithful)

    def reconfigure(self, config: PolicyConfig) -> None:
        # The thresholds are the published ones; only the baseline knobs may change, and
        # the tick follows ``baselines.thunderagent_tick_s``.
        if config.name != self.config.name:
            raise ValueError(f"cannot switch policy from {self.config.name} to {config.name} live")
        self.config = self.config.model_copy(
            update={"baselines": config.baselines,
                    "tick_interval_s": config.baselines.thunderagent_tick_s}
        )
        self.ledger.reconfigure(self.config)

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        actions += self._release_idle(now)
        actions += self._resume(now)
        actions += self._pause(now)
        return actions

    def _remaining(self, worker: str) -> float:
        load = self.ledger.worker(worker)
        return load.capacity_tokens - self.ledger.load_tokens(worker)

    # -- new programs ----------------------------------------------------------------

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        known = self._arrival_of_known(program, call, now)
        if known is not None:
            return known
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
        self._unpark(program)
        return self._admit(call, best)

    def _anyone_queued(self, program: Program) -> bool:
        """Upstream's ``global_waiting_queue`` holds every paused program, with or without a
        request waiting, and every held new one; a new program queues if it is not empty."""
        for session in self._parked:
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

    # -- resume ----------------------------------------------------------------------

    def _resume(self, now: float) -> list[Action]:
        if not self._parked:
            return []
        actions: list[Action] = []
        candidates = []
        for session in list(self._parked):
            program = self.programs[session]
            if now - self._parked_since(program) >= self.config.force_resume_after_s:
                actions += self._force_resume(program, now)
                continue
            if program.pending and not program.waiting:
                continue
            group = 0 if (program.paused and program.waiting) else (1 if program.pending else 2)
            candidates.append((group, self._demand_when_resumed(program), session))
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
