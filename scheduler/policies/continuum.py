"""Continuum: keep a program's KV through its tool call with a time-to-live (docs/architecture.md §4).

Source: "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV Cache
Time-to-Live" (arXiv 2511.02230). When a call ends in a tool call, the program's KV is
pinned for a TTL; calls are served first-come-first-served by *program* arrival, so a
program's later turns are not overtaken by newer programs. No pausing, no admission
control.

Parameters (its section, :class:`ContinuumConfig`): the TTL is chosen from the
distribution of observed tool durations, as the paper does with its historical CDF; Sluice
takes the ``ttl_quantile`` quantile of the last observed tool times, starting from ``ttl_s``
(2.0 s, the preview code's fixed threshold) until enough are seen, and never above
``max_ttl_s``. The pin is a :class:`Retain` at ``pin_priority`` (100). Placement across
workers, which Continuum (a single-engine scheduler) leaves open, is sticky least-loaded.
"""

from __future__ import annotations

from scheduler.actions import Action, Admit, Decision, Retain
from scheduler.config import ContinuumConfig
from scheduler.programs import Program
from scheduler.policies.base import Call
from scheduler.policies.routing import StickyLeastLoadedPolicy
from scheduler.tool_times import ToolTimes

MIN_SAMPLES = 20
HISTORY = 1000


class ContinuumPolicy(StickyLeastLoadedPolicy):
    name = "continuum"
    config: ContinuumConfig

    def __init__(self, config: ContinuumConfig) -> None:
        super().__init__(config)
        self._tool_times = ToolTimes(HISTORY, MIN_SAMPLES)

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        if program.acting_since is not None and program.steps > 0:
            self._tool_times.observe(now - program.acting_since)
        decision = super().decide_arrival(program, call, now)
        if isinstance(decision, Admit):
            # FCFS by program: the engine orders calls by when their program arrived.
            return Admit(decision.request_id, decision.session_id, decision.worker, program.created_at)
        return decision

    def ttl_s(self) -> float:
        quantile = self._tool_times.quantile(self.config.ttl_quantile)
        if quantile is None:
            return self.config.ttl_s
        return min(self.config.max_ttl_s, quantile)

    def after_call(self, program: Program, now: float) -> list[Action]:
        if program.in_flight or program.home_worker is None:
            return []
        return [Retain(program.session_id, program.home_worker,
                       self.config.pin_priority, self.ttl_s(), program.chain_head)]
