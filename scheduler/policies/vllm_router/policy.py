"""The vllm_router policy: the Policy interface over the request pool, Progress-TTL, capacity
repair and resume (the package docstring says what each rule is and where it comes from)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from scheduler.actions import Action, Admit, Decision, Mark, Pause
from scheduler.calls import CallRequest, Usage
from scheduler.config import VllmRouterConfig
from scheduler.coordinates import SessionId
from scheduler.deadline_heap import DeadlineHeap
from scheduler.ledger import FixedTokenWeights, TokenWeights
from scheduler.policies.base import Call, Policy, admit, hold
from scheduler.policies.parking import ParkingLot
from scheduler.policies.vllm_router.admission import (
    Candidate,
    RankLoad,
    admission_plan,
    force_resume_timeout_s,
    is_forced,
    local_order,
    rank_load,
)
from scheduler.policies.vllm_router.binding import HashRing
from scheduler.policies.vllm_router.cross_rank import cross_rank_moves
from scheduler.policies.vllm_router.progress_ttl import (
    CallSample,
    RankFactors,
    cache_miss_impact_s,
    fitted_acting_ttl_s,
    target_rounds,
)
from scheduler.policies.vllm_router.state import PauseReason, ProgramFacts
from scheduler.programs import Phase, Program

# A completion is cache-continuous when at least this share of the previous prompt was cached
# (scheduler_lifecycle.rs ``CACHE_CONTINUITY_HIT_RATIO``).
CACHE_CONTINUITY_HIT_RATIO = 0.9


class VllmRouterPolicy(Policy):
    name = "vllm_router"
    config: VllmRouterConfig
    # The source runs its periodic decisions after every completion (``complete``), besides
    # its metrics interval.
    ticks_after_completion = True

    def __init__(self, config: VllmRouterConfig) -> None:
        super().__init__(config)
        # paused programs, and pending ones with a call waiting: the request pool (forced
        # resumes are found by each program's own deadline, in its facts)
        self._lot = ParkingLot(force_after_s=None)
        self._facts: dict[SessionId, ProgramFacts] = {}
        self._factors: dict[str, RankFactors] = {}
        self._ring = HashRing(config.hash_virtual_nodes)
        # (deadline, session) of each ACTIVE acting program's TTL; live while it is the
        # program's ttl_deadline
        self._ttl_deadlines: DeadlineHeap[tuple[float, str]] = DeadlineHeap(
            self._ttl_wanted, lambda: len(self._facts))

    def token_weights(self, config: VllmRouterConfig) -> TokenWeights:  # type: ignore[override]
        # every active program, acting or reasoning, holds its context and the decode buffer
        return FixedTokenWeights(acting_token_weight=1.0, buffer_per_program=config.decode_buffer_tokens)

    def call_growth_reserve(self, request: CallRequest) -> int:
        # the decode buffer is counted per program; a call adds only its expected output
        return request.growth_reserve(0)

    def reconfigure(self, config: VllmRouterConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        self._ring.virtual_nodes = config.hash_virtual_nodes

    def forget_worker(self, name: str) -> None:
        self._factors.pop(name, None)

    # -- arrivals ----------------------------------------------------------------------

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        session = program.session_id
        facts = self._facts.get(session)
        if facts is not None and facts.last_finished_at is not None and not program.in_flight:
            self._note_interval(facts, now - facts.last_finished_at)
        if program.active and program.home_worker is not None:
            if self.ledger.worker(program.home_worker).healthy:
                facts = self._facts[session]
                facts.ttl_deadline = None  # reasoning again: its TTL no longer runs
                return admit(call, program.home_worker)
            self._unhome(program, now)
        if facts is None:
            facts = self._facts[session] = ProgramFacts(self._ring.pick(session, self.healthy_workers()))
        self._bind(session, facts)
        self._lot.park(session, now)
        self._enter_pool(program, facts, call.request, now)
        worker = facts.last_target
        if worker is None:
            return hold(call, "no healthy worker")
        if program.waiting:  # its earlier calls wait: this one goes with them
            return hold(call, "its earlier calls wait")
        if any(other is not program for other, _ in self._waiting_on(worker)):
            return hold(call, "others wait for its worker")
        plan = admission_plan(self.config, self.rank_load(worker), self.factors_of(worker),
                              self.candidate(program, facts, call.request), is_forced(facts, now))
        if plan is None:
            return hold(call, "no room on its worker")
        was_paused = program.paused
        # The Resume a tick would add is not returned with a decision: the Admit says it.
        self._activate(program, facts, worker, now, plan.forced)
        return Admit(call.request.request_id, session, worker, call.arrived_at, resumed=was_paused)

    def _bind(self, session: SessionId, facts: ProgramFacts) -> None:
        """Keep the program's worker, or bind it afresh when that worker is gone or failed."""
        worker = facts.last_target
        if worker is None or worker not in self.ledger or not self.ledger.worker(worker).healthy:
            facts.last_target = self._ring.pick(session, self.healthy_workers())

    def _enter_pool(self, program: Program, facts: ProgramFacts, request: CallRequest, now: float) -> None:
        if facts.queued_at is None:
            facts.queued_at = now
        if facts.force_deadline is None:
            timeout = self._force_resume_timeout(program, facts, now)
            if request.hints is not None and request.hints.deadline_s is not None:
                timeout = min(timeout, request.hints.deadline_s)
            facts.force_deadline = now + timeout

    def _force_resume_timeout(self, program: Program, facts: ProgramFacts, now: float) -> float:
        """Three times the rounds of work ahead of the program (the active programs' on its
        workers, and those queued before it) over their completion rate (admission.py)."""
        scope = self.healthy_workers() if self.config.global_queue else [facts.last_target]
        rounds: dict[str | None, float] = {}
        rate = 0.0
        for worker in scope:
            factors = None if worker is None else self.factors_of(worker)
            target = 0.0 if factors is None else target_rounds(self.config, factors)
            worker_rate = 0.0 if factors is None else factors.calls_per_second()
            if target <= 0.0 or worker_rate <= 0.0:
                return force_resume_timeout_s(self.config, None, 0.0)  # windows not ready
            rounds[worker] = target
            rate += worker_rate
        if not rounds:
            return force_resume_timeout_s(self.config, None, 0.0)
        return force_resume_timeout_s(self.config, self._rounds_ahead(program, facts, rounds, now), rate)

    def _rounds_ahead(self, program: Program, facts: ProgramFacts, rounds: dict[str | None, float],
                      now: float) -> float:
        """The active programs' remaining rounds on the workers of ``rounds`` (at least one
        for a reasoning one), and the target rounds of each program queued before this one."""
        global_queue = self.config.global_queue
        ahead = 0.0
        for worker, target in rounds.items():
            for session in self.ledger.worker(worker).programs:  # type: ignore[arg-type]
                floor = 1.0 if self.programs[session].phase is Phase.REASONING else 0.0
                ahead += max(target - self._facts[session].rounds_since_activation, floor)
        typical = sum(rounds.values()) / len(rounds)
        key = local_order(program, facts, now, self.config.resume_order)
        for other, other_facts in self._queued():
            if other is program or (not global_queue and other_facts.last_target != facts.last_target):
                continue
            if local_order(other, other_facts, now, self.config.resume_order) < key:
                ahead += max(rounds.get(other_facts.last_target, typical), 1.0)
        return ahead

    # -- completions -------------------------------------------------------------------

    def _finish(self, request_id: str, usage: Usage | None, now: float) -> tuple[Call, Program | None]:
        call, program = super()._finish(request_id, usage, now)
        if program is None:
            return call, None
        facts = self._facts[program.session_id]
        if usage is None:
            facts.earned_ttl_s = None  # failed: its program pauses
            return call, program
        config, worker = self.config, call.worker
        factors = self.factors_of(worker)  # type: ignore[arg-type]
        prompt = usage.prompt_tokens
        cached = min(usage.cached_tokens, prompt)
        previous = facts.last_prompt_tokens
        growth = prompt - previous if previous and 0 < prompt - previous < previous else None
        continuous = previous is None or cached >= CACHE_CONTINUITY_HIT_RATIO * previous
        if facts.shared_prefix_tokens is None:
            facts.shared_prefix_tokens = cached
        impact = cache_miss_impact_s(config, prompt - min(facts.shared_prefix_tokens, prompt))
        if not continuous:
            facts.segment_started_at = call.arrived_at
        facts.rounds_since_activation += continuous
        facts.rounds_since_ttl_pause += continuous
        facts.last_prompt_tokens = prompt
        facts.last_finished_at = now
        facts.last_cache_miss_impact_s = impact
        factors.push_call(CallSample(prompt, usage.completion_tokens, growth,
                                     facts.rounds_since_ttl_pause, now), config.stats_window_size)
        if program.retention_ttl_s is not None:  # the client's kv_retention_ttl_seconds
            facts.earned_ttl_s = program.retention_ttl_s
        else:
            facts.earned_ttl_s = fitted_acting_ttl_s(config, factors, impact)
        return call, program

    def after_call(self, program: Program, now: float) -> list[Action]:
        if program.in_flight or not program.active:
            return []
        facts = self._facts[program.session_id]
        if program.marked:
            return self._pause(program, facts, PauseReason.CAPACITY_REPAIR, now)
        if facts.earned_ttl_s is None:
            return self._pause(program, facts, PauseReason.REQUEST_FAILED, now)
        facts.ttl_deadline = now + facts.earned_ttl_s
        self._ttl_deadlines.push((facts.ttl_deadline, program.session_id))
        return self._yield_segment(program, facts, now)

    def _yield_segment(self, program: Program, facts: ProgramFacts, now: float) -> list[Action]:
        """An idle program that ran ``max_segment_rounds`` continuous rounds yields to a
        program waiting for its worker."""
        if facts.rounds_since_activation < self.config.max_segment_rounds:
            return []
        if not any(other is not program for other, _ in self._waiting_on(program.home_worker)):
            return []
        return self._pause(program, facts, PauseReason.SEGMENT_YIELD, now)

    def after_held_call(self, program: Program) -> None:
        if not program.waiting:  # out of the pool: a later call queues afresh
            facts = self._facts[program.session_id]
            facts.queued_at = facts.force_deadline = None

    # -- the tick ----------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions = self._expire_acting_ttls(now)
        actions += self._release_expired_paused(now)
        actions += self._repair_capacity(now)
        actions += self._schedule_waiting(now)
        actions += self._time_out_waiting(now)
        return actions

    def _expire_acting_ttls(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for deadline, session in self._ttl_deadlines.pop_due(now):
            facts = self._facts.get(session)
            if facts is None or facts.ttl_deadline != deadline:
                continue  # reasoning again, paused or released since
            program = self.programs[session]
            if program.active and program.phase is Phase.ACTING and not program.in_flight:
                actions += self._pause(program, facts, PauseReason.TTL_EXPIRED, now)
        return actions

    def _release_expired_paused(self, now: float) -> list[Action]:
        actions: list[Action] = []
        retention = self.config.paused_retention_ttl_seconds
        for session in self._lot.sessions():
            program = self.programs[session]
            since = self._lot.since(session)
            if (not program.waiting and not program.in_flight and since is not None
                    and now - since >= retention):
                actions += self.release(session, now, "paused retention")
        return actions

    def _time_out_waiting(self, now: float) -> list[Action]:
        """A call that waited ``queue_timeout_seconds`` fails; Sluice has no refusal of one held
        call, so its program is released and the shell refuses its held calls."""
        actions: list[Action] = []
        for session in self._lot.sessions():
            program = self.programs[session]
            oldest = self.calls[program.waiting[0]].arrived_at if program.waiting else now
            if now - oldest >= self.config.queue_timeout_seconds:
                actions += self.release(session, now, "queue timeout")
        return actions

    def _repair_capacity(self, now: float) -> list[Action]:
        """Past ``high_watermark_ratio`` of a worker's capacity, counting each reasoning
        program's mean output to come, mark reasoning programs (highest score first) until
        what is left is at most ``low_watermark_ratio`` of it."""
        actions: list[Action] = []
        config = self.config
        for load in self.ledger.workers():
            if not load.capacity_tokens:
                continue
            factors = self.factors_of(load.name)
            to_come = float(math.ceil(factors.mean_completion_tokens()))
            projected = self.ledger.load_tokens(load.name)
            victims = []
            for session in load.programs:
                program = self.programs[session]
                if program.phase is not Phase.REASONING:
                    continue
                if program.marked:  # its relief is on its way
                    projected -= self.ledger.contribution(session)
                else:
                    projected += to_come
                    victims.append(program)
            if projected <= load.capacity_tokens * config.high_watermark_ratio:
                continue
            mean_prompt = max(factors.mean_prompt_tokens(), 1.0)
            victims.sort(key=lambda p: (-self._repair_score(p, mean_prompt, now),
                                        -self.ledger.contribution(p.session_id), p.session_id))
            for program in victims:
                if projected <= load.capacity_tokens * config.low_watermark_ratio:
                    break
                projected -= self.ledger.contribution(program.session_id) + to_come
                program.mark()
                self.stats.marks += 1
                actions.append(Mark(program.session_id, load.name))
        return actions

    def _repair_score(self, program: Program, mean_prompt: float, now: float) -> float:
        """Time in its segment, weighted up for programs smaller than the mean prompt."""
        started = self._facts[program.session_id].segment_started_at
        elapsed = 0.0 if started is None else now - started
        size = max(program.demand_tokens() / mean_prompt, 1e-6)
        return elapsed * max(size ** -0.5, 0.5)

    def _schedule_waiting(self, now: float) -> list[Action]:
        """Each waiting program on its previous worker, in resume order, where admission lets
        it; then (``global_queue``) cross-rank moves of those left."""
        healthy = self.healthy_workers()
        if not healthy:
            return []
        queued = list(self._queued())
        for program, facts in queued:
            self._bind(program.session_id, facts)
        queued.sort(key=lambda item: local_order(item[0], item[1], now, self.config.resume_order))
        actions: list[Action] = []
        loads: dict[str, RankLoad] = {}
        left = []
        for program, facts in queued:
            worker = facts.last_target
            if worker is None:
                raise RuntimeError(f"{program.session_id} waits unbound while a worker is healthy")
            load = loads.get(worker) or loads.setdefault(worker, self.rank_load(worker))
            plan = admission_plan(self.config, load, self.factors_of(worker),
                                  self.candidate(program, facts), is_forced(facts, now))
            if plan is None:
                left.append((program, facts))
                continue
            actions += self._admit_from_pool(program, facts, worker, now, plan.forced)
            del loads[worker]  # read afresh for the next candidate
        if self.config.global_queue and left:
            for program, facts, worker, forced in cross_rank_moves(self, left, healthy, now):
                actions += self._admit_from_pool(program, facts, worker, now, forced)
        return actions

    # -- moves -------------------------------------------------------------------------

    def _admit_from_pool(self, program: Program, facts: ProgramFacts, worker: str, now: float,
                         forced: bool) -> list[Action]:
        was_paused = program.paused
        actions = self._activate(program, facts, worker, now, forced)
        return actions + self._admit_waiting(program, worker, now, was_paused, 0.0)

    def _activate(self, program: Program, facts: ProgramFacts, worker: str, now: float,
                  forced: bool) -> list[Action]:
        actions = self._lot.resume(program, worker, self.ledger, self.stats, now, forced)
        facts.last_target = worker
        facts.rounds_since_activation = 0
        facts.ttl_deadline = facts.queued_at = facts.force_deadline = None
        facts.last_pause_reason = None  # a yield's lower priority lasts one resume
        if facts.segment_started_at is None:
            facts.segment_started_at = now
        return actions

    def _pause(self, program: Program, facts: ProgramFacts, reason: PauseReason, now: float) -> list[Action]:
        worker = self._lot.pause(program, self.ledger, self.stats, now)
        facts.last_pause_reason = reason
        facts.rounds_since_activation = 0
        facts.ttl_deadline = None
        if reason is PauseReason.TTL_EXPIRED:
            facts.rounds_since_ttl_pause = 0
        return [Pause(program.session_id, worker)]

    def _unhome(self, program: Program, now: float) -> list[Action]:
        was_active = program.active
        actions = super()._unhome(program, now)
        facts = self._facts.get(program.session_id)
        if was_active and facts is not None:
            self._lot.park(program.session_id, now)
            facts.last_pause_reason = PauseReason.WORKER_LOST
            facts.rounds_since_activation = 0
            facts.ttl_deadline = None
        return actions

    def release(self, session_id: SessionId, now: float, reason: str) -> list[Action]:
        actions = super().release(session_id, now, reason)
        self._lot.unpark(session_id)
        self._facts.pop(session_id, None)
        self._ttl_deadlines.trim()
        return actions

    # -- what the rules read -----------------------------------------------------------

    def _queued(self) -> Iterator[tuple[Program, ProgramFacts]]:
        """The programs in the pool with a call waiting, oldest parked first."""
        for session in self._lot.sessions():
            program = self.programs[session]
            if program.waiting:
                yield program, self._facts[session]

    def _waiting_on(self, worker: str | None) -> Iterator[tuple[Program, ProgramFacts]]:
        return ((p, f) for p, f in self._queued() if f.last_target == worker)

    def factors_of(self, worker: str) -> RankFactors:
        return self._factors.setdefault(worker, RankFactors())

    def _note_interval(self, facts: ProgramFacts, seconds: float) -> None:
        if facts.last_target in self.ledger and seconds >= 0.0:
            self.factors_of(facts.last_target).push_interval(seconds, self.config.stats_window_size)

    def rank_load(self, worker: str) -> RankLoad:
        load = self.ledger.worker(worker)
        active = ((self.programs[s], self._facts[s]) for s in load.programs)
        return rank_load(load.capacity_tokens, self.ledger.load_tokens(worker), active,
                         target_rounds(self.config, self.factors_of(worker)))

    def candidate(self, program: Program, facts: ProgramFacts, arriving: CallRequest | None = None) -> Candidate:
        requests = [self.calls[r].request for r in program.waiting]
        if arriving is not None:
            requests.append(arriving)
        context = max(r.prompt_tokens for r in requests)
        demand = max(program.demand_tokens(), max(r.prompt_tokens + r.growth_reserve(0) for r in requests))
        shared = min(facts.shared_prefix_tokens or 0, context)
        return Candidate(demand + self.config.decode_buffer_tokens, context,
                         cache_miss_impact_s(self.config, context - shared))

    def _ttl_wanted(self, entry: tuple[float, str]) -> bool:
        facts = self._facts.get(SessionId(entry[1]))
        return facts is not None and facts.ttl_deadline == entry[0]
