"""Routers without admission control: round robin, VERL's least-loaded, SkyRL's sticky
least-loaded and Dynamo's KV router (docs/architecture.md §4).

They never hold a call while a healthy worker exists and never pause: every call is
admitted on arrival, in arrival order. They differ only in where it goes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from scheduler.actions import Action, Decision
from scheduler.config import KvAwareConfig, LeastLoadedConfig, PolicyConfig
from scheduler.programs import Program
from scheduler.policies.base import Call, Policy, admit, hold


class RouterPolicy(Policy):
    """Shared shape: pick a worker per call, or hold only when no healthy worker exists."""

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        workers = self.healthy_workers()
        if not workers:
            if program.active:
                self._unhome(program, now)
            return hold(call, "no healthy worker")
        return admit(call, self.choose(program, call, workers))

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        raise NotImplementedError

    def tick(self, now: float) -> list[Action]:
        """Admit calls held while no worker was healthy, oldest first."""
        workers = self.healthy_workers()
        if not workers:
            return []
        actions: list[Action] = []
        for program in list(self.programs.values()):
            if not program.waiting:
                continue
            worker = self.choose(program, self.calls[program.waiting[0]], workers)
            if program.pending:
                program.place(worker, now)
            # else a later call of the session arrived after the workers came back and
            # placed the program already; its held calls follow it.
            actions += self._admit_waiting(program, worker, now, resumed=False)
        return actions


class CountsCallsInFlight(Policy):
    """Keeps each worker's calls in flight as a running count (``_in_flight``), for a router
    that balances on it at every call: the base's :meth:`~Policy.calls_in_flight` scans every
    call."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._in_flight: dict[str, int] = {}

    def _dispatch(self, program, call, worker, now):  # type: ignore[override]
        super()._dispatch(program, call, worker, now)
        self._in_flight[worker] = self._in_flight.get(worker, 0) + 1

    def _finish(self, request_id, usage, now):  # type: ignore[override]
        call, program = super()._finish(request_id, usage, now)
        self._in_flight[call.worker] -= 1
        return call, program

    def forget_worker(self, name: str) -> None:
        super().forget_worker(name)
        self._in_flight.pop(name, None)


class RoundRobinPolicy(RouterPolicy):
    """A plain load balancer: each call goes to the next healthy worker in turn.

    Parameters: none. Source: the default of nginx/Envoy-style HTTP load balancers; no
    session affinity, so a program's turns scatter across workers.
    """

    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._next = 0

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


class LeastLoadedPolicy(CountsCallsInFlight, RouterPolicy):
    """VERL's global load balancer for multi-turn rollouts.

    A session seen before goes back to its worker (sticky through an LRU of
    ``sticky_lru_size`` sessions, default 10,000 = VERL's
    ``DEFAULT_ROUTING_CACHE_SIZE``); a new one goes to the worker with the fewest calls in
    flight, the first such worker on ties. Source: VERL ``GlobalRequestLoadBalancer``
    (``acquire_server`` / ``release_server``).
    """

    name = "least_loaded"
    config: LeastLoadedConfig

    def __init__(self, config: LeastLoadedConfig) -> None:
        super().__init__(config)
        self._sticky: OrderedDict[str, str] = OrderedDict()

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        session = program.session_id
        worker = self._sticky.get(session)
        if worker is not None and worker in workers:
            self._sticky.move_to_end(session)
            return worker
        counts = self._in_flight
        worker = min(workers, key=lambda w: counts.get(w, 0))
        self._sticky[session] = worker
        if len(self._sticky) > self.config.sticky_lru_size:
            self._sticky.popitem(last=False)
        return worker


class StickyLeastLoadedPolicy(RouterPolicy):
    """SkyRL's ``sticky_least_loaded`` router (SkyRL PR #1791, vllm-project/router PR #235).

    A new session reserves the healthy worker with the fewest active sessions (ties broken
    by rendezvous hashing of session and worker, so deterministically); it stays there
    until it is released, goes idle (``idle_release_s``) or its worker fails. It balances
    sessions, not calls or tokens.
    """

    name = "sticky_least_loaded"

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        if program.home_worker in workers:
            return program.home_worker  # type: ignore[return-value]
        sessions = {w: 0 for w in workers}
        for other in self.programs.values():
            if other.home_worker in sessions and other.active:
                sessions[other.home_worker] += 1
        fewest = min(sessions.values())
        tied = [w for w in workers if sessions[w] == fewest]
        return max(tied, key=lambda w: _rendezvous(program.session_id, w))

    def tick(self, now: float) -> list[Action]:
        actions = super().tick(now)
        idle_after = self.config.idle_release_s
        for program in list(self.programs.values()):
            if not program.in_flight and not program.waiting and now - program.last_activity >= idle_after:
                actions += self.release(program.session_id, now, "idle")
        return actions


class KvAwarePolicy(RouterPolicy):
    """Dynamo's KV router: per call, the worker with the least
    ``cost = kv_overlap_score_weight · prefill_blocks + decode_blocks``.

    ``prefill_blocks`` are the call's prompt blocks not resident on the worker (from the KV
    index); ``decode_blocks`` the blocks of the worker's calls in flight plus this call's.
    Counted in tokens here, which scales every cost by the block size and picks the same
    worker. Temperature 0 (argmin), ties to the worker with fewer resident blocks, then by
    name. Defaults: weight 1.0, temperature 0 (Dynamo ``--router-kv-overlap-score-weight``,
    ``--router-temperature``). No admission control and no pausing.
    """

    name = "kv_aware"
    config: KvAwareConfig

    def __init__(self, config: KvAwareConfig) -> None:
        super().__init__(config)
        self._active_tokens: dict[str, int] = {}

    def choose(self, program: Program, call: Call, workers: list[str]) -> str:
        request = call.request
        weight = self.config.kv_overlap_score_weight
        best, best_key = workers[0], None
        for worker in workers:
            kv = self.index.worker(worker)
            overlap = self.resident_prefix(worker, call)
            prefill = max(0, request.prompt_tokens - overlap)
            decode = self._active_tokens.get(worker, 0) + request.prompt_tokens
            key = (weight * prefill + decode, len(kv.blocks), worker)
            if best_key is None or key < best_key:
                best, best_key = worker, key
        return best

    def _dispatch(self, program, call, worker, now):  # type: ignore[override]
        super()._dispatch(program, call, worker, now)
        self._active_tokens[worker] = self._active_tokens.get(worker, 0) + call.request.prompt_tokens

    def _finish(self, request_id, usage, now):  # type: ignore[override]
        call, program = super()._finish(request_id, usage, now)
        self._active_tokens[call.worker] -= call.request.prompt_tokens
        return call, program

    def forget_worker(self, name: str) -> None:
        self._active_tokens.pop(name, None)


def _rendezvous(session: str, worker: str) -> int:
    digest = hashlib.blake2b(f"{session}\x00{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
