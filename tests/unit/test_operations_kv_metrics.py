"""The KV index's eviction counters as Prometheus metrics (controller/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from controller.admission import Admission
from controller.metrics import Metrics
from scheduler.kv_events import BlockRemoved, BlockStored, EventBatch
from scheduler.policies import make_policy


def _stored(hashes, session, continuation, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(range(16 * len(hashes))), block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, session_id=session,
                       continuation_id=continuation)


def _removed(block_hash, continuation=None, num_tokens=None):
    return BlockRemoved(block_hashes=[block_hash], medium="GPU", continuation_id=continuation,
                        num_tokens=num_tokens)


def _samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    text = metrics.render().body.decode()
    return {
        (sample.name, sample.labels.get("worker", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sluice_kv_")
    }


def test_kv_eviction_counters_are_exported_per_worker():
    policy = make_policy()
    policy.add_worker("w0", 10_000)
    policy.add_worker("w1", 10_000)
    metrics = Metrics(Admission(policy, clock=lambda: 0.0, log=None))
    samples = _samples(metrics)
    for worker in ("w0", "w1"):  # present from the start, at zero
        assert samples[("sluice_kv_evicted_tokens_total", worker)] == 0
        assert samples[("sluice_kv_unknown_removals_total", worker)] == 0
        assert samples[("sluice_kv_attributed_removals_total", worker)] == 0

    policy.observe_kv("w0", EventBatch(ts=1.0, events=[
        _stored([1, 2, 3], "s", "c"),
        _removed(3, "c", 48),          # known and attributed: its 16 tokens count
        _removed(2),                   # known, unattributed
        _removed(99, "c-old", 4096),   # unknown and attributed: no tokens
        _removed(98),                  # unknown, unattributed
    ]))
    samples = _samples(metrics)
    assert samples[("sluice_kv_evicted_tokens_total", "w0")] == 32
    assert samples[("sluice_kv_unknown_removals_total", "w0")] == 2
    assert samples[("sluice_kv_attributed_removals_total", "w0")] == 2
    assert samples[("sluice_kv_evicted_tokens_total", "w1")] == 0

    # counters stay monotonic when the worker's index is reset (engine restart)
    policy.reset_worker_kv("w0")
    assert _samples(metrics)[("sluice_kv_evicted_tokens_total", "w0")] == 32
