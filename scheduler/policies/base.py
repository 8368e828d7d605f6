"""The one interface every policy implements, and the bookkeeping they all share.

A shell drives a policy with observations and ``now``:
``on_arrival`` → :class:`Admit` or :class:`Hold`; ``on_complete`` / ``on_abort`` → actions;
``tick`` → actions (including :class:`Admit` for calls held earlier); ``observe_kv`` feeds the
KV index. The shell carries out what comes back and never decides anything itself.

Subclasses choose where a call goes (:meth:`Policy.decide_arrival`) and may hold programs;
the base keeps the program table, the calls in flight and held, the ledger and the index, so
every policy is measured on the same state.

Invariant 1: ``calls`` holds every call from its arrival until it completes or is aborted
(a held one also until its program is released); a call's ``worker`` is None exactly while
it is held, and then its request id is in its program's ``waiting``.

Invariant 2: ``groups`` maps each group id to its live programs only, and holds no empty
group.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.actions import Action, Admit, Decision, Hold, Release
from scheduler.calls import CallRequest, Usage
from scheduler.config import PolicyConfig
from scheduler.coordinates import SessionId
from scheduler.kv_events import EventBatch
from scheduler.kv_index import KVIndex
from scheduler.ledger import FixedTokenWeights, Ledger, TokenWeights
from scheduler.programs import Program
from scheduler.snapshot import PolicySnapshot, ProgramView, WorkerView

# The release reason of a program whose every call was refused, failed or abandoned.
NEVER_RAN = "no call completed"


class UnknownCall(KeyError):
    """A completion or abort named a call the policy never saw (a shell bug)."""


@dataclass(slots=True)
class Call:
    request: CallRequest
    arrived_at: float
    worker: str | None = None  # None while held

    @property
    def session_id(self) -> SessionId:
        return self.request.session_id


@dataclass(slots=True)
class PolicyStats:
    admitted: int = 0
    held: int = 0
    pauses: int = 0
    resumes: int = 0
    forced_resumes: int = 0
    marks: int = 0
    releases: int = 0
    # program_aware v2: resumes forced by max_wait_s (also counted in forced_resumes), and
    # programs found dormant (in a long tool call: not counted in U, their KV retained, or
    # offloaded with a host tier's offload_dormant)
    wait_limit_resumes: int = 0
    dormant: int = 0


class Policy(ABC):
    """Shared state and bookkeeping; subclasses decide placement and pausing."""

    name: str = "abstract"
    # Whether a shell runs a tick right after each completion (architecture.md §3), besides the
    # periodic one. Baselines published with a fixed scheduler loop say False.
    ticks_after_completion: bool = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.index = KVIndex()
        self.ledger = Ledger(self.token_weights(config), self.index)
        self.programs: dict[SessionId, Program] = {}
        # group id -> its programs (CallRequest.group_id: a GRPO group, a task's runs, a tree)
        self.groups: dict[SessionId, set[SessionId]] = {}
        self.calls: dict[str, Call] = {}
        self.stats = PolicyStats()

    # -- configuration and workers -------------------------------------------------------

    @property
    def tick_interval_s(self) -> float:
        return self.config.tick_interval_s

    def reconfigure(self, config: PolicyConfig) -> None:
        """Swap thresholds at run time (hot reload); the policy's kind may not change."""
        if config.name != self.config.name:
            raise ValueError(f"cannot switch policy from {self.config.name} to {config.name} live")
        self.config = config
        self.ledger.reconfigure(self.token_weights(config))

    def token_weights(self, config: PolicyConfig) -> TokenWeights:
        """How this policy's ledger counts tokens in ``U``; a policy whose config does not set
        them measures with the program-aware defaults."""
        return FixedTokenWeights()

    def add_worker(self, name: str, capacity_tokens: int | None = None) -> None:
        self.ledger.add_worker(name, capacity_tokens)
        self.index.worker(name)
        if capacity_tokens is not None:
            self.index.set_capacity(name, capacity_tokens)  # bounds what its events may store

    def set_capacity(self, name: str, capacity_tokens: int) -> None:
        self.ledger.set_capacity(name, capacity_tokens)
        self.index.set_capacity(name, capacity_tokens)

    def calls_on(self, name: str) -> int:
        """Calls in flight on worker ``name``."""
        return sum(1 for call in self.calls.values() if call.worker == name)

    def remove_worker(self, name: str, now: float) -> list[Action]:
        """Take a worker out of the fleet for good. It must have no call in flight (drain it
        first: ``set_worker_health(name, False)`` and wait); programs still homed there are
        placed afresh at their next call."""
        if self.calls_on(name):
            raise ValueError(f"worker {name!r} still has {self.calls_on(name)} call(s) in flight")
        actions = self.set_worker_health(name, False, now)
        self.ledger.remove_worker(name)
        self.index.drop_worker(name)
        self.forget_worker(name)
        return actions

    def forget_worker(self, name: str) -> None:
        """Hook: drop a policy's own per-worker state when the worker leaves the fleet."""

    def set_worker_health(self, name: str, healthy: bool, now: float) -> list[Action]:
        """Mark a worker (un)healthy; programs homed on a failed worker are re-homed."""
        self.ledger.set_healthy(name, healthy)
        if healthy:
            return []
        actions: list[Action] = []
        for program in list(self.programs.values()):
            if program.home_worker == name and not program.in_flight:
                actions.extend(self._unhome(program, now))
        return actions

    def _unhome(self, program: Program, now: float) -> list[Action]:
        """Forget a program's placement so its next call is placed afresh."""
        program.unhome()
        self.ledger.refresh(program)
        return []

    # -- observations --------------------------------------------------------------------

    def observe_kv(self, worker: str, batch: EventBatch) -> int:
        """Feed one decoded event batch from ``worker``; returns the hashes it carried."""
        return self.index.apply_batch(worker, batch)

    def reset_worker_kv(self, worker: str) -> None:
        """The worker's engine restarted or its event stream cannot be repaired."""
        self.index.reset_worker(worker)

    def on_arrival(self, request: CallRequest, now: float) -> Decision:
        if request.request_id in self.calls:
            raise ValueError(f"call {request.request_id} arrived twice")
        program = self.programs.get(request.session_id)
        if program is None:
            program = Program(request.session_id, now, request.parent_session_id)
            self.programs[request.session_id] = program
        program.note_call(request)
        refined = program.refine_prompt(request)
        if refined != request.prompt_tokens:
            request = dataclasses.replace(request, prompt_tokens=refined)
        if program.group_id is not None:
            self.groups.setdefault(program.group_id, set()).add(program.session_id)
        call = Call(request, now)
        self.calls[request.request_id] = call
        decision = self.decide_arrival(program, call, now)
        if isinstance(decision, Admit):
            self._dispatch(program, call, decision.worker, now)
        else:
            program.hold(request.request_id, now)  # keeps invariant 1
            self.stats.held += 1
        return decision

    def on_complete(self, request_id: str, usage: Usage, now: float) -> list[Action]:
        call, program = self._finish(request_id, usage, now)
        if program is None:
            return []  # its program was released while it ran
        actions: list[Action] = []
        if call.request.final:
            actions.extend(self.release(program.session_id, now, "final"))
        else:
            actions.extend(self.after_call(program, now))
        return actions

    def on_abort(self, request_id: str, now: float) -> list[Action]:
        """A call ended without a response (refused, failed, cut), or a held call's client
        went away. A program left with no call completed, none in flight and none held never
        ran: it is released at once, not kept until ``idle_release_s`` (architecture.md §5.1)."""
        call = self.calls.get(request_id)
        if call is None:
            raise UnknownCall(request_id)
        if call.worker is None:
            del self.calls[request_id]
            program = self.programs[call.session_id]
            program.drop_waiting(request_id)  # keeps invariant 1
            if program.never_ran:
                return self.release(program.session_id, now, NEVER_RAN)
            self.after_held_call(program)
            return []
        _, program = self._finish(request_id, None, now)
        if program is None:
            return []
        if program.never_ran:
            return self.release(program.session_id, now, NEVER_RAN)
        return self.after_call(program, now)

    def release(self, session_id: SessionId, now: float, reason: str) -> list[Action]:
        """End a program (final call, idle, or an operator); its held calls are aborted.
        Calls still in flight run out: their completion or abort is accepted and ignored."""
        program = self.programs.pop(session_id, None)
        if program is None:
            return []
        if program.group_id is not None:
            members = self.groups.get(program.group_id)
            if members is not None:
                members.discard(session_id)
                if not members:
                    del self.groups[program.group_id]  # keeps invariant 2
        for request_id in program.waiting:
            self.calls.pop(request_id, None)  # keeps invariant 1
        self.ledger.forget(session_id)
        self.stats.releases += 1
        return [Release(session_id, program.home_worker, reason)]

    # -- the parts a policy decides ------------------------------------------------------

    @abstractmethod
    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        """Admit the call to a worker now, or hold it."""

    def after_call(self, program: Program, now: float) -> list[Action]:
        """Hook after a call of ``program`` finished or was aborted."""
        return []

    def after_held_call(self, program: Program) -> None:
        """Hook after a held call of ``program`` went away before it ran (its client left),
        the program living on."""

    @abstractmethod
    def tick(self, now: float) -> list[Action]:
        """Periodic pass; also run by the shells after each completion."""

    # -- helpers for subclasses ----------------------------------------------------------

    def _dispatch(self, program: Program, call: Call, worker: str, now: float) -> None:
        if program.pending:
            program.place(worker, now)
        elif program.home_worker != worker:
            program.move_home(worker)
        call.worker = worker  # keeps invariant 1
        program.begin_call(call.request, self.call_growth_reserve(call.request), now)
        self.ledger.refresh(program)
        self.stats.admitted += 1

    def call_growth_reserve(self, request: CallRequest) -> int:
        """Tokens a dispatched call may still add, in its program's demand while it runs: the
        client's expected output, else ``growth_reserve_tokens``."""
        return request.growth_reserve(self.config.growth_reserve_tokens)

    def _finish(self, request_id: str, usage: Usage | None, now: float) -> tuple[Call, Program | None]:
        """Retire a dispatched call; the program is None when it was released meanwhile
        (a final call or an operator release while this call still ran)."""
        call = self.calls.get(request_id)
        if call is None or call.worker is None:
            raise UnknownCall(request_id)  # a held call stays held
        del self.calls[request_id]
        program = self.programs.get(call.session_id)
        if program is None or request_id not in program.in_flight:
            # Released while it ran; the session may even have started over since.
            return call, None
        program.end_call(request_id, usage, now)
        self.ledger.refresh(program)
        return call, program

    def _admit_waiting(self, program: Program, worker: str, now: float, resumed: bool,
                       boost: float = 0.0, lead_s: float | None = None) -> list[Action]:
        """Dispatch every held call of an ACTIVE program to ``worker``, ``boost`` seconds
        ahead of their arrival in the engine's queue, an arrival counted at most ``lead_s``
        before ``now`` (None: as it was)."""
        actions: list[Action] = []
        for request_id in program.take_waiting():
            call = self.calls[request_id]
            self._dispatch(program, call, worker, now)
            arrived = call.arrived_at if lead_s is None else max(call.arrived_at, now - lead_s)
            actions.append(Admit(request_id, program.session_id, worker, arrived - boost,
                                 resumed=resumed))
        return actions

    def resident_prefix(self, worker: str, call: Call) -> int:
        """Tokens of the call's prompt resident on ``worker`` (:func:`resident_prefix`)."""
        return resident_prefix(self.index, worker, call)

    def adaptive_settings(self) -> dict[str, float]:
        """Values the policy learns online from what it observes (name → current value), for
        the shells to export; empty for a policy that learns nothing."""
        return {}

    def healthy_workers(self) -> list[str]:
        return [load.name for load in self.ledger.workers() if load.healthy]

    def calls_in_flight(self) -> dict[str, int]:
        """Worker -> calls admitted there and not yet finished (workers with none left out)."""
        return calls_per_worker(self.calls.values())

    def snapshot(self, with_programs: bool = True) -> PolicySnapshot:
        """A frozen picture of the policy for metrics and admin views (scheduler/snapshot.py)."""
        in_flight = self.calls_in_flight()
        workers = []
        for load in self.ledger.workers():
            u = self.ledger.utilization(load.name)
            kv = self.index.worker(load.name) if load.name in self.index.workers() else None
            workers.append(WorkerView(
                load.name, load.healthy, load.capacity_tokens, u if math.isfinite(u) else None,
                len(load.programs), in_flight.get(load.name, 0), self.index.has_events(load.name),
                kv.evicted_tokens if kv else 0, kv.unknown_removals if kv else 0,
                kv.attributed_removals if kv else 0))
        programs = tuple(
            ProgramView(p.session_id, p.parent_session_id, p.lifecycle.value, p.phase.value,
                        p.marked, p.home_worker, p.context_tokens, len(p.in_flight),
                        len(p.waiting), p.steps, p.created_at, p.last_activity, p.group_id)
            for p in self.programs.values()) if with_programs else ()
        return PolicySnapshot(self.name, programs, tuple(workers),
                              dataclasses.asdict(self.stats), self.adaptive_settings())

    def program_view(self, session_id: SessionId) -> ProgramView | None:
        p = self.programs.get(session_id)
        if p is None:
            return None
        return ProgramView(p.session_id, p.parent_session_id, p.lifecycle.value, p.phase.value,
                           p.marked, p.home_worker, p.context_tokens, len(p.in_flight),
                           len(p.waiting), p.steps, p.created_at, p.last_activity, p.group_id)

    def has_program(self, session_id: SessionId) -> bool:
        return session_id in self.programs

    def program_count(self) -> int:
        return len(self.programs)

    def call_workers(self) -> dict[str, str | None]:
        """Every call the policy tracks → its worker (None while held): what a shell checks
        its own view against after a policy error."""
        return {request_id: call.worker for request_id, call in self.calls.items()}


def hold(call: Call, reason: str) -> Hold:
    return Hold(call.request.request_id, call.session_id, reason)


def admit(call: Call, worker: str) -> Admit:
    """Admit ``call`` to ``worker`` at its place by arrival in the engine's queue."""
    return Admit(call.request.request_id, call.session_id, worker, call.arrived_at)


def calls_per_worker(calls: Iterable[Call]) -> dict[str, int]:
    """Worker -> how many of ``calls`` are admitted there (workers with none left out)."""
    in_flight: dict[str, int] = {}
    for call in calls:
        if call.worker is not None:
            in_flight[call.worker] = in_flight.get(call.worker, 0) + 1
    return in_flight


def resident_prefix(index: KVIndex, worker: str, call: Call) -> int:
    """Tokens of the call's prompt resident on ``worker`` by the best evidence at hand:
    the engine's block hashes, else continuation labels, else the session's own blocks."""
    request = call.request
    kv = index.worker(worker)
    resident = kv.session_tokens.get(request.session_id, 0)
    if request.block_hashes:
        resident = max(resident, kv.prefix_tokens(request.block_hashes))
    elif request.chain is not None:
        resident = max(resident, kv.continuation_tokens(reversed(request.chain.ids)))
    return min(resident, request.prompt_tokens)
