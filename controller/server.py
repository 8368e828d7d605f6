"""Running the gateway: uvicorn with its fast parts (httptools, uvloop when installed), the
client-facing bounds of ``http:`` and a graceful drain (controller/drain.py) hooked into its
shutdown.

The listener faces clients that may be careless or hostile, and uvicorn bounds little of
what they do: with httptools it takes request heads of any size (and gathers a long header
value by copying it again for every piece that arrives), has no deadline for a request's
head or body, keeps any number of connections, and waits without end for a client that
stops reading its answer. :class:`EdgeHttpProtocol` adds those bounds; uvicorn's own
settings do the rest (``timeout_keep_alive`` from ``http.keep_alive_s``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from controller.drain import CUT_MARGIN_S, Drain
from controller.errors import INVALID_REQUEST, UNAVAILABLE, GatewayError
from controller.serve_config import HttpConfig

# After answering a refusal (431, 408, 503) the connection keeps reading, and dropping, what
# the client still sends for this long before it closes: closing a socket with unread data
# resets it, and the client, busy sending, would see the reset instead of the answer.
LINGER_S = 2.0
# Refusals of one kind are logged at most once per this many seconds (with how many were
# not), so that a flood of bad clients does not become a flood of log lines; the metric
# counts every one.
WARN_EVERY_S = 10.0

_encode = msgspec.json.Encoder().encode


class EdgeRefusals:
    """The listener's refusals: each counted (``sluice_edge_refusals_total{reason}``,
    controller/metrics.py), and logged one line per reason per :data:`WARN_EVERY_S` at most."""

    def __init__(self, log: Any, count: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._count = count
        self._clock = clock
        self._last: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def refused(self, reason: str, event: str, **fields: Any) -> None:
        """One refusal of ``reason`` (of :data:`controller.metrics.EDGE_REFUSAL_REASONS`),
        logged as ``event`` unless a refusal of that reason was logged less than
        :data:`WARN_EVERY_S` ago."""
        self._count(reason)
        now = self._clock()
        last = self._last.get(reason)
        if last is not None and now - last < WARN_EVERY_S:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._last[reason] = now
        self._log.warning(event, not_logged_since_last=self._unlogged.pop(reason, 0), **fields)


class EdgeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds ``http:`` sets, which uvicorn lacks:

    - the request head (request line and headers) is at most ``max_header_bytes`` and
      ``max_headers`` fields, else 431 — counted as bytes arrive, so a huge header is
      refused after its first piece rather than gathered whole;
    - the head must arrive within ``header_timeout_s`` of the connection's start (or of the
      first byte of a later request), else 408, or a plain close when nothing was sent;
    - the body within ``body_timeout_s`` of the head, else 408 (the app sees the client gone);
    - a client that reads nothing of its answer for ``send_timeout_s`` (the transport's
      write buffer stays full) is disconnected, so the call ends as any call whose client
      left: upstream request closed, call aborted in the policy, its room given back;
    - past ``max_connections`` open connections, a new one's request gets 503 with
      ``Retry-After`` and the connection is closed (uvicorn's ``limit_concurrency`` answers
      a bare text 503 without ``Retry-After`` and closes without reading the request, which
      the client may see as a reset).

    Every refusal answers in the API's error shape (controller/errors.py) with
    ``connection: close``, then lingers (:data:`LINGER_S`) before closing; each, and each
    client cut for not reading, is counted and logged (:class:`EdgeRefusals`).
    """

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: HttpConfig,
                 refusals: EdgeRefusals, retry_after_s: int) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._refusals = refusals
        self._retry_after_s = retry_after_s
        self._head_open = True      # what arrives now is (part of) a request's head
        self._head_bytes = 0        # bytes received of that head so far
        self._head_begun = False    # the parser has started on that head
        self._header_count = 0
        self._header_bytes = 0      # names and values of the head's headers
        self._over_connection_limit = False
        self._refused = False       # an error was answered: the rest of the input is dropped
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The set counts this connection too: it is the one past the limit.
        self._over_connection_limit = len(self.connections) > self._limits.max_connections
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._send_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._send_timer = self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered and closing: what the client still sends is dropped unparsed
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        # The timers are armed only for what this data left incomplete, so a request that
        # came whole (the usual case) makes and cancels none.
        if not self._head_open:  # between a head and the end of its body
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self._limits.body_timeout_s,
                                                        self._body_timed_out)
            return
        # The head is still incomplete: bound it now, before more of it is gathered.
        if self._head_bytes > self._limits.max_header_bytes:
            self._refuse_large_head(f"over {self._limits.max_header_bytes} bytes")
        elif self._header_count > self._limits.max_headers:
            self._refuse_large_head(f"over {self._limits.max_headers} header fields")
        elif self._head_timer is None and (self._head_bytes or self._head_begun):
            # part of a later request's head on this connection: its time starts now
            self._head_timer = self.loop.call_later(self._limits.header_timeout_s,
                                                    self._head_timed_out)

    # -- httptools' callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._head_begun = True
        self._header_count = 0
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._header_count += 1
        self._header_bytes += len(name) + len(value)
        if self._header_count <= self._limits.max_headers:  # past it the request is refused
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._head_open = False
        self._head_begun = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        limits = self._limits
        if self._header_count > limits.max_headers:
            self._refuse_large_head(f"{self._header_count} header fields, "
                                    f"over {limits.max_headers}")
            return
        size = self._header_bytes + len(self.url)
        if size > limits.max_header_bytes:
            self._refuse_large_head(f"{size} bytes, over {limits.max_header_bytes}")
            return
        if self._over_connection_limit:
            self._refusals.refused("connection_limit",
                                   "connection limit reached; request refused with 503",
                                   client=_client_name(self.client),
                                   max_connections=limits.max_connections)
            self._refuse(GatewayError(
                503, f"the gateway has {limits.max_connections} client connections open, its "
                     "limit (http.max_connections); retry the call",
                UNAVAILABLE, retry_after_s=self._retry_after_s))
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        self._head_open = True  # the next request's head, if any, comes next

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn would log, for every request with an Upgrade header, that no WebSocket
        # library is installed: the gateway serves no WebSocket route on purpose (``ws:
        # none``) and answers such a request as plain HTTP, so there is nothing to report.
        return

    # -- writing ------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self._limits.send_timeout_s,
                                                    self._client_stopped_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # -- the bounds ---------------------------------------------------------------------

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A request of this connection is still being answered (a pipelined head
            # follows it): the head's time counts from when the connection is idle again.
            self._head_timer = self.loop.call_later(self._limits.header_timeout_s,
                                                    self._head_timed_out)
            return
        if self._head_bytes == 0 and not self._head_begun:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._refusals.refused("header_timeout", "request headers timed out; refused with 408",
                               client=_client_name(self.client),
                               header_timeout_s=self._limits.header_timeout_s)
        self._refuse(GatewayError(
            408, f"the request headers did not arrive within {self._limits.header_timeout_s} s "
                 "(http.header_timeout_s)", INVALID_REQUEST))

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.flow.read_paused:
            # The gateway itself is not reading (the app has not taken what came, or a
            # pipelined request waits its turn): that time is not the client's.
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s,
                                                    self._body_timed_out)
            return
        self._refusals.refused("body_timeout", "request body timed out; refused with 408",
                               client=_client_name(self.client),
                               body_timeout_s=self._limits.body_timeout_s)
        cycle = self.cycle
        if cycle.response_started:  # the app answered before reading its body: cut it
            self.transport.abort()
            return
        # The app, still reading the body, sees the client gone, as uvicorn tells it when a
        # connection is lost; what it would send now is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(GatewayError(
            408, f"the request body did not arrive within {self._limits.body_timeout_s} s "
                 "(http.body_timeout_s)", INVALID_REQUEST))

    def _client_stopped_reading(self) -> None:
        """The answer's bytes have waited ``send_timeout_s`` for the client to read them.
        Aborting the connection makes uvicorn tell the app the client is gone (and wake its
        blocked send), so the call ends as for any client that left (controller/relay.py)."""
        self._send_timer = None
        self._refusals.refused("send_timeout",
                               "client stopped reading its answer; connection closed",
                               client=_client_name(self.client),
                               send_timeout_s=self._limits.send_timeout_s)
        self.transport.abort()

    def _refuse_large_head(self, why: str) -> None:
        self._refusals.refused("headers_too_large",
                               "request headers too large; refused with 431",
                               client=_client_name(self.client), size=why)
        self._refuse(GatewayError(
            431, f"the request headers are too large: {why} "
                 "(http.max_header_bytes, http.max_headers)", INVALID_REQUEST))

    def _refuse(self, err: GatewayError) -> None:
        """Answer ``err`` and close: the client may still be sending, so the gateway stops
        writing (a FIN after the answer), drops what it reads for :data:`LINGER_S`, then
        closes."""
        self._refused = True
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        path = self.url.split(b"?", 1)[0].decode("latin-1") if getattr(self, "url", b"") else None
        body = _encode(err.body(path))
        head = [STATUS_LINE[err.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        for name, value in err.headers().items():
            head += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        head += [b"content-type: application/json\r\n",
                 b"content-length: ", str(len(body)).encode("ascii"), b"\r\n",
                 b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


def _client_name(client: tuple[str, int] | None) -> str | None:
    return None if client is None else f"{client[0]}:{client[1]}"


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first starts the app's drain, so calls in progress
    are ended by the gateway (with an error their clients can read) before uvicorn would
    cancel them."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        self._drain.begin()
        await super().shutdown(sockets)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def server_config(app: Any, host: str, port: int, grace_s: float) -> uvicorn.Config:
    """uvicorn's config for the gateway ``app`` (:func:`controller.gateway.create_app`),
    bounded by its ``http:`` settings."""
    parts = app.state.sluice
    limits: HttpConfig = parts.config.http
    protocol = functools.partial(EdgeHttpProtocol, limits=limits,
                                 refusals=EdgeRefusals(parts.log,
                                                       parts.metrics.count_edge_refusal),
                                 retry_after_s=parts.config.limits.retry_after_s)
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        # httptools is a dependency (the relay parses the workers' answers with it too).
        http=protocol,  # type: ignore[arg-type]
        # The gateway serves no WebSocket route; an upgrade request is answered as plain HTTP.
        ws="none",
        loop="uvloop" if _installed("uvloop") else "asyncio",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=grace_s + CUT_MARGIN_S,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run_gateway(app: Any, host: str, port: int, sockets: list[socket.socket] | None = None) -> None:
    """Serve ``app`` (from :func:`controller.gateway.create_app`) until SIGTERM/SIGINT, on
    ``host:port`` or on ``sockets`` already bound (a relay process's SO_REUSEPORT one)."""
    drain: Drain = app.state.sluice.drain
    # uvicorn captures SIGTERM for its shutdown and raises it again once it is done; with
    # the default action that would end the process "killed by SIGTERM" after a clean drain.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        DrainingServer(server_config(app, host, port, drain.grace_s), drain).run(sockets=sockets)
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it captured once it has shut down; as uvicorn.run
        # does, a Ctrl-C that ended a clean shutdown is a normal exit.
        pass
