"""The Grafana dashboard (ops/grafana/sluice-dashboard.json) queries only metrics a running
gateway exports: every ``sluice_*`` name in every panel's PromQL must appear as a sample of
``/metrics`` after one call went through (a renamed or removed metric fails here, not on an
operator's empty panel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.support.gateway_harness import chat, fakes, gateway, serve_config

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "sluice-dashboard.json"
METRIC = re.compile(r"\bsluice_[a-z_]+\b")


def _queried_metrics() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {}
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        for target in panel["targets"]:
            for name in METRIC.findall(target["expr"]):
                queried[name] = panel["title"]
    return queried


def _samples(metrics_text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0]
            for line in metrics_text.splitlines() if line and not line.startswith("#")}


def _exported(metrics_text: str) -> set[str]:
    """Sample names, and the names of declared families that have no sample yet (counters
    of events that have not happened: index resets, dropped directives)."""
    declared = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            declared |= {name, name + "_bucket", name + "_sum", name + "_count"} \
                if kind == "histogram" else {name}
    return _samples(metrics_text) | declared


def test_every_metric_the_dashboard_queries_is_exported_by_a_running_gateway():
    queried = _queried_metrics()
    assert len(queried) >= 20  # the panels cover the fleet, the policy, errors and KV events
    with fakes("w0") as started:
        _, server = started[0]
        workers = [{"name": "w0", "url": server.url, "capacity_tokens": 100_000,
                    "kv_events": "tcp://127.0.0.1:1"}]  # exports the subscriber's series
        with gateway(serve_config(workers)) as gw:
            assert gw.client.post("/v1/chat/completions", json=chat(),
                                  headers={"x-session-id": "dash"}).status_code == 200
            exported = _exported(gw.client.get("/metrics").text)
    missing = {name: panel for name, panel in queried.items() if name not in exported}
    assert not missing, f"queried by the dashboard but not exported: {missing}"


def test_a_completed_call_feeds_the_hit_rate_and_output_counters():
    with fakes("w0") as started:
        _, server = started[0]
        workers = [{"name": "w0", "url": server.url, "capacity_tokens": 100_000}]
        with gateway(serve_config(workers)) as gw:
            gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "u"})
            samples = gw.client.get("/metrics").text
    assert 'sluice_prompt_tokens_total{worker="w0"} 10.0' in samples
    assert 'sluice_cached_tokens_total{worker="w0"} 0.0' in samples
    assert 'sluice_completion_tokens_total{worker="w0"} 5.0' in samples


def test_dashboard_panels_have_unique_ids_and_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
