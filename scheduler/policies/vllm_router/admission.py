"""The request pool's rules: whether a worker admits a waiting program, in what order the
waiting programs are tried, and when one is forced back.

Source: vllm-project/router ``src/program_scheduling/scheduler_admission.rs``
(``rank_admission_plan``, the resume comparators), ``scheduler_fairness.rs`` (the force-resume
deadline) and ``scheduler_global.rs`` (cross-rank placement); docs/program_scheduling.md
("Resume ordering and capacity").

- Admission on a worker of capacity ``K`` (the ledger's: Sluice's workers are the source's
  ranks): it must hold fewer than ``max_active_programs_per_target`` active programs, the
  candidate's tokens must fit, ``used + required ≤ low_watermark_ratio·K``, and so must the
  growth reserve, ``used + required + reserve ≤ low·K``; when only the reserve does not fit,
  modelled batch gain may stand in for it (progress_ttl.py). A forced candidate passes every
  check. A worker of unknown capacity checks the count only (the source's ``null`` capacity).
- Order: forced (deadline passed) first, then the larger client priority, then programs that
  did not yield their segment last (a yield costs one resume), then ``resume_order``: MRU
  (most recent completion first, then queued first) or FCFS (queued first); cross-rank
  candidates are always FCFS.
- Force-resume deadline, set when a program enters the pool: ``3·(active remaining rounds +
  the rounds of the programs queued ahead of it) / completions per second``, clamped to
  [min(30 s, max), max] with ``max = force_resume_timeout_seconds``; ``max`` itself until every
  worker's windows give a target round count and a throughput. A client's ``deadline_s``
  replaces it when shorter (the doc: "deadline overrides the force-resume wait").
- Cross-rank (``global_queue``): only a program paused before (never a new one), whose own
  and destination workers' call windows are full, queued at least one scheduling interval,
  behind another waiter on its worker (the source's "resume pressure"), to a worker no other
  program waits for, with ``free(destination) ≥ free(source) + cross_rank_headroom_ratio ·
  its context``, and which admits it; the least pressed such worker (``(used + required +
  reserve) / K``), then the fewest active programs, then the name.

Sluice's choices where the source reads what Sluice's policy cannot see:
``admission_waiting_request_threshold`` (engine's native waiting-request count) is left out:
the policy does not see the engine's queue, and the nearest thing it sees, the ledger's
occupancy against capacity, is what the token check above already tests. So the source's
resume pressure is only its second half, another waiter ranked ahead on the same worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.config import VllmRouterConfig
from scheduler.policies.vllm_router.progress_ttl import (
    BatchGainCase,
    RankFactors,
    batch_gain_admits,
    growth_reserve_tokens,
)
from scheduler.policies.vllm_router.state import PauseReason, ProgramFacts
from scheduler.programs import Phase, Program

# The shortest force-resume deadline (scheduler_fairness.rs: 30 s, or the maximum if less).
MIN_FORCE_RESUME_S = 30.0
# The deadline is this many times the rounds ahead over the completion rate.
FORCE_RESUME_ROUNDS_FACTOR = 3.0


@dataclass(slots=True)
class RankLoad:
    """One worker as admission reads it: its capacity, what it holds, and its active
    programs' remaining protected rounds."""

    capacity_tokens: int | None
    used_tokens: float
    active: int
    remaining_rounds: float  # Σ max(0, target rounds − rounds since activation)
    reasoning: int
    reasoning_context: float
    protected: list[tuple[float, float]]  # (remaining rounds, cache-miss impact) of those > 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting program as admission reads it."""

    required_tokens: float  # what it holds once admitted: its demand plus the decode buffer
    context_tokens: float  # its full context (the prompt it waits with)
    recovery_s: float  # the cache-miss impact of that context less its shared prefix


@dataclass(frozen=True, slots=True)
class Plan:
    used_tokens: float
    required_tokens: float
    reserve_tokens: float
    forced: bool
    batch_gain: bool

    def pressure(self, capacity_tokens: int | None, active: int, max_active: int) -> float:
        """How full the worker would be: its share of tokens, or of programs without a
        capacity (cross-rank placement picks the least)."""
        if capacity_tokens is None:
            return (active + 1) / max(1, max_active)
        return (self.used_tokens + self.required_tokens + self.reserve_tokens) / max(1, capacity_tokens)


def rank_load(capacity_tokens: int | None, used_tokens: float,
              active: Iterable[tuple[Program, ProgramFacts]], target: float) -> RankLoad:
    load = RankLoad(capacity_tokens, used_tokens, 0, 0.0, 0, 0.0, [])
    for program, facts in active:
        load.active += 1
        remaining = max(0.0, target - facts.rounds_since_activation)
        load.remaining_rounds += remaining
        if remaining > 0.0:
            load.protected.append((remaining, facts.last_cache_miss_impact_s))
        if program.phase is Phase.REASONING:
            load.reasoning += 1
            load.reasoning_context += program.demand_tokens()
    return load


def admission_plan(config: VllmRouterConfig, load: RankLoad, factors: RankFactors,
                   candidate: Candidate, forced: bool) -> Plan | None:
    """The admission of ``candidate`` on the worker ``load`` describes, or None."""
    count_fits = load.active + 1 <= config.max_active_programs_per_target
    used, required = load.used_tokens, candidate.required_tokens
    if load.capacity_tokens is None:
        return Plan(used, required, 0.0, forced, False) if forced or count_fits else None
    limit = load.capacity_tokens * config.low_watermark_ratio
    reserve = growth_reserve_tokens(config, factors, load.remaining_rounds)
    immediate_fits = used + required <= limit
    if forced or (count_fits and immediate_fits and used + required + reserve <= limit):
        return Plan(used, required, reserve, forced, False)
    if not count_fits or not immediate_fits:
        return None
    case = BatchGainCase(load.capacity_tokens, used, required, load.reasoning, load.reasoning_context,
                         candidate.context_tokens, candidate.recovery_s, load.protected)
    if batch_gain_admits(config, factors, case):
        return Plan(used, required, reserve, forced, True)
    return None


def is_forced(facts: ProgramFacts, now: float) -> bool:
    return facts.force_deadline is not None and facts.force_deadline <= now


def _tier(program: Program, facts: ProgramFacts, now: float) -> tuple[bool, int, bool]:
    return (not is_forced(facts, now), -program.priority,
            facts.last_pause_reason is PauseReason.SEGMENT_YIELD)


def _queued_at(facts: ProgramFacts) -> float:
    return math.inf if facts.queued_at is None else facts.queued_at


def local_order(program: Program, facts: ProgramFacts, now: float, resume_order: str) -> tuple:
    """Sort key of the rank-local resume order (smallest first)."""
    if resume_order == "fcfs":
        return (*_tier(program, facts, now), _queued_at(facts), program.session_id)
    finished = -math.inf if facts.last_finished_at is None else facts.last_finished_at
    return (*_tier(program, facts, now), -finished, _queued_at(facts), program.session_id)


def cross_order(program: Program, facts: ProgramFacts, now: float) -> tuple:
    """Sort key of the cross-rank order: the same tiers, then FCFS."""
    return (*_tier(program, facts, now), _queued_at(facts), program.session_id)


def force_resume_timeout_s(config: VllmRouterConfig, rounds_ahead: float | None,
                           calls_per_second: float) -> float:
    """The force-resume delay of a program entering the pool, given the rounds of work ahead
    of it (None: a worker's windows are not ready yet) and the completion rate."""
    longest = config.force_resume_timeout_seconds
    if rounds_ahead is None or calls_per_second <= 0.0:
        return longest
    shortest = min(MIN_FORCE_RESUME_S, longest)
    return min(max(FORCE_RESUME_ROUNDS_FACTOR * rounds_ahead / calls_per_second, shortest), longest)


def cross_rank_headroom(config: VllmRouterConfig, source: tuple[int | None, float],
                        destination: tuple[int | None, float], context_tokens: float) -> bool:
    """Has the destination the source's free tokens plus the headroom ratio times the
    program's context (each ``(capacity, used tokens)``; always, when a capacity is unknown)?"""
    (source_capacity, source_used), (capacity, used) = source, destination
    if source_capacity is None or capacity is None:
        return True
    ratio = config.low_watermark_ratio
    source_free = max(0.0, source_capacity * ratio - source_used)
    return max(0.0, capacity * ratio - used) >= source_free + config.cross_rank_headroom_ratio * context_tokens
