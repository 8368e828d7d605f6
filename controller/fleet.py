"""The fleet: one record per worker, added and removed as one operation each
(architecture.md §5.5, "Membership").

Each mechanism keeps its own table of workers and has a per-worker add and remove:

=============================  ============================  ===================================
table                          add                           remove
=============================  ============================  ===================================
health, mode, capacity         ``WorkerRegistry.add``        ``.remove``
HTTP connections               ``UpstreamPool.add``          ``.remove`` (closes them)
directive socket               ``DirectiveSink.add`` (a      ``.remove`` (closes it)
                               PUSH socket when the worker
                               has ``directives``)
KV-event source                ``KvEventSubscriber.add``     ``.remove`` (queue and stats)
                               (its own SUB, or the bound
                               socket of ``kv_events_bind``)
per-worker metrics             (made at the first call)      ``Metrics.forget_worker``
policy's ledger and index      ``Admission.add_worker``      ``.remove_worker``
=============================  ============================  ===================================

:meth:`WorkerRecord.open` is the one place that calls them: it enters the worker in each
table in turn, then starts the worker's tasks (its health checks, its capacity probe while
the capacity is unknown, its KV-event applier and reader) under one cancel scope of their
own. Opening keeps the undoing of each step as it goes, and :meth:`WorkerRecord.close` runs
exactly that in reverse: the tasks are stopped, and waited for, first, so nothing of the
worker runs while it leaves the policy (no KV batch can bring its index back), then its
stats, sockets and connections go.

**Invariants** (cited where kept):

1. A worker is in every table or in none: a failure half-way through opening undoes the
   steps done (:meth:`WorkerRecord.open`), and closing runs every step even when one fails.
2. Nothing of a worker runs while it leaves the policy: its tasks have ended before
   ``Admission.remove_worker`` (:meth:`WorkerRecord.close`).
3. Only a worker with no call in flight leaves, and membership changes run one at a time
   (:meth:`Fleet.remove`).

**Why the tables stay.** The record is the worker's one handle (its config, its state and
how to close it), but each mechanism keeps its own table by name: each is read on that
mechanism's own path (the relay's connections on every call, the directive socket under the
admission lock, the KV source by topic on every frame), each holds a different set (a
socket only for a worker with ``directives``, a KV source only for one that has events, an
index key per data-parallel rank, metrics series only once a call ran), and the ledger is
the core's, which holds no shell state. One shared record would make every mechanism depend
on the fleet that composes them; the fleet's one add and one remove keep them in step
instead.

:class:`Fleet` holds the records. The configured workers are opened when the gateway starts,
before it serves a call; others are added and removed at run time through the admin API
(``/sluice/workers``), and a worker added live is wired exactly like a configured one. The
membership changes (add, drain, sleep, wake, remove) run one at a time. A removed worker
can be added again under the same name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from controller.admission import Admission, DirectiveSink
from controller.errors import describe_shortage, local_shortage
from controller.metrics import Metrics
from controller.serve_config import ServeConfig, WorkerConfig
from controller.worker_urls import WorkerUrlRefused, shown
from controller.subscriber import KvEventSubscriber
from controller.upstream import UpstreamPool
from controller.workers import MembershipError, WorkerMode, WorkerRegistry, WorkerState
from scheduler.config import ConfigError
from sluice_vllm_plugin.zmq_auth import InsecureBindRefused


@dataclass(frozen=True, slots=True)
class WorkerTables:
    """The per-worker tables a worker is entered in (the table of the module docstring)."""

    registry: WorkerRegistry
    pool: UpstreamPool
    sink: DirectiveSink
    kv_events: KvEventSubscriber
    metrics: Metrics
    admission: Admission


class _WorkerTasks:
    """A worker's tasks under one cancel scope: :meth:`stop` cancels them and returns once
    they have all ended."""

    def __init__(self, worker: str) -> None:
        self._worker = worker
        self._scope = anyio.CancelScope()
        self._ended = anyio.Event()

    async def run(self, tasks: list[tuple[str, Callable[..., Awaitable[Any]], tuple[Any, ...]]],
                  *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    for what, func, args in tasks:
                        # named for the worker: one that outlived it would show in a task dump
                        tg.start_soon(func, *args, name=f"{what} of {self._worker}")
                    task_status.started()
        finally:
            self._ended.set()

    async def stop(self) -> None:
        self._scope.cancel()
        await self._ended.wait()


class WorkerRecord:
    """One worker of the fleet: its config and state, and what closes everything opened for it."""

    def __init__(self, config: WorkerConfig, state: WorkerState, wiring: dict[str, str | None],
                 undo: AsyncExitStack) -> None:
        self.config = config
        self.state = state
        # where its KV events come from and its directives go (None: nowhere), as listed
        # by the admin API
        self.wiring = wiring
        self._undo = undo

    @property
    def name(self) -> str:
        return self.config.name

    @classmethod
    async def open(cls, config: WorkerConfig, tables: WorkerTables, tasks: anyio.abc.TaskGroup,
                   *, first_health_check: bool, health_interval_s: float) -> WorkerRecord:
        """Enter ``config``'s worker in every table and start its tasks in ``tasks``. With
        ``first_health_check`` its health is checked once before this returns (a worker
        added at run time is answered with it), the next check an interval later."""
        name = config.name
        # each step pushes its undoing; a failure unwinds the steps done (invariant 1)
        async with AsyncExitStack() as undo:
            state = tables.registry.add(config)
            undo.callback(tables.registry.remove, name)
            tables.pool.add(config)
            undo.push_async_callback(tables.pool.remove, name)
            tables.sink.add(config)
            undo.callback(tables.sink.remove, name)
            kv_source = tables.kv_events.add(config)
            undo.callback(tables.kv_events.remove, name)
            undo.callback(tables.metrics.forget_worker, name)
            await tables.admission.add_worker(name, config.capacity_tokens)
            undo.push_async_callback(tables.admission.remove_worker, name)
            if first_health_check:
                await tables.registry.check_health(state)
            worker_tasks = _WorkerTasks(name)
            to_run: list[tuple[str, Callable[..., Awaitable[Any]], tuple[Any, ...]]] = [
                ("health checks", tables.registry.watch_health,
                 (state, health_interval_s if first_health_check else 0.0))]
            if state.capacity_tokens is None:
                to_run.append(("capacity probe", tables.registry.learn_capacity, (state,)))
            if kv_source is not None:
                to_run.append(("KV events", tables.kv_events.run_source, (kv_source,)))
            await tasks.start(worker_tasks.run, to_run, name=f"tasks of {name}")
            undo.push_async_callback(worker_tasks.stop)  # runs first on close (invariant 2)
            wiring = {
                "kv_events": None if kv_source is None
                else kv_source.worker.kv_events or "kv_events_bind",
                "directives": config.directives,
            }
            return cls(config, state, wiring, undo.pop_all())

    async def close(self) -> None:
        """Undo :meth:`open`, last step first: the tasks stop (and are waited for), the
        policy forgets the worker, then its metrics, KV-event source, directive socket,
        connections and state go."""
        await self._undo.aclose()


class Fleet:
    """The records of every worker; the one way a worker joins or leaves."""

    def __init__(self, config: ServeConfig, tables: WorkerTables, log: Any) -> None:
        self._config = config
        self.tables = tables
        self._log = log
        self.records: dict[str, WorkerRecord] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._membership = anyio.Lock()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Open the configured workers (started once they are all wired), then run every
        worker's tasks, and the bound KV-event socket's reader, until cancelled."""
        try:
            # every configured worker checked before any is opened, every problem told
            problems = []
            for index, worker in enumerate(self._config.workers):
                try:
                    await self._check_admissible(worker)
                except (WorkerUrlRefused, ConfigError) as err:
                    problems.append(_keyed(f"workers.{index}", err))
            if problems:
                raise ConfigError("\n".join(problems))
            async with anyio.create_task_group() as tg:
                self._tasks = tg
                async with self._membership:
                    for worker in self._config.workers:
                        await self._open(worker, first_health_check=False)
                # after them, so that no frame of theirs counts as one of an unknown worker
                tg.start_soon(self.tables.kv_events.run, name="KV-event bound reader")
                task_status.started()
                # Held open until cancelled: the group must outlive its tasks, or removing
                # the last worker (with no bound KV socket, whose reader returns at once)
                # would end it, and no worker could join again.
                await anyio.sleep_forever()
        finally:
            self._tasks = None

    async def add(self, worker: WorkerConfig) -> WorkerRecord:
        """Add a worker at run time, wired as a configured one is; MembershipError (400)
        when it is not admissible (:meth:`_check_admissible`: its URL or a ZMQ endpoint, a
        bound ``kv_events``, its API key), (409) when the name is taken, (503) when the
        gateway is out of descriptors or memory."""
        try:
            # before the membership lock: resolving its host may take a while
            await self._check_admissible(worker)
        except (WorkerUrlRefused, ConfigError) as err:
            self._log.warning("worker not added", worker=worker.name, url=shown(worker.url),
                              problem=str(err))
            raise MembershipError(_keyed("worker", err), status=400) from None
        async with self._membership:
            if worker.name in self.records:
                raise MembershipError(f"a worker named {worker.name!r} exists already")
            try:
                record = await self._open(worker, first_health_check=True)
            except OSError as err:
                # Opening makes sockets and clients (and the HTTP client loads its CA file):
                # the gateway's own shortage stops it, which says nothing of the worker.
                # Opening has undone its steps (invariant 1).
                shortage = local_shortage(err)
                if shortage is None:
                    raise
                problem = describe_shortage(shortage)
                self._log.warning("worker not added: the gateway is out of local resources",
                                  worker=worker.name, url=worker.url, problem=problem)
                raise MembershipError(
                    f"worker {worker.name!r} not added: the gateway is out of local resources "
                    f"({problem}); retry shortly", status=503) from err
        self._log.info("worker added", worker=worker.name, url=worker.url,
                       capacity_tokens=worker.capacity_tokens, healthy=record.state.healthy,
                       **record.wiring)
        return record

    async def set_mode(self, name: str, mode: WorkerMode) -> WorkerState:
        """Drain, put to sleep or wake a worker (:meth:`WorkerRegistry.set_mode`)."""
        async with self._membership:
            return await self.tables.registry.set_mode(name, mode)

    async def remove(self, name: str) -> None:
        """Remove a drained (or sleeping) worker with no call in flight: nothing of it is
        left running or open."""
        async with self._membership:
            record = self.records.get(name)
            if record is None:
                raise MembershipError(f"no worker named {name!r}", status=404)
            if record.state.mode is WorkerMode.SERVING:
                raise MembershipError(f"worker {name!r} is serving: drain it first")
            in_flight = self.tables.admission.calls_on(name)
            if in_flight:  # invariant 3
                raise MembershipError(f"worker {name!r} still has {in_flight} call(s) in flight; "
                                      "remove it once they finish")
            # out of the listing first: the policy forgets it half-way through closing
            # (close runs every step even when one fails; the failure propagates)
            del self.records[name]
            await record.close()
        self._log.info("worker removed", worker=name)

    async def aclose(self) -> None:
        """At shutdown, once :meth:`run` has ended: close every worker's connections and
        sockets at once (the policy goes with the process)."""
        await self.tables.pool.aclose()
        await self.tables.sink.aclose()
        await self.tables.kv_events.aclose()

    async def _check_admissible(self, worker: WorkerConfig) -> None:
        """Refuse a worker the gateway must not talk to, before any connection to it: its
        URL outside ``worker_urls`` (:class:`WorkerUrlRefused`; a host name is resolved and
        every address checked, controller/worker_urls.py), a ZMQ endpoint it connects to
        outside them, a ``kv_events`` it binds beyond loopback without keys, or its API key
        unreadable (each a :class:`ConfigError` naming its key: ``replay``, ``kv_events``,
        ``api_key_env`` ...). Also for configured workers: the admin API's entry was
        validated alone, without the config's ``allow_insecure_bind`` and ``worker_urls``."""
        allow = self._config.worker_urls.allow_list()
        timeout_s = self._config.upstream.connect_timeout_s
        await allow.check_addresses(worker.url, timeout_s)
        for key, endpoint in worker.connected_endpoints().items():
            try:
                await allow.check_endpoint_addresses(endpoint, timeout_s)
            except WorkerUrlRefused as err:
                raise ConfigError(f"{key}: {err}") from None
        try:
            self._config.check_kv_events_bind(worker)
        except InsecureBindRefused as err:  # its message starts with "kv_events: "
            raise ConfigError(str(err)) from None
        worker.api_key()

    async def _open(self, worker: WorkerConfig, *, first_health_check: bool) -> WorkerRecord:
        if self._tasks is None:
            raise MembershipError("the gateway is not running: no worker can join", status=503)
        record = self.records[worker.name] = await WorkerRecord.open(
            worker, self.tables, self._tasks, first_health_check=first_health_check,
            health_interval_s=self._config.health_interval_s)
        return record


def _keyed(prefix: str, err: WorkerUrlRefused | ConfigError) -> str:
    """``err`` named by its key under ``prefix`` (``workers.1.url: ...``, ``worker.api_key_env:
    ...``): a URL refusal is the ``url``'s; a key's ConfigError starts with its own key."""
    if isinstance(err, WorkerUrlRefused):
        return f"{prefix}.url: {err}"
    return f"{prefix}.{err}"
