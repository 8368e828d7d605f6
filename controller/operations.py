"""What an operator sees and touches: metrics, the admin API, request records, hot reload.

- :class:`Metrics`: Prometheus metrics on the app's own :class:`CollectorRegistry`. Program
  counts by state, the policy's counters (pauses, resumes, marks, forced resumes, holds, …),
  per-worker utilization and the KV index's eviction counters (evicted tokens, unknown and
  attributed removals) are read from the policy when scraped, so they cannot drift from it;
  hold time, upstream latency and requests are recorded as calls end.
- :class:`AdminApi`: ``GET /sluice/programs``, ``GET /sluice/workers``, ``GET /sluice/config``,
  ``POST /sluice/programs/{id}/release``, ``POST /sluice/reload``, and membership:
  ``POST /sluice/workers`` (a worker entry as in the config's ``workers:``, KV events and
  directives included), ``POST /sluice/workers/{name}/drain|sleep|wake``,
  ``DELETE /sluice/workers/{name}``, carried out by the fleet (controller/fleet.py); all
  behind ``Authorization: Bearer <admin_token>`` (401 without it or with a wrong one; 403
  when no token is configured at all).
- :class:`RequestLog`: one ``dynamo.request.trace.v1`` ``request_end`` record per completed
  call, appended as JSONL (opt-in: ``request_log``).
- :class:`ConfigReloader`: re-reads the YAML file when its mtime changes (polled every
  ``reload_poll_s``), on SIGHUP, or on ``POST /sluice/reload``; a valid file's ``policy:``
  thresholds go to ``policy.reconfigure``; a bad file keeps the old config and logs why.
  Other sections need a restart, and a reload that changes them says so in the log.
"""

from __future__ import annotations

import hmac
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controller.admission import Admission
from controller.errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, PERMISSION, error_response
from controller.serve_config import ServeConfig, WorkerConfig, load_serve_config
from controller.fleet import Fleet
from controller.subscriber import KvEventSubscriber
from controller.workers import MembershipError, WorkerMode
from scheduler.config import ConfigError, format_validation_errors
from scheduler.snapshot import WorkerView
from scheduler.programs import Lifecycle, Phase

HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TRACE_SCHEMA = "dynamo.request.trace.v1"


class _PolicyCollector(Collector):
    """Reads program states, policy counters and worker load at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Any]:
        snapshot = self._admission.snapshot()
        programs = GaugeMetricFamily(
            "sluice_programs", "Programs by lifecycle and phase.", labels=["lifecycle", "phase"]
        )
        counts = {(lc.value, ph.value): 0 for lc in Lifecycle for ph in Phase}
        for program in snapshot.programs:
            counts[(program.lifecycle, program.phase)] += 1
        for (lifecycle, phase), n in counts.items():
            programs.add_metric([lifecycle, phase], n)
        yield programs
        stats = snapshot.stats
        for name, key, text in (
            ("sluice_pauses", "pauses", "Programs paused by the policy."),
            ("sluice_resumes", "resumes", "Paused programs resumed."),
            ("sluice_forced_resumes", "forced_resumes", "Programs resumed by force_resume_after_s."),
            ("sluice_marks", "marks", "Programs marked to pause at their next tool boundary."),
            ("sluice_holds", "held", "Calls held on arrival."),
            ("sluice_admissions", "admitted", "Calls dispatched to a worker."),
            ("sluice_releases", "releases", "Programs released (final, idle or operator)."),
            ("sluice_wait_limit_resumes", "wait_limit_resumes",
             "Programs resumed because a call of theirs was held max_wait_s."),
            ("sluice_dormant", "dormant",
             "Programs found long in a tool call (their KV stopped counting in U)."),
        ):
            yield CounterMetricFamily(name, text, value=stats[key])
        adaptive = GaugeMetricFamily(
            "sluice_policy_adaptive",
            "Settings the policy learns online, by name (dormancy_cutoff_s: seconds in a tool "
            "call after which a program counts as dormant).", labels=["setting"])
        for setting, value in sorted(snapshot.adaptive.items()):
            adaptive.add_metric([setting], value)
        yield adaptive
        yield GaugeMetricFamily("sluice_calls_held", "Calls waiting in the gateway now.",
                                value=self._admission.held)
        refusals = CounterMetricFamily(
            "sluice_limit_refusals", "Calls refused by a bound of limits: (429 or 503 with "
            "Retry-After), by limit.", labels=["limit"])
        for limit, n in sorted(self._admission.refusals.items()):
            refusals.add_metric([limit], n)
        yield refusals
        core_errors = CounterMetricFamily(
            "sluice_core_errors", "Exceptions raised by the scheduling policy, by operation "
            "(on_arrival, on_complete, on_abort, tick); each fails at most its own call.",
            labels=["operation"])
        for operation in ("on_arrival", "on_complete", "on_abort", "tick"):
            core_errors.add_metric([operation], self._admission.core_errors.get(operation, 0))
        yield core_errors
        util = GaugeMetricFamily("sluice_worker_utilization",
                                 "U of each worker (the policy's ledger); absent while its capacity is unknown.",
                                 labels=["worker"])
        healthy = GaugeMetricFamily("sluice_worker_healthy", "1 when the worker passes health checks.",
                                    labels=["worker"])
        capacity = GaugeMetricFamily("sluice_worker_capacity_tokens", "KV capacity of the worker in tokens.",
                                     labels=["worker"])
        placed = GaugeMetricFamily("sluice_worker_programs", "Active programs counted on the worker.",
                                   labels=["worker"])
        # -- KV-event subscriber: which source the ledger's shared tokens come from --
        source = GaugeMetricFamily(
            "sluice_worker_utilization_source",
            "1 when U uses the worker's KV index (its events flow), 0 when it is the usage-based "
            "estimate (continuation ancestry) because the worker has no events (yet, or since a reset).",
            labels=["worker"])
        for worker in snapshot.workers:
            if worker.utilization is not None:
                util.add_metric([worker.name], worker.utilization)
            healthy.add_metric([worker.name], 1.0 if worker.healthy else 0.0)
            if worker.capacity_tokens:
                capacity.add_metric([worker.name], worker.capacity_tokens)
            placed.add_metric([worker.name], worker.programs)
            source.add_metric([worker.name], 1.0 if worker.kv_events else 0.0)
        yield from (util, healthy, capacity, placed, source)
        yield from _kv_index_families(snapshot.workers)
        sink = self._admission.sink
        directives = CounterMetricFamily(
            "sluice_directives_sent", "Retention directives the policy issued, by kind.", labels=["kind"])
        for kind, n in sink.sent.items():
            directives.add_metric([kind], n)
        dropped = CounterMetricFamily(
            "sluice_directives_dropped", "Directives not queued to a worker's engine plugin (its "
            "queue full): hints lost, never correctness.", labels=["worker"])
        for worker, n in sink.dropped.items():
            dropped.add_metric([worker], n)
        yield from (directives, dropped)


def _kv_index_families(workers: Iterable[WorkerView]) -> Iterator[Any]:
    """Eviction counters of the policy's KV index (scheduler/kv_index.py), per worker."""
    evicted = CounterMetricFamily(
        "sluice_kv_evicted_tokens",
        "Tokens of blocks the engine evicted that the KV index held (an evicted hash it never "
        "held adds no tokens).", labels=["worker"])
    unknown = CounterMetricFamily(
        "sluice_kv_unknown_removals",
        "Evicted hashes the KV index did not hold (stored before it subscribed, a lost batch, "
        "or the last copy of a hash it dropped when an earlier copy went).", labels=["worker"])
    attributed = CounterMetricFamily(
        "sluice_kv_attributed_removals",
        "Evicted hashes the engine plugin attributed to the continuation that admitted them.",
        labels=["worker"])
    for worker in workers:
        evicted.add_metric([worker.name], worker.evicted_tokens)
        unknown.add_metric([worker.name], worker.unknown_removals)
        attributed.add_metric([worker.name], worker.attributed_removals)
    yield from (evicted, unknown, attributed)


class _KvEventsCollector(Collector):
    """The KV-event subscriber's counters (controller/subscriber.py), read at scrape time."""

    def __init__(self, subscriber: KvEventSubscriber) -> None:
        self._subscriber = subscriber

    def collect(self) -> Iterator[Any]:
        sub = self._subscriber
        counters = {
            "received": CounterMetricFamily(
                "sluice_kv_batches_received", "KV-event batches read off the sockets.", labels=["worker"]),
            "applied": CounterMetricFamily(
                "sluice_kv_batches_applied", "KV-event batches applied to the index (replayed ones included).",
                labels=["worker"]),
            "replayed": CounterMetricFamily(
                "sluice_kv_batches_replayed", "KV-event batches applied from a replay socket.", labels=["worker"]),
            "dropped": CounterMetricFamily(
                "sluice_kv_batches_dropped", "KV-event batches dropped because the worker's queue was full "
                "(then repaired from replay, or counted as a reset).", labels=["worker"]),
            "gaps_repaired": CounterMetricFamily(
                "sluice_kv_gaps_repaired", "Seq gaps filled completely from the replay socket.", labels=["worker"]),
            "events_skipped": CounterMetricFamily(
                "sluice_kv_events_skipped", "KV events of a type this Sluice does not know (a newer "
                "engine's), skipped; the rest of their batches applied.", labels=["worker"]),
        }
        resets = CounterMetricFamily("sluice_kv_index_resets",
                                     "Worker KV-index resets by reason (restart, unrepairable gap, ...).",
                                     labels=["worker", "reason"])
        last_seq = GaugeMetricFamily("sluice_kv_last_seq", "Seq of the last KV-event batch applied.",
                                     labels=["worker", "rank"])
        for worker, stats in sub.stats.items():
            for name, family in counters.items():
                family.add_metric([worker], getattr(stats, name))
            for reason, n in stats.resets.items():
                resets.add_metric([worker, reason], n)
            for rank, seq in stats.last_seq.items():
                last_seq.add_metric([worker, str(rank)], seq)
        yield from counters.values()
        yield resets
        yield last_seq
        queued = GaugeMetricFamily("sluice_kv_queue_batches", "KV-event batches waiting to be applied.",
                                   labels=["worker"])
        for worker, depth in sub.queue_depths().items():
            queued.add_metric([worker], depth)
        yield queued
        ignored = CounterMetricFamily("sluice_kv_messages_ignored",
                                      "KV-event messages ignored: malformed, or on the bound socket for no worker it feeds.",
                                      labels=["reason"])
        for reason, n in sub.ignored.items():
            ignored.add_metric([reason], n)
        yield ignored


class Metrics:
    def __init__(self, admission: Admission) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PolicyCollector(admission))
        self.hold_seconds = Histogram(
            "sluice_hold_seconds", "Time a call was held by Sluice before it went upstream.",
            buckets=HOLD_BUCKETS, registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "sluice_upstream_latency_seconds",
            "Time from sending a call upstream to its last byte.",
            ["worker", "stream"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "sluice_upstream_ttfb_seconds", "Time from sending a call upstream to its first byte.",
            ["worker"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "sluice_requests", "Calls answered, by route and status.", ["route", "status"],
            registry=self.registry,
        )
        # From the usage of each completed call: the fleet's prefix-cache hit rate is
        # rate(cached) / rate(prompt).
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of completed calls, by worker.", ["worker"],
            registry=self.registry)
        self.cached_tokens = Counter(
            "sluice_cached_tokens", "Prompt tokens served from the prefix cache (usage "
            "cached_tokens), by worker.", ["worker"], registry=self.registry)
        self.completion_tokens = Counter(
            "sluice_completion_tokens", "Output tokens of completed calls, by worker.", ["worker"],
            registry=self.registry)
        self.reloads = Counter(
            "sluice_config_reloads", "Config reloads by result.", ["result"], registry=self.registry,
        )
        self.up = Gauge("sluice_up", "1 while the gateway serves.", registry=self.registry)
        self.up.set(1)
        self._request_counters: dict[tuple[str, int], Any] = {}
        self._upstream_histograms: dict[tuple[str, bool], tuple[Any, Any]] = {}
        self._usage_counters: dict[str, tuple[Any, Any, Any]] = {}

    # Per call, on the relay's hot path: each labelled child is looked up once and kept
    # (prometheus_client's labels() costs a lock and a hash of the label values every time).

    def count_request(self, route: str, status: int) -> None:
        """``sluice_requests{route, status}`` + 1."""
        key = (route, status)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._request_counters[key] = self.requests.labels(route, str(status))
        counter.inc()

    def observe_upstream(self, worker: str, stream: bool, total_s: float,
                         first_byte_s: float | None) -> None:
        """The upstream latency histograms: to the last byte, and to the first."""
        key = (worker, stream)
        children = self._upstream_histograms.get(key)
        if children is None:
            children = self._upstream_histograms[key] = (
                self.upstream_seconds.labels(worker, "true" if stream else "false"),
                self.ttft_seconds.labels(worker))
        children[0].observe(total_s)
        if first_byte_s is not None:
            children[1].observe(first_byte_s)

    def count_usage(self, worker: str, prompt_tokens: int, cached_tokens: int,
                    completion_tokens: int) -> None:
        children = self._usage_counters.get(worker)
        if children is None:
            children = self._usage_counters[worker] = (
                self.prompt_tokens.labels(worker), self.cached_tokens.labels(worker),
                self.completion_tokens.labels(worker))
        children[0].inc(prompt_tokens)
        children[1].inc(cached_tokens)
        children[2].inc(completion_tokens)

    def forget_worker(self, worker: str) -> None:
        """Drop a worker's upstream latency and usage series (it left the fleet; the
        policy's and the KV-event subscriber's series go with their own tables)."""
        for stream in (True, False):
            self._upstream_histograms.pop((worker, stream), None)
            self.upstream_seconds.remove(worker, "true" if stream else "false")
        self.ttft_seconds.remove(worker)
        self._usage_counters.pop(worker, None)
        for counter in (self.prompt_tokens, self.cached_tokens, self.completion_tokens):
            counter.remove(worker)

    def watch_kv_events(self, subscriber: KvEventSubscriber) -> None:
        """Export the KV-event subscriber's counters (controller/subscriber.py)."""
        self.registry.register(_KvEventsCollector(subscriber))

    def render(self) -> Response:
        return Response(generate_latest(self.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


class RequestLog:
    """JSONL ``request_end`` records (Dynamo's request trace schema, v1)."""

    def __init__(self, path: Path | None, log: Any) -> None:
        self.path = path
        self._log = log
        self._file: IO[bytes] | None = None
        self._encode = msgspec.json.Encoder().encode

    def open(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(self._encode(record) + b"\n")
            self._file.flush()
        except OSError as err:
            self._log.error("cannot write request record", path=str(self.path), problem=str(err))


def request_end_record(*, request_id: str, session_id: str | None, parent_session_id: str | None,
                       model: str | None, input_tokens: int, output_tokens: int,
                       cached_tokens: int, received_unix_s: float, total_s: float,
                       ttft_s: float | None, queue_s: float, now_unix_s: float,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "schema": TRACE_SCHEMA,
        "event_type": "request_end",
        "event_time_unix_ms": int(now_unix_s * 1000),
        "event_source": "sluice",
        "agent_context": {"session_id": session_id, "parent_session_id": parent_session_id},
        "request": {
            "request_id": request_id,
            "model": model,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cached_tokens": cached_tokens,
            "request_received_ms": int(received_unix_s * 1000),
            "total_time_ms": round(total_s * 1000, 3),
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
            "queue_time_ms": round(queue_s * 1000, 3),
        },
    }
    if extra:
        record["sluice"] = extra
    return record


# -- hot reload ------------------------------------------------------------------------------


class ConfigReloader:
    def __init__(self, config: ServeConfig, admission: Admission, metrics: Metrics, log: Any,
                 wall_clock: Callable[[], float]) -> None:
        self.config = config
        self.path = config.path
        self._admission = admission
        self._metrics = metrics
        self._log = log
        self._wall = wall_clock
        self._stamp = self._file_stamp()
        # What the file said last: a reload reports the keys it changed that need a restart
        # (compared with the file, not with command-line overrides such as --port).
        self._file_config = config
        if self.path is not None:
            try:
                self._file_config = load_serve_config(self.path)
            except ConfigError:
                pass  # changed since it was loaded; compare with what runs
        self._lock = anyio.Lock()
        self.status: dict[str, Any] = {"ok": None, "at_unix": None, "error": None, "trigger": None}

    def _file_stamp(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    async def run(self) -> None:
        if self.path is None:
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_sighup)
            if self.config.reload_poll_s > 0:
                tg.start_soon(self._poll)

    async def _poll(self) -> None:
        while True:
            await anyio.sleep(self.config.reload_poll_s)
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                try:
                    await self.reload("file changed")
                except Exception:
                    self._log.exception("config reload failed", path=str(self.path))

    async def _watch_sighup(self) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGHUP)
            signals = receiver.__enter__()
        except (ValueError, RuntimeError, NotImplementedError) as err:
            # Signal handlers can only be installed from the main thread (not the case when
            # the app runs inside a test's server thread); file polling still works.
            self._log.info("SIGHUP reload unavailable", problem=str(err))
            return
        try:
            async for _ in signals:
                try:
                    await self.reload("SIGHUP")
                except Exception:
                    self._log.exception("config reload failed", path=str(self.path))
        finally:
            receiver.__exit__(None, None, None)

    async def reload(self, trigger: str) -> bool:
        """Apply the file's policy thresholds; False (old config kept, reason logged) when
        the file is unusable or changes the policy kind."""
        async with self._lock:
            assert self.path is not None
            self._stamp = self._file_stamp()
            self.status.update(at_unix=self._wall(), trigger=trigger)
            try:
                new = load_serve_config(self.path)
                if new.policy != self.config.policy:
                    await self._admission.reconfigure(new.policy)
            except (ConfigError, ValueError) as err:
                self.status.update(ok=False, error=str(err))
                self._metrics.reloads.labels("rejected").inc()
                self._log.error("config reload rejected; keeping the old config",
                                path=str(self.path), trigger=trigger, problem=str(err))
                return False
            restart = sorted(
                key for key in type(new).model_fields
                if key != "policy" and getattr(new, key) != getattr(self._file_config, key)
            )
            if restart:
                self._log.warning("config keys changed that only a restart applies",
                                  keys=restart, path=str(self.path))
            changed = new.policy != self.config.policy
            self._file_config = new
            self.config = self.config.model_copy(update={"policy": new.policy})
            self.status.update(ok=True, error=None)
            self._metrics.reloads.labels("applied").inc()
            self._log.info("config reloaded", path=str(self.path), trigger=trigger,
                           policy_changed=changed)
            return True


# -- admin API -------------------------------------------------------------------------------


class AdminApi:
    def __init__(self, token: str | None, admission: Admission, fleet: Fleet,
                 reloader: ConfigReloader, clock: Callable[[], float]) -> None:
        self._token = token.encode() if token else None
        self._admission = admission
        self._fleet = fleet
        self._reloader = reloader
        self._clock = clock

    def routes(self) -> list[Route]:
        return [
            Route("/sluice/programs", self.programs, methods=["GET"]),
            Route("/sluice/programs/{session_id:path}/release", self.release, methods=["POST"]),
            Route("/sluice/workers", self.workers, methods=["GET"]),
            Route("/sluice/workers", self.add_worker, methods=["POST"]),
            Route("/sluice/workers/{name}", self.remove_worker, methods=["DELETE"]),
            Route("/sluice/workers/{name}/{action}", self.worker_action, methods=["POST"]),
            Route("/sluice/config", self.config, methods=["GET"]),
            Route("/sluice/reload", self.reload, methods=["POST"]),
        ]

    def _deny(self, request: Request) -> Response | None:
        if self._token is None:
            return error_response(403, "the admin API is off: set admin_token or the "
                                  "admin_token_env variable", PERMISSION)
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return error_response(401, "admin endpoints need Authorization: Bearer <admin token>",
                                  AUTHENTICATION, headers={"WWW-Authenticate": "Bearer"})
        return None

    async def programs(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        now = self._clock()
        items = [{
            "session_id": p.session_id,
            "parent_session_id": p.parent_session_id,
            "group_id": p.group_id,
            "lifecycle": p.lifecycle,
            "phase": p.phase,
            "marked": p.marked,
            "home_worker": p.home_worker,
            "context_tokens": p.context_tokens,
            "in_flight": p.in_flight,
            "waiting": p.waiting,
            "steps": p.steps,
            "age_s": round(now - p.created_at, 3),
            "idle_s": round(now - p.last_activity, 3),
        } for p in sorted(self._admission.snapshot().programs, key=lambda p: p.session_id)]
        return JSONResponse({"programs": items, "count": len(items)})

    async def workers(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        views = {w.name: w for w in self._admission.snapshot(with_programs=False).workers}
        items = []
        for record in self._fleet.records.values():
            state, view = record.state, views[record.name]
            items.append({
                "name": state.name,
                "url": state.url,
                "healthy": state.healthy,
                "capacity_tokens": state.capacity_tokens,
                "capacity_source": state.capacity_source,
                "capacity_error": state.capacity_error,
                "utilization": view.utilization,
                # KV-event subscriber: "kv_index" once the worker's events flow, else "estimate"
                "utilization_source": "kv_index" if view.kv_events else "estimate",
                "programs": view.programs,
                "last_error": state.last_error,
                "last_check_unix": state.last_check_unix,
                "mode": state.mode.value,
                "calls_in_flight": view.calls_in_flight,
                # how its engine orders its queue: "priority" gets the policy's priority
                "scheduling_policy": record.config.scheduling_policy,
                # its KV-event endpoint ("kv_events_bind": fed from the bound socket) and
                # directive endpoint; None: not wired
                **record.wiring,
            })
        return JSONResponse({"workers": items})

    # -- membership ------------------------------------------------------------------------

    async def add_worker(self, request: Request) -> Response:
        """``POST /sluice/workers`` with a worker entry as in the config's ``workers:``."""
        if (denied := self._deny(request)) is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the body must be a JSON worker entry: "
                                  '{"name": ..., "url": ..., "capacity_tokens": ...}', INVALID_REQUEST)
        try:
            worker = WorkerConfig.model_validate(body)
        except ValidationError as err:
            return error_response(400, format_validation_errors(err, "worker"), INVALID_REQUEST)
        try:
            record = await self._fleet.add(worker)
        except MembershipError as err:
            return error_response(err.status, str(err), INVALID_REQUEST)
        return JSONResponse({"name": record.name, "mode": record.state.mode.value,
                             "healthy": record.state.healthy, **record.wiring}, status_code=201)

    async def worker_action(self, request: Request) -> Response:
        """``POST /sluice/workers/{name}/drain|sleep|wake``."""
        if (denied := self._deny(request)) is not None:
            return denied
        name, action = request.path_params["name"], request.path_params["action"]
        modes = {"drain": WorkerMode.DRAINING, "sleep": WorkerMode.ASLEEP, "wake": WorkerMode.SERVING}
        if action not in modes:
            return error_response(404, f"no worker action {action!r}: drain, sleep or wake",
                                  NOT_FOUND)
        try:
            state = await self._fleet.set_mode(name, modes[action])
        except MembershipError as err:
            return error_response(err.status, str(err), NOT_FOUND if err.status == 404
                                  else INVALID_REQUEST)
        return JSONResponse({"name": name, "mode": state.mode.value,
                             "calls_in_flight": self._admission.calls_on(name)})

    async def remove_worker(self, request: Request) -> Response:
        """``DELETE /sluice/workers/{name}``: a drained or sleeping worker with nothing in flight."""
        if (denied := self._deny(request)) is not None:
            return denied
        name = request.path_params["name"]
        try:
            await self._fleet.remove(name)
        except MembershipError as err:
            return error_response(err.status, str(err), NOT_FOUND if err.status == 404
                                  else INVALID_REQUEST)
        return JSONResponse({"removed": name})

    async def config(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        return JSONResponse({
            "policy": self._admission.policy.config.model_dump(mode="json"),
            "path": str(self._reloader.path) if self._reloader.path else None,
            "reload": self._reloader.status,
        })

    async def release(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        session_id = request.path_params["session_id"]
        if not await self._admission.release(session_id, "operator"):
            return error_response(404, f"no program {session_id!r}", NOT_FOUND, param="session_id")
        return JSONResponse({"released": session_id})

    async def reload(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        if self._reloader.path is None:
            return error_response(404, "this gateway was not started from a config file", NOT_FOUND)
        ok = await self._reloader.reload("admin API")
        return JSONResponse({"reloaded": ok, **self._reloader.status}, status_code=200 if ok else 422)
