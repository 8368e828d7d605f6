"""Each worker's health, mode and capacity as the gateway sees them (:class:`WorkerState`).

- Capacity: ``capacity_tokens`` from the YAML (or the admin API's worker entry), else the
  worker's ``/metrics`` ``vllm:cache_config_info`` labels ``(num_gpu_blocks − 1) ×
  block_size`` (vLLM's block pool keeps block 0 as its null block; a hybrid model's
  group-aware ``kv_cache_size_tokens`` instead, :func:`capacity_from_metrics`; summed over its ``engine``
  label values when one API server fronts several data-parallel engines), retried every ``capacity_retry_s`` until known (:meth:`WorkerRegistry.learn_capacity`).
  Until then the policy's ledger has no capacity for the worker, so it takes no new programs.
- Health: ``GET /health`` every ``health_interval_s`` (:meth:`WorkerRegistry.watch_health`);
  after ``unhealthy_after`` failures in a row the worker is marked down in the policy (its
  programs are re-homed), and up again at its first good answer. A refused connection on a
  call takes it down at once (:meth:`WorkerRegistry.mark_unreachable`).
- The gateway's own shortages: a check or probe that fails because the gateway ran out of
  descriptors, socket buffers or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) was not made, and
  is not counted against the worker; it is logged once per spell and counted in
  ``local_shortages``.
- Mode: serving, draining or asleep, as the operator sets it (:meth:`WorkerRegistry.set_mode`).

The registry's per-worker :meth:`~WorkerRegistry.add` and :meth:`~WorkerRegistry.remove`
only enter and drop the state; a worker's health and capacity loops run among its tasks in
the fleet (controller/fleet.py), which adds and removes workers as one operation each. The
loops also end by themselves once their worker's state has left the registry, so that none
can outlive its worker (and probe a connection pool it no longer has).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import anyio
import httpx

from controller.admission import Admission
from controller.errors import describe_shortage, local_shortage
from controller.serve_config import ServeConfig, WorkerConfig
from controller.upstream import UpstreamPool

_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}\s+\S+", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
HEALTH_TIMEOUT_CAP_S = 5.0


class CapacityUnknown(ValueError):
    """The worker's /metrics does not (yet) tell its KV capacity."""


# How far vLLM's group-aware capacity may stray from blocks × block size before it is taken
# instead: a full-attention model's differ only by the padding of a max_model_len request's
# last block; a hybrid model's (sliding-window or state-space layer groups) by far more.
_GROUPS_CHANGE_CAPACITY = 0.05


def capacity_from_metrics(text: str) -> int:
    """The tokens a worker's KV pool holds, from vLLM's ``cache_config_info`` metric, summed
    over engines: ``(num_gpu_blocks − 1) × block_size``, less the null block
    (``vllm/v1/core/block_pool.py`` takes block 0 off the free queue for good).

    A hybrid model's requests take blocks from several KV-cache groups (a sliding-window
    group holds only its window), so its blocks times block size is not its capacity. vLLM
    0.32 reports the group-aware figure as the label ``kv_cache_size_tokens``
    (``vllm/v1/core/kv_cache_utils.py`` ``get_kv_cache_capacity``: its maximum concurrency at
    ``max_model_len`` times ``max_model_len``); where it differs from blocks × block size by
    more than :data:`_GROUPS_CHANGE_CAPACITY`, it is taken, less the null block's share.
    Raises :class:`CapacityUnknown` saying what is missing."""
    per_engine: dict[str, int] = {}
    seen = False
    for match in _INFO_LINE.finditer(text):
        seen = True
        labels = dict(_LABEL.findall(match.group("labels")))
        blocks, block_size = labels.get("num_gpu_blocks"), labels.get("block_size")
        if not (blocks and blocks.isdigit() and block_size and block_size.isdigit()):
            continue  # "None" until the engine has profiled its memory
        per_engine.setdefault(labels.get("engine", ""),
                              _engine_capacity(int(blocks), int(block_size),
                                               labels.get("kv_cache_size_tokens")))
    if not seen:
        raise CapacityUnknown("no vllm:cache_config_info metric")
    total = sum(per_engine.values())
    if total <= 0:
        raise CapacityUnknown("vllm:cache_config_info has no num_gpu_blocks and block_size yet")
    return total


def _engine_capacity(blocks: int, block_size: int, group_aware: str | None) -> int:
    by_blocks = max(blocks - 1, 0) * block_size
    if not (group_aware and group_aware.isdigit() and blocks > 0):
        return by_blocks  # "None", or a vLLM older than the label
    tokens = int(group_aware)
    if abs(tokens - blocks * block_size) <= _GROUPS_CHANGE_CAPACITY * blocks * block_size:
        return by_blocks
    return tokens * (blocks - 1) // blocks


class WorkerMode(str, Enum):
    """What the operator asked of a worker (its health is separate: a check's finding).

    SERVING takes calls; DRAINING takes no new ones and lets its calls finish (then it can be
    removed); ASLEEP takes none and its KV counts as gone (an RL trainer's weight sync:
    vLLM's sleep mode drops the cache), until it is woken. Calls that find no SERVING worker
    but one ASLEEP are held for it rather than refused."""

    SERVING = "serving"
    DRAINING = "draining"
    ASLEEP = "asleep"


class MembershipError(ValueError):
    """An operator's membership request that cannot be done (unknown worker, calls still in
    flight, a name taken); ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class WorkerState:
    name: str
    url: str
    capacity_tokens: int | None
    capacity_source: str | None
    healthy: bool = True
    mode: WorkerMode = WorkerMode.SERVING
    failures: int = 0
    last_error: str | None = None
    last_check_unix: float | None = None
    capacity_error: str | None = None
    # checks and probes not made because the gateway ran out of descriptors, buffers or
    # memory (none of them counts against the worker), and the shortage of the last one
    # (None once one is made again)
    local_shortages: int = 0
    local_shortage: str | None = None


class WorkerRegistry:
    def __init__(self, config: ServeConfig, pool: UpstreamPool, admission: Admission, log: Any,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._pool = pool
        self._admission = admission
        self._log = log
        self._wall = wall_clock
        self.states: dict[str, WorkerState] = {}

    def healthy_names(self) -> list[str]:
        """Workers that take calls now: healthy and serving."""
        return [s.name for s in self.states.values() if _available(s)]

    def can_take_calls(self) -> bool:
        """Whether a call should wait rather than be refused: some worker serves, or one is
        asleep and will be woken."""
        return any(_available(s) or (s.healthy and s.mode is WorkerMode.ASLEEP)
                   for s in self.states.values())

    # -- membership ------------------------------------------------------------------------

    def add(self, worker: WorkerConfig) -> WorkerState:
        """Enter a worker's state: healthy and serving until a check says otherwise."""
        if worker.name in self.states:
            raise MembershipError(f"a worker named {worker.name!r} exists already")
        state = self.states[worker.name] = WorkerState(
            worker.name, worker.url, worker.capacity_tokens,
            "config" if worker.capacity_tokens else None)
        return state

    def remove(self, name: str) -> None:
        del self.states[name]

    async def set_mode(self, name: str, mode: WorkerMode) -> WorkerState:
        """Drain, put to sleep or wake a worker: the policy takes it out of (or back into)
        placement as its availability changes; asleep, its KV counts as gone."""
        state = self._state(name)
        if state.mode is mode:
            return state
        was_available = _available(state)
        state.mode = mode
        if mode is WorkerMode.ASLEEP:
            # Its engine drops its KV to sleep: the index forgets it now rather than on the
            # engine's AllBlocksCleared (which may never come if the engine sleeps at once).
            await self._admission.reset_worker_kv(name)
        if _available(state) != was_available:
            await self._admission.set_worker_health(name, _available(state))
        self._log.info("worker mode", worker=name, mode=mode.value,
                       calls_in_flight=self._admission.calls_on(name))
        return state

    def _state(self, name: str) -> WorkerState:
        state = self.states.get(name)
        if state is None:
            raise MembershipError(f"no worker named {name!r}", status=404)
        return state

    # -- capacity ----------------------------------------------------------------------

    def _registered(self, state: WorkerState) -> bool:
        """Whether ``state`` is still its worker's (not removed, nor replaced by a worker
        added again under the same name)."""
        return self.states.get(state.name) is state

    async def learn_capacity(self, state: WorkerState) -> None:
        """Probe the worker's ``/metrics`` every ``capacity_retry_s`` until its capacity is
        known, or until the worker has left."""
        while state.capacity_tokens is None:
            if not self._registered(state):
                # The fleet stops a worker's tasks before it leaves; a probe loop that gets
                # here was not stopped, and ends rather than probe a pool without its worker.
                self._log.warning("capacity probe of a removed worker ended", worker=state.name)
                return
            try:
                if await self.probe_capacity(state):
                    return
            except Exception:
                self._log.exception("capacity probe failed", worker=state.name)
            await anyio.sleep(self._config.capacity_retry_s)

    async def probe_capacity(self, state: WorkerState) -> bool:
        client = self._pool.client(state.name)
        try:
            response = await client.get("/metrics", timeout=HEALTH_TIMEOUT_CAP_S)
            response.raise_for_status()
            capacity = capacity_from_metrics(response.text)
        except (httpx.HTTPError, CapacityUnknown) as err:
            shortage = local_shortage(err)
            if shortage is not None:
                self._note_local_shortage(state, "capacity probe", shortage)
                return False
            self._local_shortage_over(state)
            problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            if problem != state.capacity_error:
                self._log.warning("worker capacity unknown; retrying", worker=state.name,
                                  problem=problem, retry_s=self._config.capacity_retry_s)
            state.capacity_error = problem
            return False
        self._local_shortage_over(state)
        await self._admission.set_capacity(state.name, capacity)
        state.capacity_tokens, state.capacity_source, state.capacity_error = capacity, "metrics", None
        self._log.info("worker capacity known", worker=state.name, capacity_tokens=capacity)
        return True

    # -- the gateway's own shortages ---------------------------------------------------

    def _note_local_shortage(self, state: WorkerState, check: str, shortage: OSError) -> None:
        """``check`` of ``state``'s worker was not made for want of the gateway's own
        resources: counted, and logged at the start of each spell (with every worker's
        checks failing alike, one line each per check would flood the log)."""
        problem = describe_shortage(shortage)
        state.local_shortages += 1
        if state.local_shortage is None:
            self._log.warning("check not made: the gateway is out of local resources; "
                              "not counted against the worker", worker=state.name, check=check,
                              problem=problem)
        state.local_shortage = problem

    def _local_shortage_over(self, state: WorkerState) -> None:
        """A check of ``state``'s worker was made again: a spell of shortage is over."""
        if state.local_shortage is not None:
            self._log.info("checks made again: the gateway has its local resources back",
                           worker=state.name, missed=state.local_shortages)
            state.local_shortage = None

    # -- health ------------------------------------------------------------------------

    async def watch_health(self, state: WorkerState, first_check_after_s: float = 0.0) -> None:
        """Check the worker's ``/health`` every ``health_interval_s`` until cancelled (or
        until the worker has left); a check that fails in itself (not the worker) is logged
        and the next one goes ahead."""
        await anyio.sleep(first_check_after_s)
        while self._registered(state):
            try:
                await self.check_health(state)
            except Exception:
                self._log.exception("health check failed", worker=state.name)
            await anyio.sleep(self._config.health_interval_s)
        # as in learn_capacity: the fleet should have stopped this loop when the worker left
        self._log.warning("health checks of a removed worker ended", worker=state.name)

    async def mark_unreachable(self, worker: str, problem: str) -> None:
        """A call found the worker refusing connections: take it out now rather than after
        ``unhealthy_after`` failed checks (calls keep arriving meanwhile). The health loop
        brings it back once ``/health`` answers again."""
        state = self.states.get(worker)
        if state is None:
            return  # removed since the call was refused: nothing left to take out
        state.failures = max(state.failures, self._config.unhealthy_after)
        state.last_error = problem
        if not state.healthy:
            return
        state.healthy = False
        if state.mode is WorkerMode.SERVING:
            await self._admission.set_worker_health(worker, False)
        self._log.warning("worker unreachable; taken out at once, its programs re-homed",
                          worker=worker, problem=problem)

    async def check_health(self, state: WorkerState) -> None:
        client = self._pool.client(state.name)
        timeout = min(self._config.health_interval_s, HEALTH_TIMEOUT_CAP_S)
        problem: str | None = None
        shortage: OSError | None = None
        try:
            response = await client.get("/health", timeout=timeout)
            if response.status_code != 200:
                problem = f"/health answered {response.status_code}"
        except httpx.HTTPError as err:
            problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            shortage = local_shortage(err)
        if not self._registered(state):
            return  # removed while its check ran
        if shortage is not None:
            # The gateway could not make the check (say EMFILE): it says nothing of the
            # worker, whose health stays as the last check made found it.
            self._note_local_shortage(state, "health check", shortage)
            return
        self._local_shortage_over(state)
        state.last_check_unix = self._wall()
        serving = state.mode is WorkerMode.SERVING  # else the policy has it out already
        if problem is None:
            state.failures = 0
            state.last_error = None
            if not state.healthy:
                state.healthy = True
                if serving:
                    await self._admission.set_worker_health(state.name, True)
                self._log.info("worker healthy again", worker=state.name)
            return
        state.failures += 1
        state.last_error = problem
        if state.healthy and state.failures >= self._config.unhealthy_after:
            state.healthy = False
            if serving:
                await self._admission.set_worker_health(state.name, False)
            self._log.warning("worker unhealthy; its programs are re-homed", worker=state.name,
                              problem=problem, failures=state.failures)


def _available(state: WorkerState) -> bool:
    return state.healthy and state.mode is WorkerMode.SERVING
