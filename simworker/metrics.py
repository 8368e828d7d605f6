"""The simworker's ``/metrics``: the engine's gauges and counters under vLLM's names and labels,
read at scrape time, and the simworker's own (lag skipped, calls aborted, directives: applied,
dropped by reason, refused by the directive limits by reason, clamped, sessions holding state,
sessions forgotten)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from simworker.directive_socket import DirectiveSocket
from simworker.engine_driver import EngineDriver


class EngineCollector:
    """Metrics read from the engine at scrape time, under vLLM's names and labels."""

    def __init__(self, driver: EngineDriver, directives: DirectiveSocket | None) -> None:
        self._driver = driver
        self._directives = directives

    def collect(self) -> Iterator[Metric]:
        driver = self._driver
        engine = driver.engine
        config = driver.config
        labels = ["model_name", "engine"]
        values = [config.model, "0"]
        cache = {
            "block_size": str(engine.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.pool.num_blocks),
            "kv_cache_size_tokens": str(engine.capacity_tokens),
            "engine": "0",
        }
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(cache))
        info.add_metric(list(cache.values()), 1.0)
        yield info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        stats = engine.stats
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    engine.pool.usage)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    len(engine.waiting))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.output_tokens)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.prompt_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.cached_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.preemptions)
        yield counter("sluice_simworker:skipped_lag_seconds",
                      "Model seconds skipped because the engine loop fell behind the wall clock.",
                      driver.lag_dropped_s)
        yield counter("sluice_simworker:aborted_requests",
                      "Calls aborted because their client went away.", driver.aborted)
        directives = self._directives
        if directives is not None:
            yield counter("sluice_simworker:directives_applied",
                          "Retention directives applied to the block pool.", directives.applied)
            yield counter("sluice_simworker:directives_dropped",
                          "Directive messages dropped (malformed, too large, several frames) and "
                          "actions whose application failed.", directives.dropped)
            governor = directives.governor
            by_reason = labels + ["reason"]
            dropped = CounterMetricFamily("sluice_simworker:directive_drops",
                                          "Directive messages and actions dropped, by reason.",
                                          labels=by_reason)
            for reason, n in sorted(directives.drops.items()):
                dropped.add_metric(values + [reason], n)
            yield dropped
            refused = CounterMetricFamily("sluice_simworker:directives_refused",
                                          "Directive actions refused by the worker's directive "
                                          "limits, by reason.", labels=by_reason)
            for reason, n in sorted(governor.refused.items()):
                refused.add_metric(values + [reason], n)
            yield refused
            yield counter("sluice_simworker:directives_clamped",
                          "Directive actions whose TTL, deadline or priority was clamped to the "
                          "worker's directive limits.", governor.clamped)
            yield gauge("sluice_simworker:directive_sessions",
                        "Sessions holding directive state.", governor.sessions)
            yield gauge("sluice_simworker:directive_retained_blocks",
                        "Blocks counted against the retained-block budget (0 without one).",
                        governor.retained_blocks)
            yield counter("sluice_simworker:directive_sessions_forgotten",
                          "Sessions whose directive state lapsed and was released.",
                          governor.forgotten)
