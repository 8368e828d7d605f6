"""The client-facing edge of the gateway, as ``sluice serve`` runs it (controller/server.py:
uvicorn with the ``http:`` bounds): header size and count limits, header/body/idle timeouts,
the connection limit, the send timeout for a client that stops reading, the listener's
keep-alive, and a non-boolean ``stream``; each refusal counted in
``sluice_edge_refusals_total{reason}``. Real uvicorn on 127.0.0.1, real sockets, a real
fake worker behind it (tests/support/fake_vllm.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.gateway_harness import (Gateway, LogSink, chat, fakes, read_http_answer, serve_config,
                                           wait_for)

from controller.gateway import create_app
from controller.serve_config import ServeConfig, parse_serve_config
from controller.server import DrainingServer, server_config
from scheduler.config import ConfigError

CHAT = "/v1/chat/completions"


class _EdgeServer:
    """The gateway in a thread, started the way ``sluice serve`` starts it."""

    def __init__(self, app: Any) -> None:
        drain = app.state.sluice.drain
        self.server = DrainingServer(server_config(app, "127.0.0.1", 0, drain.grace_s), drain)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    def start(self) -> _EdgeServer:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=10,
                 what="the gateway to start")
        assert self.server.started, "the gateway did not start"
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@contextmanager
def edge_gateway(config: ServeConfig) -> Iterator[tuple[Gateway, _EdgeServer]]:
    log = LogSink()
    app = create_app(config, log_stream=log)
    server = _EdgeServer(app).start()
    gw = Gateway(server, app, log)  # type: ignore[arg-type]
    try:
        yield gw, server
    finally:
        gw.close()


@contextmanager
def fleet(**http: Any) -> Iterator[tuple[Gateway, _EdgeServer, Any]]:
    """One fake worker behind a gateway whose ``http:`` section is ``http``."""
    with fakes("w0") as started:
        fake, worker = started[0]
        workers = [{"name": "w0", "url": worker.url, "capacity_tokens": 1_000_000}]
        config = serve_config(workers, http=http, shutdown_grace_s=0.5)
        with edge_gateway(config) as (gw, server):
            yield gw, server, fake


def _connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connecting, so the window starts small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def _read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a
    close); fails the test when it stays open past ``timeout``."""
    sock.settimeout(timeout)
    received = bytearray()
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return bytes(received)
            received += data
    except ConnectionResetError:
        return bytes(received)
    except socket.timeout:
        raise AssertionError(f"the connection is still open after {timeout}s "
                             f"(received {bytes(received[:80])!r})") from None


def _chat_request(session: str, body: bytes | None = None, **headers: str) -> bytes:
    body = body if body is not None else httpx.Request("POST", "/", json=chat("hi")).read()
    lines = [f"POST {CHAT} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json",
             f"content-length: {len(body)}", f"x-session-id: {session}",
             *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _post(url: str, session: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        headers = {"x-session-id": session, **kwargs.pop("headers", {})}
        return client.post(CHAT, json=kwargs.pop("json", chat(f"task of {session}")),
                           headers=headers, **kwargs)


# Every reason the listener counts, each exported at 0 before its first refusal.
NO_REFUSALS = dict.fromkeys(("headers_too_large", "header_timeout", "body_timeout",
                             "connection_limit", "send_timeout"), 0.0)


def _edge_refusals(url: str) -> dict[str, float]:
    """``sluice_edge_refusals_total`` by reason, scraped from the gateway's ``/metrics``
    on a connection of its own (closed after, so it holds no room under max_connections)."""
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        text = client.get("/metrics").text
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "sluice_edge_refusals_total"}


def _quiet(gw: Gateway) -> None:
    """Nothing held or in flight, and the gateway and the policy agree on every call."""
    assert all(p["in_flight"] == 0 and p["waiting"] == 0 for p in gw.programs().values())
    assert gw.parts.admission.disagreements() == []


# -- header limits ---------------------------------------------------------------------------


def _send_huge_header(port: int, size: int) -> bytes:
    """A request whose one header is ``size`` bytes; what came back (b"" on a reset)."""
    sock = _connect(port)
    try:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-huge: ".encode())
        piece = b"a" * (1024 * 1024)
        try:
            for _ in range(size // len(piece)):
                sock.sendall(piece)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway refused it and closed while it was still being sent
        return _read_until_closed(sock)
    finally:
        sock.close()


def test_a_48_mb_header_is_refused_with_431_while_other_calls_go_on():
    with fleet() as (gw, server, fake):
        with ThreadPoolExecutor(6) as pool:
            huge = pool.submit(_send_huge_header, server.port, 48 * 1024 * 1024)
            others = [pool.submit(_post, gw.url, f"other-{n}") for n in range(10)]
            answered = huge.result(timeout=30)
            assert [call.result(timeout=30).status_code for call in others] == [200] * 10
        # The 431 comes back unless the kernel reset the connection under the client's
        # upload first; either way the gateway refused it and the worker never saw it.
        assert answered == b"" or answered.startswith(b"HTTP/1.1 431 ")
        assert any("request headers too large" in line for line in gw.log.lines())
        assert all("x-huge" not in seen.headers for seen in fake.seen)
        assert len(fake.seen) == 10
        assert _post(gw.url, "after").status_code == 200
        assert _edge_refusals(gw.url) == {**NO_REFUSALS, "headers_too_large": 1}
        _quiet(gw)


def test_too_many_or_too_large_headers_get_431_in_the_routes_error_shape():
    with fleet(max_headers=40, max_header_bytes=8192) as (gw, _, fake):
        assert _edge_refusals(gw.url) == NO_REFUSALS
        many = {f"x-extra-{n}": "1" for n in range(50)}
        refused = _post(gw.url, "many", headers=many)
        assert refused.status_code == 431
        assert refused.headers["connection"] == "close"
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and "http.max_headers" in error["message"]

        large = _post(gw.url, "large", headers={"x-large": "b" * 9000})
        assert large.status_code == 431
        assert "http.max_header_bytes" in large.json()["error"]["message"]

        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
            anthropic = client.post("/v1/messages", headers={"x-large": "b" * 9000},
                                    json={"model": "fake-model", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": "hi"}]})
        assert anthropic.status_code == 431
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "invalid_request_error"

        within = _post(gw.url, "within", headers={f"x-extra-{n}": "1" for n in range(20)})
        assert within.status_code == 200
        assert [seen.body["session_id"] for seen in fake.seen] == ["within"]
        # Three refusals, one log line (WARN_EVERY_S), each counted.
        assert sum("request headers too large" in line for line in gw.log.lines()) == 1
        assert _edge_refusals(gw.url) == {**NO_REFUSALS, "headers_too_large": 3}
        _quiet(gw)


# -- slow clients and the connection limit -------------------------------------------------


def test_silent_clients_and_partial_heads_and_bodies_are_closed_by_the_timeouts():
    with fleet(header_timeout_s=1.0, body_timeout_s=1.0) as (gw, server, fake):
        silent = [_connect(server.port) for _ in range(5)]
        partial_heads = [_connect(server.port) for _ in range(5)]
        for sock in partial_heads:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-sess".encode())
        partial_bodies = [_connect(server.port) for _ in range(5)]
        for n, sock in enumerate(partial_bodies):
            sock.sendall(_chat_request(f"slow-{n}", body=b"x" * 1000)[:-990])
        reused = _connect(server.port)  # a whole request, then part of the next one's head
        reused.sendall(_chat_request("reused"))
        assert read_http_answer(reused).startswith(b"HTTP/1.1 200 ")
        reused.sendall(f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode())
        partial_heads.append(reused)

        for sock in silent:
            assert _read_until_closed(sock) == b""  # nothing asked, nothing answered
        for sock in partial_heads + partial_bodies:
            answer = _read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
            assert b"http.header_timeout_s" in answer or b"http.body_timeout_s" in answer
        for sock in silent + partial_heads + partial_bodies:
            sock.close()

        wait_for(lambda: server.open_connections() == 0, timeout=10, what="connections closed")
        # The silent connections were closed, not refused: nothing was asked of them.
        assert _edge_refusals(gw.url) == {**NO_REFUSALS, "header_timeout": 6, "body_timeout": 5}
        assert _post(gw.url, "prompt").status_code == 200  # a client that does send is served
        assert fake.sessions() == ["reused", "prompt"]
        _quiet(gw)


def test_past_max_connections_a_request_gets_503_with_retry_after_until_one_closes():
    with fleet(max_connections=4) as (gw, server, fake):
        held = [_connect(server.port) for _ in range(4)]
        wait_for(lambda: server.open_connections() == 4, timeout=10, what="4 connections open")
        refused = _post(gw.url, "fifth")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "5"
        assert "http.max_connections" in refused.json()["error"]["message"]
        assert fake.seen == []

        for sock in held:
            sock.close()
        wait_for(lambda: server.open_connections() == 0, timeout=10, what="connections closed")
        assert _edge_refusals(gw.url) == {**NO_REFUSALS, "connection_limit": 1}
        assert _post(gw.url, "fifth").status_code == 200
        _quiet(gw)


# -- a client that stops reading -------------------------------------------------------------


def test_a_client_that_stops_reading_its_stream_is_cut_and_its_call_given_back():
    with fleet(send_timeout_s=1.0) as (gw, _server, fake):
        body = httpx.Request("POST", "/", json=chat("hi", stream=True)).read()
        # A stream far larger than the socket buffers between the gateway and the client.
        sock = _connect(_server.port, receive_buffer=4096)
        try:
            sock.sendall(_chat_request("stalled", body=body, **{"x-test-chunks": "100000"}))
            assert sock.recv(256).startswith(b"HTTP/1.1 200 ")
            wait_for(lambda: gw.programs().get("stalled", {}).get("in_flight") == 1,
                     what="the stream in flight")
            # ... and the client reads nothing more.
            wait_for(lambda: gw.programs().get("stalled", {}).get("in_flight", 0) == 0,
                     timeout=15, what="the stalled call to be aborted")
        finally:
            sock.close()
        assert any("client stopped reading" in line for line in gw.log.lines())
        assert any('"client disconnected"' in line and '"streaming"' in line
                   for line in gw.log.lines())
        assert gw.parts.admission.disagreements() == []
        assert _edge_refusals(gw.url) == {**NO_REFUSALS, "send_timeout": 1}
        assert _post(gw.url, "next").status_code == 200
        _quiet(gw)


# -- keep-alive ------------------------------------------------------------------------------


def test_an_idle_connection_is_kept_past_five_seconds_by_default():
    """Clients whose pools keep idle connections for 5 s (httpx, the OpenAI and Anthropic
    SDKs) reuse one just before it expires: the gateway must not close it first."""
    with fleet() as (gw, server, _):
        assert gw.parts.config.http.keep_alive_s == 75.0
        sock = _connect(server.port)
        try:
            sock.sendall(_chat_request("kept"))
            assert read_http_answer(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(6.0)
            sock.sendall(_chat_request("kept"))
            assert read_http_answer(sock).startswith(b"HTTP/1.1 200 ")
        finally:
            sock.close()
        _quiet(gw)


def test_an_idle_connection_is_closed_after_keep_alive_s():
    with fleet(keep_alive_s=0.5) as (gw, server, _):
        sock = _connect(server.port)
        try:
            sock.sendall(_chat_request("idle"))
            assert read_http_answer(sock).startswith(b"HTTP/1.1 200 ")
            assert _read_until_closed(sock) == b""
        finally:
            sock.close()


# -- a non-boolean stream --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["true", 1, "false", [True]])
def test_a_stream_that_is_not_a_boolean_gets_400_naming_it(value):
    with fleet() as (gw, _, fake):
        refused = _post(gw.url, "typed", json=chat("hi", stream=value))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "stream" and error["type"] == "invalid_request_error"
        assert "expected a boolean" in error["message"]
        assert fake.seen == []
        assert "typed" not in gw.programs()


def test_stream_null_is_no_stream_and_the_anthropic_route_refuses_in_its_shape():
    with fleet() as (gw, _, fake):
        answered = _post(gw.url, "null-stream", json=chat("hi", stream=None))
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 5
        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
            refused = client.post("/v1/messages", json={
                "model": "fake-model", "max_tokens": 8, "stream": "true",
                "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400
        assert refused.json()["type"] == "error"
        assert "'stream'" in refused.json()["error"]["message"]
        assert fake.sessions() == ["null-stream"]
        _quiet(gw)


# -- the config --------------------------------------------------------------------------------


def test_http_settings_are_checked_and_errors_name_the_key():
    workers = [{"name": "w0", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError, match=r"http\.max_headers"):
        parse_serve_config({"workers": workers, "http": {"max_headers": 0}})
    with pytest.raises(ConfigError, match=r"http\.send_timeout_s"):
        parse_serve_config({"workers": workers, "http": {"send_timeout_s": -1}})
    with pytest.raises(ConfigError, match=r"http\.keepalive"):
        parse_serve_config({"workers": workers, "http": {"keepalive": 5}})
    defaults = parse_serve_config({"workers": workers}).http
    assert defaults.keep_alive_s == 75.0
    assert (defaults.max_headers, defaults.max_header_bytes) == (100, 65536)
