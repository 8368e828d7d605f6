"""The gateway's Prometheus metrics, on the app's own :class:`CollectorRegistry`
(``GET /metrics``).

Program counts by state, the policy's counters (pauses, resumes, marks, forced resumes,
holds, …), per-worker utilization and the KV index's eviction counters (evicted tokens,
unknown and attributed removals) are read from the policy when scraped
(:class:`_PolicyCollector`), and the KV-event subscriber's counters from the subscriber
(:class:`_KvEventsCollector`), so they cannot drift from what they count; hold time,
upstream latency, requests and token usage are recorded as calls end.

Under ``sluice serve --relays N`` (controller/relay_processes.py) calls end in the relay
processes: the series recorded as calls end live in prometheus_client's multiprocess files
(``PROMETHEUS_MULTIPROC_DIR``, set for every process of the gateway before it starts), and the
policy process's ``/metrics`` adds them up over all processes beside its own collectors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.responses import Response

from controller.admission import Admission
from controller.subscriber import KvEventSubscriber
from scheduler.programs import Lifecycle, Phase
from scheduler.snapshot import WorkerView

HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# What the listener (controller/server.py) refuses or cuts, by reason: 431, 408 (head, body),
# 503 past http.max_connections, and a client disconnected for not reading its answer.
EDGE_REFUSAL_REASONS = ("headers_too_large", "header_timeout", "body_timeout",
                        "connection_limit", "send_timeout")


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
            "undecodable": CounterMetricFamily(
                "sluice_kv_batches_undecodable", "KV-event batches that did not decode, dropped (only the "
                "replay's copy not decoding resets the index).", labels=["worker"]),
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
                                      "KV-event messages ignored: malformed, undecodable, or on the bound socket for no worker "
                                      "it feeds.",
                                      labels=["reason"])
        for reason, n in sub.ignored.items():
            ignored.add_metric([reason], n)
        yield ignored


class Metrics:
    """The app's metrics registry: the collectors read at scrape time, and the series the
    relay records as calls end."""

    def __init__(self, admission: Admission | None, multiprocess_dir: str | None = None) -> None:
        """``admission`` None: a relay process's, which records and never renders.
        ``multiprocess_dir``: the series are recorded in that directory's files (it must be
        ``PROMETHEUS_MULTIPROC_DIR``: prometheus_client picks its storage on import)."""
        self.registry = CollectorRegistry(auto_describe=False)
        if admission is not None:
            self.registry.register(_PolicyCollector(admission))
        series: CollectorRegistry | None = self.registry
        if multiprocess_dir is not None:
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != multiprocess_dir:
                raise RuntimeError("metrics across processes need PROMETHEUS_MULTIPROC_DIR="
                                   f"{multiprocess_dir} in the environment before start")
            series = None  # the files hold them; read back summed over processes
            if admission is not None:
                MultiProcessCollector(self.registry, path=multiprocess_dir)
        # where the series recorded as calls end register (None: multiprocess files)
        self.series_registry = series
        self.hold_seconds = Histogram(
            "sluice_hold_seconds", "Time a call was held by Sluice before it went upstream.",
            buckets=HOLD_BUCKETS, registry=series,
        )
        self.upstream_seconds = Histogram(
            "sluice_upstream_latency_seconds",
            "Time from sending a call upstream to its last byte.",
            ["worker", "stream"], buckets=LATENCY_BUCKETS, registry=series,
        )
        self.ttft_seconds = Histogram(
            "sluice_upstream_ttfb_seconds", "Time from sending a call upstream to its first byte.",
            ["worker"], buckets=LATENCY_BUCKETS, registry=series,
        )
        self.requests = Counter(
            "sluice_requests", "Calls answered, by route and status.", ["route", "status"],
            registry=series,
        )
        # From the usage of each completed call: the fleet's prefix-cache hit rate is
        # rate(cached) / rate(prompt).
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of completed calls, by worker.", ["worker"],
            registry=series)
        self.cached_tokens = Counter(
            "sluice_cached_tokens", "Prompt tokens served from the prefix cache (usage "
            "cached_tokens), by worker.", ["worker"], registry=series)
        self.completion_tokens = Counter(
            "sluice_completion_tokens", "Output tokens of completed calls, by worker.", ["worker"],
            registry=series)
        self.reloads = Counter(
            "sluice_config_reloads", "Config reloads by result.", ["result"], registry=series,
        )
        self.edge_refusals = Counter(
            "sluice_edge_refusals", "Requests the listener refused (http: bounds) and clients it "
            "cut for not reading, by reason; counted even when the log line is skipped.",
            ["reason"], registry=series)
        # Every reason at 0 from the start, so a scrape shows them before the first refusal.
        self._edge_refusal_counters = {reason: self.edge_refusals.labels(reason)
                                       for reason in EDGE_REFUSAL_REASONS}
        self.up = Gauge("sluice_up", "1 while the gateway serves.", registry=series,
                        multiprocess_mode="max")
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

    def count_edge_refusal(self, reason: str) -> None:
        """``sluice_edge_refusals{reason}`` + 1; ``reason`` is one of
        :data:`EDGE_REFUSAL_REASONS`."""
        self._edge_refusal_counters[reason].inc()

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

