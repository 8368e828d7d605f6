"""Where a program goes: a new program's worker, a parked one's resume target, the prefix
credit that draws a program to the worker holding its prompt, and the workers reserved for
programs too large for any (architecture.md §3 "New programs", "Resume").

"Fits" means the worker takes programs and its ``U`` with the program added stays under
the limit at hand: its pause threshold (:mod:`.capacity`) for a new program, that less
``resume_hysteresis`` for a resume.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.kv_index import KVIndex
from scheduler.ledger import Ledger
from scheduler.policies.base import Call, calls_per_worker, resident_prefix
from scheduler.policies.program_aware.capacity import PoolCapacity
from scheduler.programs import Program


class Reservations:
    """Workers drained for one program each: a program too large for any worker's resume
    limit, which no other program may be placed or resumed onto meanwhile.

    Invariant 1: a worker is reserved for at most one session, and (checked at each tick,
    :meth:`.resume.Resumption.reservation`) only while that session waits with a call, is
    not ACTIVE, and the worker takes programs.
    """

    def __init__(self) -> None:
        self._holder: dict[str, str] = {}  # worker -> session

    def open_to(self, worker: str, program: Program) -> bool:
        """Whether ``program`` may be placed or resumed on ``worker`` (not reserved for another)."""
        holder = self._holder.get(worker)
        return holder is None or holder == program.session_id

    def held(self) -> dict[str, str]:
        """Worker -> the session it is reserved for (a copy)."""
        return dict(self._holder)

    def reserve(self, worker: str, session: str) -> None:
        self._holder[worker] = session  # keeps invariant 1: one session a worker

    def cancel(self, worker: str) -> None:
        self._holder.pop(worker, None)


class Placement:
    """Chooses workers; moves nothing. Reads the program table and its groups (never
    changes them), the ledger and the KV index."""

    def __init__(self, config: ProgramAwareConfig, capacity: PoolCapacity, ledger: Ledger, index: KVIndex,
                 programs: Mapping[SessionId, Program], groups: Mapping[SessionId, set[SessionId]],
                 calls: Mapping[str, Call]) -> None:
        self.config = config
        self.capacity = capacity
        self.reservations = Reservations()
        self._ledger = ledger
        self._index = index
        self._programs = programs
        self._groups = groups
        self._calls = calls

    def reconfigure(self, config: ProgramAwareConfig, capacity: PoolCapacity) -> None:
        self.config, self.capacity = config, capacity

    # -- new programs ------------------------------------------------------------------

    def new_program_worker(self, program: Program, call: Call, soft_band: frozenset[str]) -> str | None:
        """Where a new program goes: its parent's worker when it fits there; else the
        fitting worker with the best score. Score: prefix credit − U, less
        ``soft_band_delay_s`` in the soft band; on a worker that runs all its programs (a
        host tier takes the overflow) its compute binds, not its KV: fewest calls in flight.
        None: no worker has room."""
        request = call.request
        demand = max(program.demand_tokens(),
                     request.prompt_tokens + request.growth_reserve(self.config.growth_reserve_tokens))
        self.capacity.recount(self._programs.values())  # arrivals come between ticks
        if program.parent_session_id is not None:
            parent = self._programs.get(program.parent_session_id)
            if parent is not None and parent.home_worker is not None:
                home = parent.home_worker
                if self.reservations.open_to(home, program) and self.fits(
                        home, demand, self.capacity.threshold(home, demand)):
                    return home
        in_flight: dict[str, int] | None = None  # counted when a worker runs all
        best, best_score = None, None
        for load in self._ledger.workers():
            if not load.accepts_programs or not self.reservations.open_to(load.name, program):
                continue
            u_after = self._ledger.utilization_with(load.name, demand)
            if u_after > self.capacity.threshold(load.name, demand):
                continue
            score: tuple[float, ...]
            if self.capacity.runs_all(load.name, demand):
                # as least_loaded (measured at CC256: 3624 against 3589 tok/s by prefix
                # credit − U)
                if in_flight is None:
                    in_flight = calls_per_worker(self._calls.values())
                score = (1, -in_flight.get(load.name, 0), -self._ledger.utilization(load.name))
            else:
                u = self._ledger.utilization(load.name)
                if best_score is not None and load.capacity_tokens:
                    # The credit is at most the whole prompt: a worker that could not beat
                    # the best even so is not asked for its prefix (the dearest read here,
                    # one per worker). Exact: the bound is computed as the score is, and
                    # each float step keeps the order of its inputs.
                    bound = request.prompt_tokens / load.capacity_tokens - u
                    if load.name in soft_band:
                        bound -= self.config.soft_band_delay_s
                    if not (0, bound) > best_score:
                        continue
                credit = self.prefix_credit(load.name, call) - u
                if load.name in soft_band:
                    credit -= self.config.soft_band_delay_s
                score = (0, credit)
            if best_score is None or score > best_score:
                best, best_score = load.name, score
        return best

    def prefix_credit(self, worker: str, call: Call) -> float:
        """The call's prompt tokens already resident on ``worker``, as a share of the
        worker's capacity: the same unit as ``U``, so credit and load trade off token for
        token. (A share of the *prompt* would let a system prompt cached everywhere outweigh
        any load difference and pile new programs onto the first worker that cached it.)
        Besides what the index knows, the prompt a group sibling running there shares with
        the call counts (:meth:`_sibling_prefix`)."""
        capacity = self._ledger.worker(worker).capacity_tokens
        if not capacity:
            return 0.0
        resident = resident_prefix(self._index, worker, call)
        request = call.request
        if request.group_id is not None and resident < request.prompt_tokens:
            resident = max(resident, self._sibling_prefix(worker, call))
        return resident / capacity

    def _sibling_prefix(self, worker: str, call: Call) -> int:
        """Prompt tokens the call shares with an active program of its group homed on
        ``worker`` (by their continuation chains): the samples of one GRPO prompt arrive
        together, before the engine has reported any of their blocks, and without this they
        would scatter by load alone, each prefilling the shared prompt on its own worker.
        (The simulator publishes a step's KV events as it starts, so there the index knows
        a sibling's blocks already and this adds nothing: rl_swe CC512 measured the same to
        the token with and without it; the gateway hears them milliseconds later.)"""
        request = call.request
        chain, tokens = request.chain, request.chain_tokens
        if chain is None or tokens is None:
            return 0
        best = 0
        for session in self._groups.get(request.group_id, ()):  # type: ignore[arg-type]
            sibling = self._programs[session]
            if (session == request.session_id or sibling.home_worker != worker
                    or not sibling.active or sibling.chain is None):
                continue
            shared = chain.common_prefix_len(sibling.chain)
            if shared:
                best = max(best, tokens[shared - 1])
        return min(best, request.prompt_tokens)

    # -- resume targets ----------------------------------------------------------------

    def resume_target(self, program: Program, demand: float) -> str | None:
        """Where a parked program of ``demand`` tokens resumes: its home if it fits there
        (its KV may still be resident; only there when the capacity anchors it), else the
        parent's worker for a sub-agent, else best fit (the fitting worker with the least
        headroom left). None: it fits nowhere."""
        open_to = self.reservations.open_to
        if self.capacity.anchored_home(program):
            home = program.home_worker
            assert home is not None  # an anchored program has a home
            return home if open_to(home, program) and self._resumable(home, program, demand) else None
        preferred = [program.home_worker]
        if program.parent_session_id is not None:
            parent = self._programs.get(program.parent_session_id)
            if parent is not None:
                preferred.append(parent.home_worker)

        for worker in preferred:
            if worker is not None and open_to(worker, program) and self._resumable(worker, program, demand):
                return worker
        best, best_u = None, -math.inf
        for load in self._ledger.workers():
            if not load.accepts_programs or not open_to(load.name, program):
                continue
            u = self._ledger.utilization_with(load.name, demand)
            if u > best_u and self._resumable(load.name, program, demand):
                best, best_u = load.name, u
        return best

    def _resumable(self, worker: str, program: Program, demand: float) -> bool:
        """Whether ``program`` fits on ``worker`` under its resume limit (its pause threshold
        less ``resume_hysteresis``)."""
        counted = program.paused and program.home_worker == worker  # among its paused tokens
        newcomer = 0 if counted else int(demand)
        limit = self.capacity.threshold(worker, newcomer) - self.config.resume_hysteresis
        return self.fits(worker, demand, limit)  # keeps the policy's invariant 2

    def fits(self, worker: str, demand: float, limit: float) -> bool:
        load = self._ledger.worker(worker)
        return load.accepts_programs and self._ledger.utilization_with(worker, demand) <= limit

    def max_headroom(self, limit: float) -> float:
        """The most tokens any worker that takes programs has below ``limit``."""
        best = 0.0
        for load in self._ledger.workers():
            if load.accepts_programs:
                best = max(best, limit * load.capacity_tokens - self._ledger.load_tokens(load.name))
        return best
