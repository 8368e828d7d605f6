"""``sticky_kv``: session-sticky KV routing with a load valve (docs/architecture.md §4).

The strongest session-affinity router an operator can switch on today, composed from what
Dynamo's and SGLang's routers document. A router: every call is admitted on arrival (held
only while no worker is healthy), nothing is paused.

- **A new session goes by Dynamo's KV cost** (Dynamo docs/components/router, "Routing
  Concepts"; Sluice's ``kv_aware``, scheduler/policies/routing.py): the worker of least
  ``kv_overlap_score_weight · prefill_tokens + decode_tokens``, prefix overlap credited
  against load; weight 1.0 (``--router-kv-overlap-score-weight``).
- **Its later calls go to the worker it was bound to** (Dynamo session affinity, Dynamo
  docs/components/router/router-configuration.md "Session Affinity", and docs/agents
  session IDs, ``X-Dynamo-Session-ID``): the first dispatched call binds the session to its
  worker and later calls go there; active calls keep the binding alive and it expires after
  an idle timeout (``--router-session-affinity-ttl-secs``, off by default, so no default to
  take: Sluice's ``idle_release_s``, 600 s, after which the program is released and its next
  call is placed afresh). A final call releases it at once (Dynamo's
  ``X-Dynamo-Session-Final`` marks a session's last request).
- **A missing bound worker invalidates the binding** (same page): a session whose worker
  failed or left is placed afresh by KV cost at its next call.
- **The load valve** (SGLang router, ``cache_aware`` policy,
  sgl-model-gateway/src/policies/cache_aware.rs; defaults in its CLI, ``balance_abs_threshold``
  64 and ``balance_rel_threshold`` 1.5): load is the calls in flight on a worker, and load is
  imbalanced when ``max − min > balance_abs_threshold`` *and* ``max > balance_rel_threshold ·
  min``; then the call goes to the least-loaded worker (the first on ties) instead of the one
  its cache points at. Dynamo's own soft affinity keeps the bound worker while it is eligible
  (not over its busy threshold, which is off by default) and has no ratio of its own.

Sluice's choices where the sources are silent:

- the valve compares the session's *bound* worker with the least-loaded one (SGLang compares
  the fleet's most- and least-loaded workers, because it has no binding to keep): a session
  leaves a worker only when that worker is the overloaded one;
- a session the valve moves is bound to its new worker (its KV starts to build there);
- Dynamo's parent-aware first placement of a child session is not modelled: the KV cost
  already credits a prefix the parent left on a worker.
"""

from __future__ import annotations

from scheduler.actions import Action
from scheduler.config import StickyKvConfig
from scheduler.policies.base import Call
from scheduler.policies.parking import IdleDeadlines
from scheduler.policies.routing import CountsCallsInFlight, KvAwarePolicy
from scheduler.programs import Program


class StickyKvPolicy(CountsCallsInFlight, KvAwarePolicy):
    """The binding is the program's home worker: it lives as long as the program (the base's
    program table), so it is released with the program."""

    name = "sticky_kv"
    config: StickyKvConfig  # type: ignore[assignment]

    def __init__(self, config: StickyKvConfig) -> None:
        super().__init__(config)  # type: ignore[arg-type]  # _in_flight: the valve's load
        self._idle = IdleDeadlines(config.idle_release_s, self.programs)
        self.valve_moves = 0

    def reconfigure(self, config: StickyKvConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        self._idle.idle_release_s = config.idle_release_s

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        bound = program.home_worker
        if bound is None or bound not in workers:
            return super().choose(program, call, workers)  # a new session: Dynamo's KV cost
        loads = self._in_flight
        least = min(workers, key=lambda w: loads.get(w, 0))
        if self.overloaded(loads.get(bound, 0), loads.get(least, 0)):
            self.valve_moves += 1
            return least
        return bound

    def overloaded(self, load: int, least_load: int) -> bool:
        """SGLang's imbalance test, of the bound worker's load against the least-loaded's."""
        config = self.config
        return (load - least_load > config.balance_abs_threshold
                and load > config.balance_rel_threshold * least_load)

    def after_call(self, program: Program, now: float) -> list[Action]:
        if not program.in_flight:
            self._idle.note(program, now)
        return []

    def after_held_call(self, program: Program) -> None:
        self._idle.held_call_gone(program)

    def tick(self, now: float) -> list[Action]:
        actions = super().tick(now)
        for session in self._idle.due(now):
            actions += self.release(session, now, "idle")
        return actions

    def release(self, session_id, now, reason):  # type: ignore[override]
        actions = super().release(session_id, now, reason)
        self._idle.trim()
        return actions
