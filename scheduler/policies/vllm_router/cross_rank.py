"""Cross-rank resume (``global_queue``): after every waiting program had its chance on its
previous worker, one may move to another worker. The rules and their source are admission.py's
("Cross-rank"); this is the pass that applies them, in FCFS order within the resume tiers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Protocol

from scheduler.config import VllmRouterConfig
from scheduler.policies.vllm_router.admission import (
    Candidate,
    RankLoad,
    admission_plan,
    cross_order,
    cross_rank_headroom,
    is_forced,
)
from scheduler.policies.vllm_router.progress_ttl import RankFactors
from scheduler.policies.vllm_router.state import ProgramFacts
from scheduler.programs import Program


class PoolView(Protocol):
    """What the pass reads of the policy (VllmRouterPolicy is one)."""

    @property
    def config(self) -> VllmRouterConfig: ...
    def rank_load(self, worker: str) -> RankLoad: ...
    def factors_of(self, worker: str) -> RankFactors: ...
    def candidate(self, program: Program, facts: ProgramFacts) -> Candidate: ...


def cross_rank_moves(policy: PoolView, left: Sequence[tuple[Program, ProgramFacts]],
                     healthy: Sequence[str], now: float
                     ) -> Iterator[tuple[Program, ProgramFacts, str, bool]]:
    """``(program, facts, destination, forced)`` for each move, in order; ``left`` are the
    waiting programs the rank-local pass did not admit, in rank-local resume order. The caller
    admits each move before asking for the next (the destination's load is read afresh)."""
    config = policy.config
    window, interval = config.stats_window_size, config.scheduler_interval_s

    def observed(facts: ProgramFacts) -> bool:  # queued for at least one scheduling interval
        return facts.queued_at is not None and now - facts.queued_at >= interval

    # Per worker, the waiters ranked first among those queued an interval: a program is under
    # "resume pressure" when one of them is another program.
    heads: dict[str, list[Program]] = {}
    for program, facts in left:
        if observed(facts) and facts.last_target is not None:
            heads.setdefault(facts.last_target, []).append(program)
    waiting_on = Counter(facts.last_target for _, facts in left)
    moved: set[str] = set()
    loads: dict[str, RankLoad] = {}

    def load_of(worker: str) -> RankLoad:
        if worker not in loads:
            loads[worker] = policy.rank_load(worker)
        return loads[worker]

    for program, facts in sorted(left, key=lambda item: cross_order(item[0], item[1], now)):
        source = facts.last_target
        if (facts.last_pause_reason is None or source is None or not observed(facts)
                or not policy.factors_of(source).calls_complete(window)):
            continue  # a new program stays on its binding; a worker's windows must be ready
        ahead = next((p for p in heads.get(source, ()) if p.session_id not in moved), None)
        if ahead is None or ahead is program:
            continue  # nothing queued ahead of it on its worker
        candidate = policy.candidate(program, facts)
        forced = is_forced(facts, now)
        best: tuple[tuple[float, int, str], str] | None = None
        for worker in healthy:
            if worker == source or waiting_on[worker] or not policy.factors_of(worker).calls_complete(window):
                continue
            load = load_of(worker)
            if not cross_rank_headroom(config, (load_of(source).capacity_tokens, load_of(source).used_tokens),
                                       (load.capacity_tokens, load.used_tokens), candidate.context_tokens):
                continue
            plan = admission_plan(config, load, policy.factors_of(worker), candidate, forced)
            if plan is None:
                continue
            rank = (plan.pressure(load.capacity_tokens, load.active, config.max_active_programs_per_target),
                    load.active, worker)
            if best is None or rank < best[0]:
                best = (rank, worker)
        if best is None:
            continue
        destination = best[1]
        moved.add(program.session_id)
        waiting_on[source] -= 1
        yield program, facts, destination, forced
        loads.pop(destination, None)
        loads.pop(source, None)
