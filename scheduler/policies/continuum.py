"""Continuum / CacheTTL: keep a program's KV through its tool call for a cost–benefit TTL
(docs/architecture.md §4).

Source: Li et al., "CacheTTL: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV
Cache Time-to-Live", arXiv 2511.02230v4 (2026-05; v1–v3 and v6 are titled "Continuum"). The
rules below were read from the method of the v6 text (§4 Algorithm 1, §4.1 Utility Model,
§4.2 Setting the TTL Value, §4.3 Scheduling Priority, §5.2), which v4's abstract describes in
the same words: a TTL "determined by the reload cost and potential queueing delay induced by
eviction", with program-level first-come-first-serve.

The rules, and where Sluice had to choose
-----------------------------------------

- **When to pin** (Algorithm 1 ``OnRequestFinish``; §5.2). When a call ends and its program
  has nothing else in flight (it is in a tool call), its KV is pinned on its worker for τ*:
  a :class:`Retain` at ``pin_priority`` (100) whose ``ttl_s`` is τ*. τ* = 0 pins nothing. A
  final call pins nothing either (its program is released, and the Release unpins it).
- **τ*** (§4.2, Equation 2). With ``Cost(τ, r) = MemUsage(r)/M · τ`` (§4.1: the memory the
  pin holds, counted as the average requests it blocks) and ``Benefit(r) =
  MemUsage(r)/M · (Prefill-Reload(r) + T·η)``, the shared ``MemUsage(r)/M`` cancels and

      τ* = argmax_τ  P(τ) · (T·η + Prefill-Reload(r)) − τ,

  ``P(τ)`` the empirical CDF of observed tool-call durations, solved by trying τ = 0 and
  every observed duration (:func:`cache_ttl`). So τ* is 0 when a reload is cheap against the
  memory a pin holds, and grows with the reload.
- **Prefill-Reload(r)** (§4.1; §5.2 "Offline Profile"). The paper fits prefill time against
  context length offline (a quadratic), or measures the host link when offloading is on.
  Sluice prices the program's context tokens at the preset's cost terms (sim/step_time.py
  ``policy_cost_terms``): ``prefill_token_s`` (recompute), or ``reload_token_s`` (one token's
  KV over the host link) when the workers have a host KV tier (``host_tier``). Linear, not
  quadratic: the preset's per-token price already includes attention over a typical context.
- **T** (§4.1, §4.2). The sliding-window average of the queueing delay of calls whose KV was
  evicted, 0 until one is seen (the paper initialises T as zero). The core sees no queue, so
  Sluice's estimate: a call whose engine reported fewer cached tokens than its program held
  after its previous call was evicted, and its queueing delay is its latency less its service
  (``completion · decode_token_s + computed prompt · prefill_token_s``, as autellix prices
  service). The window is 100 calls (Sluice's; the paper gives none).
- **η** (§4.1). ``η = −Corr(k, N − k)`` over the calls of finished programs (``N`` their
  calls, ``k`` those served before each one), 1 until it is defined (the paper's cold start
  assumes a fully memoryful workload).
- **Cold start** (§4.2). With at most ``cold_start_samples`` (K = 100) tool times observed,
  the TTL is ``ttl_s``. The paper derives its fixed ``T_default`` from the cost model under
  Exp(1) tool times and η = 1 but publishes no value; Sluice keeps the preview code's fixed
  2 s (github.com/Hanchenli/vllm-continuum). The paper then prefers the CDF of the *same
  tool* once it has K records; a gateway does not see tool names, so Sluice uses the global
  records (the paper's fallback) throughout, the last 1000 of them.
- **Robustness** (§4, §5.2). A pin always ends: at τ* on the engine. Sluice also caps τ* at
  ``max_ttl_s`` (60 s; its own bound, the paper has none). The paper's deadlock prevention
  (unpin the latest-arriving program's pin when a call cannot fit) is the engine's: a
  Retain is a bias the engine may override under pressure, never a hard pin.
- **Order** (§4.3). Calls go first-come-first-served by their *program's* arrival (the
  Admit priority is the program's first arrival), and a call arriving while its program's
  pin is live goes ahead of the unpinned ones (a tier :data:`PINNED_TIER_S` earlier). Like
  autellix's queues, this acts only on engines that order by priority.
- **Placement** across workers, which Continuum (a single-engine scheduler) leaves open, is
  sticky least-loaded (scheduler/policies/routing.py). No pausing, no admission control.
- **Tool times** (§5.1): from a program's response to its next call, as the core sees them.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence

from scheduler.actions import Action, Admit, Decision, Retain
from scheduler.calls import Usage
from scheduler.config import ContinuumConfig
from scheduler.policies.base import Call
from scheduler.policies.routing import StickyLeastLoadedPolicy
from scheduler.programs import Program
from scheduler.tool_times import ToolTimes

HISTORY = 1000  # tool-call durations kept (the paper keeps every record; Sluice a window)
QUEUE_DELAY_WINDOW = 100  # evicted calls T is averaged over (Sluice's; the paper gives none)
# How much earlier a call of a pinned program counts as arrived: wider than any wait, so the
# pinned go first and program-level FCFS orders each tier (§4.3).
PINNED_TIER_S = 1_000_000.0


def cache_ttl(durations: Sequence[float], benefit_s: float) -> float:
    """τ* = argmax over τ ∈ {0} ∪ durations of ``P(τ)·benefit_s − τ`` (§4.2, Equation 2),
    ``P`` the empirical CDF of ``durations`` (ascending); the shorter τ on ties."""
    n = len(durations)
    if n == 0:
        raise ValueError("τ* needs at least one observed tool-call duration")
    best_ttl, best_utility = 0.0, bisect_right(durations, 0.0) / n * benefit_s
    # A τ at or past benefit_s cannot beat τ = 0 (P ≤ 1), so only shorter ones are tried.
    stop = bisect_left(durations, benefit_s)
    i = 0
    while i < stop:
        tau = durations[i]
        while i + 1 < n and durations[i + 1] == tau:
            i += 1
        utility = (i + 1) / n * benefit_s - tau
        if utility > best_utility:
            best_ttl, best_utility = tau, utility
        i += 1
    return best_ttl


class Memoryfulness:
    """η = −Corr(k, N − k) over the calls of the finished programs (§4.1), from running sums:
    a program of ``N`` calls adds ``(k, N − k)`` for ``k = 0 … N − 1``."""

    def __init__(self) -> None:
        self._pairs = 0
        self._sx = self._sy = self._sxx = self._syy = self._sxy = 0

    def observe_program(self, calls: int) -> None:
        if calls < 1:
            raise ValueError(f"a finished program has at least one call, got {calls}")
        n = calls
        sx = n * (n - 1) // 2  # Σ k
        sxx = (n - 1) * n * (2 * n - 1) // 6  # Σ k²
        self._pairs += n
        self._sx += sx
        self._sxx += sxx
        self._sy += n * (n + 1) // 2  # Σ (N − k), N … 1
        self._syy += n * (n + 1) * (2 * n + 1) // 6
        self._sxy += n * sx - sxx  # Σ k (N − k)

    @property
    def eta(self) -> float:
        """1 (fully memoryful, the paper's cold-start assumption) until the correlation is
        defined."""
        m = self._pairs
        var_x = m * self._sxx - self._sx ** 2
        var_y = m * self._syy - self._sy ** 2
        if m < 2 or var_x <= 0 or var_y <= 0:
            return 1.0
        cov = m * self._sxy - self._sx * self._sy
        return max(-1.0, min(1.0, -cov / math.sqrt(var_x * var_y)))


class SlidingMean:
    """The mean of the last ``window`` values observed; 0 before the first (T's start, §4.2)."""

    def __init__(self, window: int) -> None:
        self._recent: deque[float] = deque()
        self._window = window
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._recent.append(value)
        self._total += value
        if len(self._recent) > self._window:
            self._total -= self._recent.popleft()

    @property
    def mean(self) -> float:
        return self._total / len(self._recent) if self._recent else 0.0


class ContinuumPolicy(StickyLeastLoadedPolicy):
    name = "continuum"
    config: ContinuumConfig

    def __init__(self, config: ContinuumConfig) -> None:
        super().__init__(config)
        self._tool_times = ToolTimes(HISTORY, 1)
        self._queue_delays = SlidingMean(QUEUE_DELAY_WINDOW)
        self._memoryfulness = Memoryfulness()
        self._pinned_until: dict[str, float] = {}  # session -> when its live pin ends

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        if program.acting_since is not None and program.steps > 0:
            self._tool_times.observe(now - program.acting_since)
        pinned_until = self._pinned_until.pop(program.session_id, None)
        decision = super().decide_arrival(program, call, now)
        if not isinstance(decision, Admit):
            return decision
        # FCFS by program, the pinned ahead of the rest (§4.3).
        priority = program.created_at
        if pinned_until is not None and now <= pinned_until:
            priority -= PINNED_TIER_S
        return Admit(decision.request_id, decision.session_id, decision.worker, priority)

    def reload_s(self, context_tokens: int) -> float:
        """Prefill-Reload(r): recomputing the context, or reloading it from the host tier."""
        per_token = self.config.reload_token_s if self.config.host_tier else self.config.prefill_token_s
        return context_tokens * per_token

    def ttl_s(self, context_tokens: int) -> float:
        """The pin's TTL for a program holding ``context_tokens``: τ* (capped), or the
        cold-start ``ttl_s`` while too few tool times are known."""
        config = self.config
        if len(self._tool_times) <= config.cold_start_samples:
            return min(config.ttl_s, config.max_ttl_s)
        benefit = self._queue_delays.mean * self._memoryfulness.eta + self.reload_s(context_tokens)
        return min(config.max_ttl_s, cache_ttl(self._tool_times.ascending(), benefit))

    def after_call(self, program: Program, now: float) -> list[Action]:
        if program.in_flight or program.home_worker is None:
            return []
        ttl = self.ttl_s(program.context_tokens)
        if ttl <= 0.0:
            return []
        self._pinned_until[program.session_id] = now + ttl
        return [Retain(program.session_id, program.home_worker, self.config.pin_priority, ttl,
                       program.chain_head)]

    def _finish(self, request_id: str, usage: Usage | None, now: float):  # type: ignore[override]
        call = self.calls.get(request_id)
        before = self.programs.get(call.session_id) if call is not None else None
        held_before = before.context_tokens if before is not None and before.steps > 0 else 0
        call, program = super()._finish(request_id, usage, now)
        if usage is not None and program is not None and usage.cached_tokens < held_before:
            # Its KV was evicted since its program's previous call: what it waited for (§4.2 T).
            service = (usage.completion_tokens * self.config.decode_token_s
                       + (usage.prompt_tokens - usage.cached_tokens) * self.config.prefill_token_s)
            self._queue_delays.observe(max(0.0, now - call.arrived_at - service))
        return call, program

    def release(self, session_id, now, reason):  # type: ignore[override]
        program = self.programs.get(session_id)
        if program is not None and program.steps > 0:
            self._memoryfulness.observe_program(program.steps)
        self._pinned_until.pop(session_id, None)
        return super().release(session_id, now, reason)

    def adaptive_settings(self) -> dict[str, float]:
        return {"queue_delay_s": self._queue_delays.mean, "memoryfulness": self._memoryfulness.eta,
                "tool_times_observed": float(len(self._tool_times))}
