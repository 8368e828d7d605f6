"""Where the gateway sends calls and what they carry there, end to end: a real gateway and
real workers on 127.0.0.1 that record every request's headers (and, given an API key, refuse
/v1 requests without it the way vLLM 0.32's ``--api-key`` does).

- Worker URLs outside ``worker_urls`` are refused from the config and from the admin API,
  before any connection (nothing here ever connects off loopback).
- A client's credentials and other headers stay at the gateway unless
  ``forward_client_headers`` names them; engine-control body keys stay unless
  ``forward_client_keys`` names them.
- A worker's API key goes to that worker only, on calls, health checks and probes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from tests.support.fake_vllm import FakeState, create_fake
from tests.support.gateway_harness import (ADMIN, ServerThread, chat, gateway, serve_config,
                                           startup_error, wait_for)

# vLLM 0.32 checks --api-key on these path prefixes only (entrypoints/serve/middleware/
# authenticate.py GUARDED_PREFIX)
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")

CREDENTIALS = {
    "Authorization": "Bearer sk-client-secret",
    "Cookie": "session=client-cookie",
    "Proxy-Authorization": "Basic Y2xpZW50",
    "x-api-key": "sk-ant-client",
    "x-request-id": "client-chosen-id",
    "x-data-parallel-rank": "1",
    "x-custom": "client-custom",
    "x-trace-span": "span-1",
}


@dataclass
class RecordingWorker:
    """A fake vLLM behind a layer that records every request's path and headers and, with
    ``api_key``, answers 401 to a guarded path without ``Authorization: Bearer <api_key>``."""

    state: FakeState
    api_key: str | None = None
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def app(self):
        inner = create_fake(self.state)

        async def recording(scope, receive, send):
            if scope["type"] == "http":
                headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                           for k, v in scope["headers"]}
                self.requests.append((scope["path"], headers))
                if (self.api_key is not None and scope["path"].startswith(GUARDED_PREFIX)
                        and headers.get("authorization") != f"Bearer {self.api_key}"):
                    await send({"type": "http.response.start", "status": 401,
                                "headers": [(b"content-type", b"application/json")]})
                    await send({"type": "http.response.body", "body": b'{"error":"Unauthorized"}'})
                    return
            await inner(scope, receive, send)

        return recording

    def seen_on(self, prefix: str) -> list[dict[str, str]]:
        return [headers for path, headers in self.requests if path.startswith(prefix)]


@contextmanager
def recording_workers(*specs: tuple[str, str | None]) -> Iterator[list[tuple[RecordingWorker, ServerThread]]]:
    started = []
    try:
        for name, api_key in specs:
            worker = RecordingWorker(FakeState(name), api_key)
            started.append((worker, ServerThread(worker.app()).start()))
        yield started
    finally:
        for _, server in started:
            server.stop()


def _entry(worker: RecordingWorker, server: ServerThread, **extra) -> dict:
    return {"name": worker.state.name, "url": server.url, "capacity_tokens": 100_000, **extra}


# -- client headers and engine keys --------------------------------------------------------


def test_client_credentials_and_other_headers_do_not_reach_the_worker():
    with recording_workers(("w0", None)) as [(worker, server)]:
        with gateway(serve_config([_entry(worker, server)])) as gw:
            r = gw.client.post("/v1/chat/completions", json=chat("hi"),
                               headers={"x-session-id": "creds-1", **CREDENTIALS})
            assert r.status_code == 200, r.text
    [seen] = worker.state.seen
    for name in CREDENTIALS:
        assert name.lower() not in seen.headers, name
    assert seen.headers["content-type"] == "application/json"
    assert seen.headers["x-session-id"] == "creds-1"


def test_headers_the_config_names_are_forwarded():
    with recording_workers(("w0", None)) as [(worker, server)]:
        config = serve_config([_entry(worker, server)],
                              forward_client_headers=["X-Custom", "x-trace-*"])
        with gateway(config) as gw:
            r = gw.client.post("/v1/chat/completions", json=chat("hi"),
                               headers={"x-session-id": "named-1", **CREDENTIALS})
            assert r.status_code == 200, r.text
    [seen] = worker.state.seen
    assert seen.headers["x-custom"] == "client-custom"
    assert seen.headers["x-trace-span"] == "span-1"
    for name in ("authorization", "cookie", "x-api-key", "x-request-id", "x-data-parallel-rank"):
        assert name not in seen.headers, name


ENGINE_KEYS = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"},
               "ec_transfer_params": {"remote": "x"}, "request_id": "client-chosen-id"}


@pytest.mark.parametrize("named", [[], ["kv_transfer_params", "ec_transfer_params", "request_id"]])
def test_engine_control_keys_reach_the_worker_only_when_named(named):
    with recording_workers(("w0", None)) as [(worker, server)]:
        with gateway(serve_config([_entry(worker, server)], forward_client_keys=named)) as gw:
            r = gw.client.post("/v1/chat/completions", json=chat("hi", **ENGINE_KEYS),
                               headers={"x-session-id": "keys-1"})
            assert r.status_code == 200, r.text
    [seen] = worker.state.seen
    for key, value in ENGINE_KEYS.items():
        assert seen.body.get(key) == (value if key in named else None), key


# -- worker URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize("url,why", [
    ("http://169.254.169.254", "169.254.169.254"),
    ("http://169.254.169.254:80", "169.254.169.254"),
    ("http://[fe80::1]:8000", "fe80::1"),
    ("http://0xa9fea9fe", "resolves to 169.254.169.254"),  # the metadata address, in hex
    ("http://127.0.0.1:8000/internal/admin", "no path"),
    ("http://user:pw@127.0.0.1:8000", "user info"),
])
def test_admin_api_refuses_a_worker_url_outside_the_allow_list(url, why):
    with recording_workers(("w0", None)) as [(worker, server)]:
        with gateway(serve_config([_entry(worker, server)])) as gw:
            r = gw.client.post("/sluice/workers", headers=ADMIN,
                               json={"name": "intruder", "url": url, "capacity_tokens": 1000})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert message.startswith("worker.url: ") and why in message, message
            assert ("pw@" not in message) and ("intruder" not in gw.workers())


def test_admin_api_resolves_a_host_name_and_checks_every_address():
    with recording_workers(("w0", None), ("late", None)) as [(worker, server), (late, late_server)]:
        # of loopback, only 127.0.0.1 is allowed
        narrow = serve_config([_entry(worker, server)],
                              worker_urls={"networks": ["127.0.0.1/32", "::1/128", "10.0.0.0/8"]})
        with gateway(narrow) as gw:
            # 127.0.0.2 in hex: a name to the URL parser, an address to the resolver
            hex_loopback = f"http://0x7f000002:{late_server.port}"
            r = gw.client.post("/sluice/workers", headers=ADMIN,
                               json={"name": "late", "url": hex_loopback})
            assert r.status_code == 400 and "resolves to 127.0.0.2" in r.text, r.text
            # localhost resolves to 127.0.0.1 only here: allowed, and the worker is reached
            by_name = f"http://localhost:{late_server.port}"
            r = gw.client.post("/sluice/workers", headers=ADMIN,
                               json={"name": "late", "url": by_name, "capacity_tokens": 1000})
            assert r.status_code == 201, r.text
            assert gw.workers()["late"]["healthy"] is True
    assert late.seen_on("/health")


def test_gateway_does_not_start_with_a_configured_worker_it_may_not_reach(monkeypatch):
    monkeypatch.delenv("SLUICE_TEST_UNSET_KEY", raising=False)
    config = serve_config(
        [{"name": "named", "url": "http://localhost:9", "capacity_tokens": 1000},
         {"name": "keyed", "url": "http://10.0.0.1:9", "capacity_tokens": 1000,
          "api_key_env": "SLUICE_TEST_UNSET_KEY"}],
        worker_urls={"networks": ["10.0.0.0/8"]})
    message = startup_error(config)
    assert "workers.0.url: 'http://localhost:9': 'localhost' resolves to 127.0.0.1" in message
    assert "workers.1.api_key_env: the environment variable SLUICE_TEST_UNSET_KEY is not set" in message


# -- a worker's API key --------------------------------------------------------------------


def test_a_workers_api_key_goes_to_that_worker_only_on_calls_and_probes(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_TEST_W0_KEY", "k-w0-env")
    key_file = tmp_path / "w1.key"
    key_file.write_text("k-w1-file\n")
    with recording_workers(("w0", "k-w0-env"), ("w1", "k-w1-file"), ("plain", None)) as started:
        (w0, s0), (w1, s1), (plain, sp) = started
        workers = [  # no capacity_tokens: each worker's /metrics is probed for it
            {"name": "w0", "url": s0.url, "api_key_env": "SLUICE_TEST_W0_KEY"},
            {"name": "w1", "url": s1.url, "api_key_file": str(key_file)},
            {"name": "plain", "url": sp.url},
        ]
        # even a client Authorization the config forwards never replaces a worker's key
        with gateway(serve_config(workers, forward_client_headers=["authorization"],
                                  health_interval_s=0.2)) as gw:
            wait_for(lambda: all(w["capacity_tokens"] for w in gw.workers().values()),
                     timeout=30, what="every worker's capacity from its /metrics")
            wait_for(lambda: all(w.seen_on("/health") for w, _ in started), timeout=30,
                     what="a health check of every worker")
            assert gw.client.get("/v1/models").status_code == 200
            for session in ("a", "b", "c", "d", "e", "f"):
                r = gw.client.post("/v1/chat/completions", json=chat(f"turn {session}"),
                                   headers={"x-session-id": session,
                                            "Authorization": "Bearer sk-client"})
                assert r.status_code == 200, r.text
            answered = {w.state.name for w, _ in started if w.state.seen}
    assert answered, "no worker saw a call"
    for worker, _ in started:
        expected = None if worker.api_key is None else f"Bearer {worker.api_key}"
        for prefix in ("/health", "/metrics", "/v1/models", "/v1/chat/completions"):
            seen = worker.seen_on(prefix)
            if prefix != "/v1/chat/completions":
                assert seen, (worker.state.name, prefix)
            for headers in seen:
                got = headers.get("authorization")
                if expected is None:  # the client's own, which the config forwards
                    assert got in (None, "Bearer sk-client"), (worker.state.name, prefix, got)
                else:
                    assert got == expected, (worker.state.name, prefix, got)
    for headers in plain.seen_on("/health") + plain.seen_on("/metrics"):
        assert "authorization" not in headers
