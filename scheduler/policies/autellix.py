"""Autellix: program-level least attained service (PLAS) behind a locality-aware balancer.

Source: Luo et al., "Autellix: An Efficient Serving Engine for LLM Agents as General
Programs", arXiv 2502.13965 — §4.2 (Algorithm 1, the program-aware scheduler), §4.3
(Algorithm 2, the load balancer). Reported: 4–15× the program throughput of vLLM at the
same latency, and up to 1.4× over round robin / least used across engine replicas.

What the paper does, and how Sluice expresses it
------------------------------------------------

- **PLAS priority** (§4.2.1, faithful). A call's priority is its program's attained
  service: the summed execution time of the program's *finished* calls,
  ``p(c_j) = Σ_{k<j} t_k``, read from a process table that is updated when a call
  completes. Calls still running do not count.
- **Discretised queues** (§4.2.2, faithful). Priorities are binned into K queues
  ``Q_1 … Q_K``, ``Q_i = [lo_i, hi_i)``, ``lo_1 = 0``, ``hi_K = ∞``; a call enters the queue
  its program's service falls in (not always ``Q_1`` as in plain MLFQ) and calls run FCFS
  within a queue. The call's :class:`Admit` priority is its arrival plus the queue index
  times :data:`QUEUE_TIER_S`, a time offset wider than any wait, so after the shells'
  transform (:func:`scheduler.actions.engine_priority`: milliseconds relative to dispatch)
  every call of ``Q_i`` still goes before every call of ``Q_{i+1}``, and within a queue the
  one that arrived (or was held) first goes first: FCFS. The engine breaks the remaining
  ties by its own arrival order (vLLM ``--scheduling-policy priority`` orders its waiting
  queue by ``(priority, arrival_time)``; the simulator by admission order). Under KV
  pressure both preempt the running call of the largest priority first, which is the one
  of the most-served program. In front of real engines this needs vLLM started with
  ``--scheduling-policy priority`` and the worker declared so (``scheduling_policy:
  priority``); elsewhere this baseline is its load balancer alone.
- **Anti-starvation** (§4.2.2, approximated). The paper moves a waiting call to ``Q_1``
  once ``(W_p + W_c) / (T_p + T_c) ≥ β`` (``W``: time waiting in the engine's queue, ``T``:
  service; ``p`` the program's finished calls, ``c`` this call so far). A gateway cannot
  re-prioritise a call the engine already holds, so Sluice evaluates the test once, when
  the call arrives (``W_c = T_c = 0``): a call of a program with ``W_p / T_p ≥ β`` enters
  ``Q_1``. Like the paper, promotion resets nothing of the program's record.
- **Load balancer** (§4.3 Algorithm 2, faithful). A call of at most
  ``short_call_tokens`` (2048) prompt tokens goes to the least-used engine (its
  system prompt is cached everywhere, so locality buys little); a longer one goes to the
  engine its program is pinned to, or pins the program to the least-used engine. "Least
  used" is the engine with the fewest calls in flight (the paper's Least Used baseline),
  the first such engine on ties. An engine that fails is re-pinned away from.
- **Not modelled: call-level preemption.** Autellix demotes a *running* call to the next
  queue when it exhausts its queue's time quantum and swaps its KV to the host, with
  multi-step scheduling and a batched swap kernel. That is engine-internal; Sluice never
  interrupts a call in flight, so a call keeps its arrival queue while it runs. No
  admission control and no pausing either: like the other routers every call is
  admitted on arrival (held only while no worker is healthy).

Attained service from what the core observes
--------------------------------------------

The paper's ``t_k`` is model-executor time, which a gateway does not see (a call's
latency also contains its queueing). Sluice estimates it from the call's :class:`Usage`::

    t_k = completion_tokens · decode_token_s
          + (prompt_tokens − cached_tokens) · prefill_token_s

An output token holds its call in the batch for one decode step; a prompt token the
engine had to compute costs its share of a prefill; cached prompt tokens cost nothing.
The defaults come from ``sim/step_time.py``'s ``llama3.1-8b-h100`` preset: 36 µs of
prefill per token, and 20 ms per decode step (≈ 9 ms empty, ≈ 40 ms with a full KV pool).
The simulator prices both from a preset file's engine where the config leaves them unset
(``policy_cost_terms`` in sim/step_time.py).
Keeping ``t_k`` in seconds keeps the queue bounds and β in the paper's units, and it
weights decode against prefill the way the executor does. A call's waiting time is what
its latency leaves once that service is taken out: ``W_c = max(0, latency − t_c)`` (its
time held at the gateway included). An aborted call reports no usage and adds nothing.

Parameters (its section, :class:`AutellixConfig`; the paper publishes no values for K, the bounds or β)
------------------------------------------------------------------------------------------------------

- ``short_call_tokens`` 2048 — Algorithm 2's threshold.
- ``queues`` 8, ``first_queue_s`` 1.0, ``queue_growth`` 2.0 —
  Sluice's choice: bounds 1, 2, 4, … 64 s, geometric as in MLFQ, so a SWE-style program
  (≈ 3 s of service per turn) moves down one queue every doubling of its age and reaches
  the last queue after ~20 turns.
- ``starvation_ratio`` (β) 8.0 — Sluice's choice; the paper only says β trades
  average response time against fairness.
- ``decode_token_s`` 0.02, ``prefill_token_s`` 3.6e-5 — above.
- ``idle_release_s`` — a program silent this long leaves the process table (the paper
  tracks each program's last call arrival to find stale ones; a final call removes it
  at once, like its ``end_session``).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from scheduler.actions import Action, Admit, Decision
from scheduler.calls import Usage
from scheduler.config import AutellixConfig
from scheduler.coordinates import SessionId
from scheduler.policies.base import Call
from scheduler.policies.routing import RouterPolicy
from scheduler.programs import Program


@dataclass(slots=True)
class ProcessEntry:
    """One program's row of Autellix's process table (§4.2.1)."""

    service_s: float = 0.0  # T_p: estimated executor time of its finished calls
    wait_s: float = 0.0     # W_p: the rest of those calls' latency
    pinned_worker: str | None = None  # where its long calls go (Algorithm 2)


def queue_bounds(config: AutellixConfig) -> tuple[float, ...]:
    """Upper bounds ``hi_1 … hi_{K-1}`` of the PLAS queues (``hi_K`` is unbounded)."""
    return tuple(config.first_queue_s * config.queue_growth**i for i in range(config.queues - 1))


def call_service_s(usage: Usage, config: AutellixConfig) -> float:
    """Estimated executor time of a finished call (see the module docstring)."""
    computed_prompt = max(0, usage.prompt_tokens - usage.cached_tokens)
    return usage.completion_tokens * config.decode_token_s + computed_prompt * config.prefill_token_s


# Seconds between two PLAS queues in :attr:`Admit.priority` (10^6 s, 11.6 days): larger than
# any time a call is held or waits in an engine's queue, so the queues stay strict tiers once
# the priority is made relative to dispatch (an engine sees 10^9 ms per queue, far inside
# vLLM's int64 ``priority``).
QUEUE_TIER_S = 1_000_000.0


class AutellixPolicy(RouterPolicy):
    name = "autellix"
    # It never holds a call while a worker is healthy, so a tick after each completion
    # would find nothing to do; the periodic tick admits calls held during an outage.
    ticks_after_completion = False

    config: AutellixConfig

    def __init__(self, config: AutellixConfig) -> None:
        super().__init__(config)
        self.process_table: dict[SessionId, ProcessEntry] = {}
        self._bounds = queue_bounds(config)
        self._in_flight: dict[str, int] = {}

    def reconfigure(self, config: AutellixConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        self._bounds = queue_bounds(config)

    # -- priority (Algorithm 1) ----------------------------------------------------------

    def queue_index(self, session_id: SessionId) -> int:
        """0-based PLAS queue a new call of this program enters (0 is ``Q_1``)."""
        entry = self.process_table.get(session_id)
        if entry is None or entry.service_s <= 0.0:
            return 0
        if entry.wait_s / entry.service_s >= self.config.starvation_ratio:
            return 0  # anti-starvation: the program has waited β times its service
        return bisect.bisect_right(self._bounds, entry.service_s)

    def _with_plas_priority(self, admit: Admit) -> Admit:
        """The call's arrival, ``queue index × QUEUE_TIER_S`` later: its PLAS queue first,
        then FCFS within the queue."""
        arrived_at = self.calls[admit.request_id].arrived_at
        level = self.queue_index(admit.session_id)
        return dataclasses.replace(admit, priority=arrived_at + level * QUEUE_TIER_S)

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        decision = super().decide_arrival(program, call, now)
        if isinstance(decision, Admit):
            return self._with_plas_priority(decision)
        return decision

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = [
            self._with_plas_priority(action) if isinstance(action, Admit) else action
            for action in super().tick(now)
        ]
        actions += self._release_stale(now)
        return actions

    def _release_stale(self, now: float) -> list[Action]:
        idle_after = self.config.idle_release_s
        actions: list[Action] = []
        for program in list(self.programs.values()):
            if not program.in_flight and not program.waiting and now - program.last_activity >= idle_after:
                actions += self.release(program.session_id, now, "idle")
        return actions

    # -- placement (Algorithm 2) ---------------------------------------------------------

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        if call.request.prompt_tokens <= self.config.short_call_tokens:
            return self._least_used(workers)
        entry = self.process_table.setdefault(program.session_id, ProcessEntry())
        if entry.pinned_worker not in workers:  # not pinned yet, or its engine failed
            entry.pinned_worker = self._least_used(workers)
        return entry.pinned_worker

    def _least_used(self, workers: list[str]) -> str:
        counts = self._in_flight
        return min(workers, key=lambda worker: counts.get(worker, 0))

    # -- bookkeeping ---------------------------------------------------------------------

    def _dispatch(self, program: Program, call: Call, worker: str, now: float) -> None:
        super()._dispatch(program, call, worker, now)
        self._in_flight[worker] = self._in_flight.get(worker, 0) + 1

    def _finish(self, request_id: str, usage: Usage | None,
                now: float) -> tuple[Call, Program | None]:
        call, program = super()._finish(request_id, usage, now)
        assert call.worker is not None  # the base raises for a call that never ran
        self._in_flight[call.worker] -= 1
        if program is not None and usage is not None:
            entry = self.process_table.setdefault(program.session_id, ProcessEntry())
            service = call_service_s(usage, self.config)
            entry.service_s += service
            entry.wait_s += max(0.0, (now - call.arrived_at) - service)
        return call, program

    def forget_worker(self, name: str) -> None:
        self._in_flight.pop(name, None)

    def release(self, session_id: SessionId, now: float, reason: str) -> list[Action]:
        self.process_table.pop(session_id, None)
        return super().release(session_id, now, reason)
