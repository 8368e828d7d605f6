"""The program state machine (architecture.md §2 "Programs").

A program is one agent run, keyed by its session id. Its ``phase`` is REASONING while at
least one of its calls is in flight and ACTING between a response and the next request.
Its ``lifecycle`` is PENDING until it is first placed on a worker, then ACTIVE or PAUSED.
PENDING is the one state v1's two-valued lifecycle leaves implicit: a new program
the policy holds has no home worker and nothing resident yet, so it is neither.

Every transition is a method that checks the current state; an illegal one raises
:class:`IllegalTransition` because it means a bug in a policy or a shell. What the checks
keep, cited where they are kept:

Invariant 1: ``phase`` is REASONING exactly while ``in_flight`` is not empty, and
``acting_since`` is set exactly while it is ACTING after a call ended.

Invariant 2: an ACTIVE program has a home worker and a PENDING one has none (a PAUSED one
keeps its home unless that worker failed).

Invariant 3: calls start only while ACTIVE; a call is held (``waiting``) only while PENDING
or PAUSED, and the held calls are handed over only once ACTIVE again.

Invariant 4: a program is marked only while ACTIVE+REASONING, and a pause (ACTIVE+ACTING
only: nothing in flight is ever aborted) clears the mark.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import ContinuationChain, ContinuationId, SessionId


class Phase(enum.Enum):
    REASONING = "reasoning"
    ACTING = "acting"


class Lifecycle(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    PAUSED = "paused"


class IllegalTransition(RuntimeError):
    """A state change that the program's current state does not allow."""


@dataclass(slots=True)
class Program:
    session_id: SessionId
    created_at: float
    parent_session_id: SessionId | None = None
    phase: Phase = Phase.ACTING
    lifecycle: Lifecycle = Lifecycle.PENDING
    marked: bool = False
    home_worker: str | None = None
    context_tokens: int = 0
    # request_id -> tokens that call may occupy while it runs (prompt + growth reserve)
    in_flight: dict[str, int] = field(default_factory=dict)
    # held request ids, oldest first: calls that arrived while the program could not run
    waiting: list[str] = field(default_factory=list)
    steps: int = 0
    acting_since: float | None = None
    last_activity: float = 0.0
    chain: ContinuationChain | None = None
    chain_tokens: tuple[int, ...] | None = None
    # programs that belong together (a GRPO group, a task's runs, a tree under its root)
    group_id: SessionId | None = None
    # from the client's hints on its latest call (scheduler.calls.CallHints)
    priority: int = 0
    retention_ttl_s: float | None = None
    # the prompt chain of the call whose usage gave ``context_tokens``
    context_chain: ContinuationChain | None = None
    # request id -> its prompt chain, while in flight (to know which call answered)
    _in_flight_chains: dict[str, ContinuationChain | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.last_activity = self.created_at

    # -- derived ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.lifecycle is Lifecycle.ACTIVE

    @property
    def paused(self) -> bool:
        return self.lifecycle is Lifecycle.PAUSED

    @property
    def pending(self) -> bool:
        return self.lifecycle is Lifecycle.PENDING

    @property
    def chain_head(self) -> ContinuationId | None:
        """The continuation id of its latest prompt: what a retention directive names, so
        the engine keeps that prefix (None for a program whose calls carry no chain)."""
        return self.chain.head if self.chain is not None else None

    def refine_prompt(self, request: CallRequest) -> int:
        """The prompt of a call that carries on from this program's last answered call: that
        call's exact context (its prompt and its answer, as the engine counted them) plus the
        estimate of only what the call adds after the answer. The shell's estimate of the
        whole conversation (about 4 bytes a token) is off by 6–13% on ordinary text; the
        engine's count of the part seen before is not. Any other call: the shell's count."""
        chain, tokens, before = request.chain, request.chain_tokens, self.context_chain
        if (not request.prompt_estimated or chain is None or tokens is None or before is None
                or self.in_flight):
            return request.prompt_tokens
        answered = len(before.ids)  # the answer is the element right after that prompt
        if len(chain.ids) <= answered or chain.ids[:answered] != before.ids:
            return request.prompt_tokens
        return self.context_tokens + tokens[-1] - tokens[answered]

    @property
    def never_ran(self) -> bool:
        """No call completed, and none is in flight or held: nothing of it exists anywhere."""
        return self.steps == 0 and not self.in_flight and not self.waiting

    def demand_tokens(self) -> int:
        """Tokens this program needs resident: its context, or what its calls may grow to."""
        if self.in_flight:
            return max(self.context_tokens, max(self.in_flight.values()))
        return self.context_tokens

    def waiting_demand_tokens(self, reserve: int, prompt_tokens: Callable[[str], int]) -> int:
        """Demand once its waiting calls are admitted (what a held program is placed by):
        :meth:`demand_tokens` — more than the context while calls are still in flight, so a
        program re-homed mid-call brings their demand along — or the largest waiting prompt
        plus ``reserve``."""
        demand = self.demand_tokens()
        if self.waiting:
            return max(demand, max(prompt_tokens(r) for r in self.waiting) + reserve)
        return demand

    # -- transitions -----------------------------------------------------------------------

    def place(self, worker: str, now: float) -> None:
        """PENDING → ACTIVE on ``worker``."""
        if self.lifecycle is not Lifecycle.PENDING:
            raise IllegalTransition(f"{self.session_id}: place() needs PENDING, is {self.lifecycle.name}")
        self.lifecycle = Lifecycle.ACTIVE
        self.home_worker = worker  # keeps invariant 2
        self.last_activity = now

    def begin_call(self, request: CallRequest, reserve_tokens: int, now: float) -> None:
        """A call is dispatched: the program is REASONING while any call is in flight."""
        if self.lifecycle is not Lifecycle.ACTIVE:  # keeps invariant 3
            raise IllegalTransition(
                f"{self.session_id}: a call can only start while ACTIVE, is {self.lifecycle.name}"
            )
        if request.request_id in self.in_flight:
            raise IllegalTransition(f"{self.session_id}: call {request.request_id} already in flight")
        self.in_flight[request.request_id] = request.prompt_tokens + reserve_tokens
        self._in_flight_chains[request.request_id] = request.chain
        self.phase = Phase.REASONING  # keeps invariant 1
        self.acting_since = None
        self.last_activity = now
        if request.chain is not None:
            self.chain = request.chain
            self.chain_tokens = request.chain_tokens

    def end_call(self, request_id: str, usage: Usage | None, now: float) -> None:
        """A call finished (``usage`` given) or was aborted (``usage`` None)."""
        if request_id not in self.in_flight:
            raise IllegalTransition(f"{self.session_id}: call {request_id} is not in flight")
        del self.in_flight[request_id]
        chain = self._in_flight_chains.pop(request_id, None)
        if usage is not None:
            self.context_tokens = usage.context_tokens
            self.context_chain = chain
            self.steps += 1
        self.last_activity = now
        if not self.in_flight:  # keeps invariant 1
            self.phase = Phase.ACTING
            self.acting_since = now

    def mark(self) -> None:
        """Ask for a pause at the next tool boundary (only while REASONING and ACTIVE)."""
        if self.lifecycle is not Lifecycle.ACTIVE or self.phase is not Phase.REASONING:  # invariant 4
            raise IllegalTransition(
                f"{self.session_id}: mark() needs ACTIVE+REASONING, is "
                f"{self.lifecycle.name}+{self.phase.name}"
            )
        if self.marked:
            raise IllegalTransition(f"{self.session_id}: already marked")
        self.marked = True

    def pause(self) -> None:
        """ACTIVE+ACTING → PAUSED. Calls in flight are never aborted, so REASONING raises."""
        if self.lifecycle is not Lifecycle.ACTIVE or self.phase is not Phase.ACTING:
            raise IllegalTransition(
                f"{self.session_id}: pause() needs ACTIVE+ACTING, is "
                f"{self.lifecycle.name}+{self.phase.name}"
            )
        self.lifecycle = Lifecycle.PAUSED
        self.marked = False  # keeps invariant 4

    def resume(self, worker: str, now: float) -> None:
        """PAUSED or PENDING → ACTIVE on ``worker`` (which becomes its home)."""
        if self.lifecycle is Lifecycle.ACTIVE:
            raise IllegalTransition(f"{self.session_id}: resume() on an ACTIVE program")
        self.lifecycle = Lifecycle.ACTIVE
        self.home_worker = worker  # keeps invariant 2
        self.last_activity = now

    def move_home(self, worker: str) -> None:
        """An ACTIVE program's next call runs on another worker, which becomes its home."""
        if self.lifecycle is not Lifecycle.ACTIVE:
            raise IllegalTransition(f"{self.session_id}: move_home() needs ACTIVE, is {self.lifecycle.name}")
        self.home_worker = worker

    def unhome(self) -> None:
        """Forget the placement (its worker failed): an ACTIVE program is PENDING again and is
        placed afresh; a PAUSED one stays paused and resumes anywhere. Calls still in flight
        on the failed worker run out; their demand comes along."""
        self.home_worker = None
        if self.lifecycle is Lifecycle.ACTIVE:
            self.lifecycle = Lifecycle.PENDING  # keeps invariant 2

    def note_call(self, request: CallRequest) -> None:
        """A call of this program arrived: keep what it says about the program (its group the
        first time one is named; the client's priority and retention TTL, as of this call)."""
        if self.group_id is None:
            self.group_id = request.group_id
        hints = request.hints
        self.priority = hints.priority if hints is not None else 0
        self.retention_ttl_s = hints.retention_ttl_s if hints is not None else None

    def hold(self, request_id: str, now: float) -> None:
        """A call arrived that may not run yet (program PENDING or PAUSED)."""
        if self.lifecycle is Lifecycle.ACTIVE:
            raise IllegalTransition(f"{self.session_id}: hold() on an ACTIVE program")  # invariant 3
        if request_id in self.waiting:
            raise IllegalTransition(f"{self.session_id}: call {request_id} already waiting")
        self.waiting.append(request_id)
        self.last_activity = now

    def take_waiting(self) -> list[str]:
        """Hand over every held call (on resume); the program must be ACTIVE by then."""
        if self.lifecycle is not Lifecycle.ACTIVE:
            raise IllegalTransition(  # keeps invariant 3
                f"{self.session_id}: waiting calls released while {self.lifecycle.name}")
        taken, self.waiting = self.waiting, []
        return taken

    def drop_waiting(self, request_id: str) -> None:
        """A held call went away (client disconnected) before it ran."""
        try:
            self.waiting.remove(request_id)
        except ValueError:
            raise IllegalTransition(f"{self.session_id}: call {request_id} is not waiting") from None
