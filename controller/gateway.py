"""The gateway: an OpenAI/Anthropic-compatible proxy that admits programs.

:func:`create_app` builds everything from a :class:`ServeConfig` (no globals; nothing is
started until the app's lifespan starts the tick loop, the fleet (each worker's connections,
sockets, health checks, capacity probe and KV events: controller/fleet.py) and the config
watcher, and stops them again).

One call, in order:

1. The body is read (``max_body_bytes``, else 413) and parsed (else 400; nested too deeply
   to parse or walk is a 400 too). Errors on ``/v1/messages`` routes come in Anthropic's
   shape, elsewhere in OpenAI's (:mod:`controller.errors`).
2. Its identity is resolved (:func:`controller.identity.resolve_identity`; an invalid id is
   a 400 naming the header or field), and a ``model`` no worker serves is a 404
   (:mod:`controller.model_catalog`).
3. The policy admits it now or holds it (:class:`controller.admission.Admission`); a held
   call waits without polling. Its client going away aborts it in the policy.
4. It is forwarded to the admitted worker with ``session_id``, ``X-Session-ID`` and
   ``vllm_xargs.continuation_id`` set, and, to a worker whose vLLM runs
   ``--scheduling-policy priority`` (``scheduling_policy: priority``), the policy's
   ``priority`` (chat, completions, Responses; :func:`scheduler.actions.engine_priority`);
   the client's own ``priority`` and ``vllm_xargs`` keys are dropped unless
   ``forward_client_keys`` names them (a forwarded client ``priority`` goes as sent). A
   non-streaming answer is passed on whole; a stream is passed on as it arrives (minus the
   usage chunk Sluice asked for on the client's behalf). The client leaving mid-stream
   closes the upstream request.
5. The real usage goes to the policy (``on_complete``; a tick follows), and a
   ``request_end`` record to the request log.

``POST /v1/messages/count_tokens`` is not a call: it is relayed to one healthy worker (the
session's home worker when the session is a known program) without the policy hearing of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import anyio
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from controller.admission import Admission, Admitted, DirectiveSink
from controller.directives import ZmqDirectiveSink
from controller.drain import Drain
from controller.errors import (
    INTERNAL,
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    NOT_FOUND,
    TOO_LARGE,
    UNAVAILABLE,
    GatewayError,
    error_response,
)
from controller.conversations import Answer, AnswerTap, Conversations, answer_from_body
from controller.fleet import Fleet, WorkerTables
from controller.identity import (
    CONTENT_SOURCE,
    ROUTE_CHAT,
    ROUTE_MESSAGES,
    ROUTE_RESPONSES,
    ROUTES,
    Identity,
    IdentityError,
    resolve_identity,
)
from controller.model_catalog import ModelCatalog
from controller.admin_api import AdminApi
from controller.config_reload import ConfigReloader
from controller.metrics import Metrics
from controller.request_log import RequestLog, request_end_record
from controller.relay_client import RelayResponse, TransportError
from controller.serve_config import ServeConfig
from controller.subscriber import KvEventSubscriber
from controller.upstream import (
    ERROR_SNIPPET_BYTES,
    PRIORITY_KEY,
    StreamTap,
    UpstreamPool,
    UsageCounts,
    WorkerUnreachable,
    decode_json,
    find_response_id,
    find_usage,
    forward_headers,
    open_upstream,
    prepare_body,
    response_headers,
    sends_engine_priority,
    strip_client_engine_keys,
    transport_error,
    with_engine_priority,
)
from controller.workers import WorkerRegistry
from scheduler.calls import CallRequest, Usage
from scheduler.policies import make_policy

# A body over the limit is still read (and dropped) up to this much, so the client gets
# its 413 instead of a connection reset in the middle of its upload.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
RESPONSE_SESSIONS_KEPT = 100_000
ROUTE_COUNT_TOKENS = "/v1/messages/count_tokens"

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder()


def make_logger(level: str = "info", stream: IO[str] | None = None) -> Any:
    """A JSON-lines structlog logger of the app's own (structlog's global config untouched)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(stream if stream is not None else sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_name="sluice.gateway",
    )


class CallLines:
    """The per-call ``info`` lines, written straight to the log's stream: the same JSON object
    :func:`make_logger`'s processors make (``logger_name``, the fields, ``event``, ``level``,
    ``timestamp``), encoded by msgspec at a fraction of structlog's cost per line."""

    def __init__(self, level: str, stream: IO[str]) -> None:
        self.enabled = _LEVELS[level] <= _LEVELS["info"]
        self._stream = stream

    def info(self, event: str, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = {"logger_name": "sluice.gateway", **fields, "event": event, "level": "info",
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")}
        self._stream.write(_encode(line).decode() + "\n")
        self._stream.flush()


class ResponseSessions:
    """Responses API ids → the session that produced them (for ``previous_response_id``)."""

    def __init__(self, limit: int = RESPONSE_SESSIONS_KEPT) -> None:
        self._limit = limit
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: str) -> str | None:
        return self._map.get(response_id)

    def put(self, response_id: str, session_id: str) -> None:
        self._map[response_id] = session_id
        self._map.move_to_end(response_id)
        if len(self._map) > self._limit:
            self._map.popitem(last=False)


@dataclass(slots=True)
class Parts:
    """What one app is made of (``app.state.sluice``): tests and the demo look inside."""

    config: ServeConfig
    admission: Admission
    pool: UpstreamPool
    workers: WorkerRegistry
    metrics: Metrics
    request_log: RequestLog
    reloader: ConfigReloader
    responses: ResponseSessions
    log: Any
    models: ModelCatalog
    fleet: Fleet  # one record per worker; membership (controller/fleet.py)
    kv_events: KvEventSubscriber | None = None  # the KV-event subscriber (controller/subscriber.py)
    drain: Drain = field(default_factory=lambda: Drain(0.0))  # graceful shutdown (controller/drain.py)
    # programs of calls without identity, by the answers they carry on (controller/conversations.py)
    conversations: Conversations = field(default_factory=Conversations)


def create_app(config: ServeConfig, *, clock: Callable[[], float] = time.monotonic,
               wall_clock: Callable[[], float] = time.time,
               directive_sink: DirectiveSink | None = None,
               log_stream: IO[str] | None = None) -> Starlette:
    """Build the gateway for ``config``. ``clock`` is the policy's (monotonic) time;
    ``wall_clock`` stamps request records and worker checks."""
    log_stream = log_stream if log_stream is not None else sys.stderr
    log = make_logger(config.log_level, log_stream)
    policy = make_policy(config.policy)
    if directive_sink is None:
        # Retention directives to the engines' Sluice plugin (controller/directives.py)
        directive_sink = ZmqDirectiveSink(log)
    admission = Admission(policy, clock=clock, log=log, sink=directive_sink, limits=config.limits)
    pool = UpstreamPool([], config.upstream)
    workers = WorkerRegistry(config, pool, admission, log, wall_clock)
    metrics = Metrics(admission)
    request_log = RequestLog(config.request_log, log)
    reloader = ConfigReloader(config, admission, metrics, log, wall_clock)
    # KV-event subscriber: engines' events feed the policy's index (under the admission lock)
    kv_events = KvEventSubscriber(config, admission, log)
    metrics.watch_kv_events(kv_events)
    # The workers, configured ones when the app starts and others through the admin API,
    # each entered in all of these tables at once (controller/fleet.py)
    fleet = Fleet(config, WorkerTables(workers, pool, admission.sink, kv_events, metrics,
                                       admission), log)
    parts = Parts(config, admission, pool, workers, metrics, request_log, reloader,
                  ResponseSessions(), log, ModelCatalog(config, pool, workers, log), fleet,
                  kv_events, Drain(config.shutdown_grace_s))
    gateway = _Gateway(parts, clock, wall_clock, CallLines(config.log_level, log_stream))
    admin = AdminApi(config.resolved_admin_token(), admission, fleet, reloader, clock)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        request_log.open()
        parts.drain.open()
        log.info("gateway starting", policy=policy.name, workers=[w.name for w in config.workers],
                 config=str(config.path) if config.path else None)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(admission.run_ticks)
                tg.start_soon(reloader.run)
                await tg.start(fleet.run)  # every configured worker wired before the first call
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await fleet.aclose()
            request_log.close()
            parts.drain.close()
            log.info("gateway stopped")

    # Reached through Starlette's router only when the app is mounted under another one:
    # the app itself sends these POSTs straight to the relay (_SluiceApp).
    routes = [Route(path, _RelayEndpoint(gateway), methods=["POST"]) for path in sorted(ROUTES)]
    routes += [
        Route(ROUTE_COUNT_TOKENS, gateway.count_tokens, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
        *admin.routes(),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        path = request.url.path  # picks the error shape: Anthropic's under /v1/messages
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {path}", NOT_FOUND, path=path)
        if exc.status_code == 405:
            return error_response(405, f"{path} does not accept {request.method}",
                                  INVALID_REQUEST, path=path)
        return error_response(exc.status_code, str(exc.detail), INVALID_REQUEST, path=path)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", path=request.url.path, exc_info=exc)
        return error_response(500, "internal error in the gateway", INTERNAL, path=request.url.path)

    app = _SluiceApp(
        gateway,
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.sluice = parts
    return app


class _SluiceApp(Starlette):
    """Starlette, with the proxied routes' POSTs taken before its middleware and router:
    on the relay path those cost more than the rest of a call's bookkeeping, and the relay
    answers its own errors (in the route's API shape) and logs its own failures."""

    def __init__(self, gateway: _Gateway, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._relay = gateway.relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTES:
            await self._relay(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class _RelayEndpoint:
    """The relay as a raw ASGI endpoint of a Starlette route."""

    def __init__(self, gateway: _Gateway) -> None:
        self._gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._gateway.relay(scope, receive, send)


class _HeaderMap(dict):
    """A request's headers, lower-case ``str`` names (as ASGI gives them) to ``str`` values,
    the first of a repeated name kept (as Starlette's ``Headers.get`` does). Not a plain
    ``dict``, so :func:`resolve_identity` takes its names as lower-cased already."""


def _header_map(raw: list[tuple[bytes, bytes]]) -> _HeaderMap:
    headers = _HeaderMap()
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in headers:
            headers[key] = value.decode("latin-1")
    return headers


class _ClientGone(Exception):
    """The client disconnected before its request body was read."""


class _Gateway:
    def __init__(self, parts: Parts, clock: Callable[[], float], wall_clock: Callable[[], float],
                 call_lines: CallLines) -> None:
        self.parts = parts
        self.call_lines = call_lines
        self.config = parts.config
        self.clock = clock
        self.wall = wall_clock
        self.log = parts.log
        self.forwarded_client_keys = frozenset(parts.config.forward_client_keys)
        self.forwards_client_priority = PRIORITY_KEY in self.forwarded_client_keys
        # Request ids: a random prefix per app and a counter (uuid4 per call costs more
        # than the rest of the id's uses together).
        self._id_prefix = f"sluice-{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count(1)

    def count_request(self, route: str, status: int) -> None:
        self.parts.metrics.count_request(route, status)

    def observe_upstream(self, worker: str, stream: bool, total_s: float,
                         first_byte_s: float | None) -> None:
        self.parts.metrics.observe_upstream(worker, stream, total_s, first_byte_s)

    # -- the proxied routes -----------------------------------------------------------

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One proxied call, as a raw ASGI app (POST on one of :data:`ROUTES`)."""
        received, received_wall = self.clock(), self.wall()
        route = scope["path"]
        assigned: Identity | None = None  # a call without identity, counted in conversations
        try:
            headers = _header_map(scope["headers"])
            try:
                body_bytes = await self._read_body_from(receive, headers)
                body = self._parse(body_bytes)
                try:
                    identity, forward = resolve_identity(route, headers, body,
                                                         self.parts.responses.get)
                    strip_client_engine_keys(forward, self.forwarded_client_keys)
                except RecursionError:
                    # A body that decoded just under the interpreter's limit can still be too
                    # deep to walk (identity's canonical JSON).
                    raise _too_deep() from None
            except (GatewayError, IdentityError) as err:
                refusal = self._refuse(route, err)
                self._record_refused(route, refusal.status_code, str(err), None, received,
                                     received_wall)
                await refusal(scope, receive, send)
                return
            except _ClientGone:
                self.count_request(route, 499)
                self.log.info("client disconnected", stage="upload", route=route)
                self._record_refused(route, 499, "the client disconnected during the upload",
                                     None, received, received_wall)
                return
            unknown = await self._unknown_model(identity.model)
            if unknown is not None:
                self.count_request(route, 404)
                self._record_refused(route, 404, unknown.message, identity, received, received_wall)
                await unknown.response(path=route)(scope, receive, send)
                return
            if identity.source == CONTENT_SOURCE:
                identity = assigned = self._continue_conversation(identity)
            try:
                stream = forward.get("stream") is True
                drop_usage = prepare_body(route, forward, identity.session_id, identity.chain.head)
                content = _encode(forward)
                sends_priority = sends_engine_priority(route, forward)
            except RecursionError:
                # ... or to encode again
                if assigned is not None:
                    self.parts.conversations.failed(assigned.session_id, assigned.chain.head)
                await self._refuse(route, _too_deep())(scope, receive, send)
                return
            call = CallRequest(
                request_id=f"{self._id_prefix}{next(self._ids)}",
                session_id=identity.session_id,
                prompt_tokens=identity.prompt_tokens,
                max_output_tokens=_max_output(forward),
                parent_session_id=identity.parent_session_id,
                chain=identity.chain,
                chain_tokens=identity.chain_tokens,
                final=identity.final,
                group_id=identity.group_id,
                hints=identity.hints,
                prompt_estimated=True,  # identity.estimate_tokens: ~4 bytes a token
            )
        except Exception as exc:
            # What Starlette's error middleware does for the other routes: nothing was sent yet.
            self.log.error("unhandled error", path=route, exc_info=exc)
            if assigned is not None:
                self.parts.conversations.failed(assigned.session_id, assigned.chain.head)
            await error_response(500, "internal error in the gateway", INTERNAL,
                                 path=route)(scope, receive, send)
            return
        query = scope.get("query_string")
        path = scope.get("raw_path") or route.encode()
        if query:
            path += b"?" + query
        await _ProxyCall(self, route, path, scope["headers"], call, identity, content, stream,
                         drop_usage, received, received_wall, sends_priority)(receive, send)

    def _record_refused(self, route: str, status: int, error: str, identity: Identity | None,
                        received: float, received_wall: float) -> None:
        """The ``request_end`` record of a request refused before it became a call (invalid,
        too large, a model nobody serves, the client gone during its upload)."""
        request_log = self.parts.request_log
        if request_log.path is None:
            return
        request_log.write(request_end_record(
            request_id=f"{self._id_prefix}{next(self._ids)}",
            session_id=identity.session_id if identity is not None else None,
            parent_session_id=identity.parent_session_id if identity is not None else None,
            model=identity.model if identity is not None else None,
            input_tokens=0, output_tokens=0, cached_tokens=0, received_unix_s=received_wall,
            total_s=self.clock() - received, ttft_s=None, queue_s=0.0, now_unix_s=self.wall(),
            extra={"worker": None, "route": route, "status": status, "error": error,
                   "identity_source": identity.source if identity is not None else None}))

    def _continue_conversation(self, identity: Identity) -> Identity:
        """A call without identity: the program whose last answer it carries on, or a new
        one of its opening's group (controller/conversations.py), counted in flight until
        the call ends."""
        assert identity.group_id is not None  # resolve_identity names the opening's group
        session = self.parts.conversations.assign(identity.group_id, identity.continues,
                                                  identity.chain.head)
        return dataclasses.replace(identity, session_id=session)

    def _refuse(self, route: str, err: GatewayError | IdentityError) -> Response:
        """The gateway's own answer to a request it will not forward, counted by status."""
        if isinstance(err, IdentityError):
            err = GatewayError(400, str(err), INVALID_REQUEST, param=err.source)
        self.count_request(route, err.status)
        return err.response(path=route)

    async def _unknown_model(self, model: str | None) -> GatewayError | None:
        """The 404 for a model no worker serves (None when it is served, or unnamed)."""
        if model is None or await self.parts.models.is_served(model):
            return None
        return GatewayError(404, f"the model `{model}` does not exist: no worker serves it",
                            INVALID_REQUEST, param="model", code=MODEL_NOT_FOUND)

    async def count_tokens(self, request: Request) -> Response:
        """Relay an Anthropic token count to a worker. Not a call: it runs nothing on the
        engine worth scheduling, so the policy never hears of it (no program, no hold)."""
        route = request.url.path
        try:
            body = self._parse(await self._read_body(request))
            try:
                # Resolved as a Messages body (it is one, minus max_tokens) so it finds the
                # same session, and so the same program, as the call it prepares.
                identity, forward = resolve_identity(ROUTE_MESSAGES, request.headers, body,
                                                     self.parts.responses.get)
                strip_client_engine_keys(forward, self.forwarded_client_keys)
                content = _encode(forward)
            except RecursionError:
                raise _too_deep() from None
            unknown = await self._unknown_model(identity.model)
            if unknown is not None:
                raise unknown
            session = identity.session_id
            if identity.source == CONTENT_SOURCE:
                # the program the call it prepares would continue (nothing is counted)
                session = self.parts.conversations.find(identity.continues, identity.chain.head) or session
            worker = self._count_tokens_worker(session)
            if worker is None:
                raise GatewayError(503, "no healthy worker: every worker fails its health checks",
                                   UNAVAILABLE)
            path = route.encode() + (b"?" + request.url.query.encode() if request.url.query else b"")
            headers = forward_headers(request.headers.raw, session)
            response = await open_upstream(self.parts.pool, worker, path, content, headers)
            try:
                answer = await response.aread()
            except TransportError as err:
                raise transport_error(worker, err, mid_stream=True) from None
            finally:
                await response.aclose()
        except (GatewayError, IdentityError) as err:
            return self._refuse(route, err)
        self.count_request(route, response.status_code)
        if response.status_code == 404:
            # vLLM's OpenAI server may not have the route; its 404 body is not Anthropic's.
            return error_response(404, f"worker {worker} does not serve {route}", NOT_FOUND,
                                  path=route)
        relayed = Response(answer, status_code=response.status_code)
        # The worker's headers as they came (repeated names kept), with our own length.
        relayed.raw_headers = [*response_headers(response.headers),
                               (b"content-length", str(len(answer)).encode())]
        return relayed

    def _count_tokens_worker(self, session_id: str) -> str | None:
        """The session's home worker when it is a known program on a healthy worker (its
        prefix is there, and it keeps the count next to the calls), else any healthy one."""
        healthy = self.parts.workers.healthy_names()
        if not healthy:
            return None
        program = self.parts.admission.program_view(session_id)
        if program is not None and program.home_worker in healthy:
            return program.home_worker
        return healthy[0]

    async def _read_body_from(self, receive: Receive, headers: Mapping[str, str]) -> bytes:
        """The request body straight off ASGI ``receive`` (the relay's path; same limits)."""
        limit = self.config.max_body_bytes
        declared = headers.get("content-length")
        first = await receive()
        if first["type"] == "http.disconnect":
            raise _ClientGone()
        body = first.get("body", b"")
        if not first.get("more_body", False) and len(body) <= limit:
            return body  # the usual case: the whole body in one message

        async def rest() -> AsyncIterator[bytes]:
            more = first.get("more_body", False)
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone()
                more = message.get("more_body", False)
                yield message.get("body", b"")

        return await self._collect_body(rest(), declared, body)

    async def _read_body(self, request: Request) -> bytes:
        return await self._collect_body(request.stream(), request.headers.get("content-length"))

    async def _collect_body(self, chunks: AsyncIterator[bytes], declared: str | None,
                            head: bytes = b"") -> bytes:
        """``head`` and then ``chunks``, up to ``max_body_bytes`` (else 413, after reading and
        dropping the rest so the client gets its answer instead of a reset)."""
        limit = self.config.max_body_bytes
        too_large = GatewayError(413, f"request body is over the limit of {limit} bytes",
                                 TOO_LARGE)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _drain(chunks, int(declared))
            raise too_large
        parts = [head]
        size = len(head)
        if size > limit:
            await _drain(chunks, size)
            raise too_large
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                await _drain(chunks, size)
                raise too_large
            parts.append(chunk)
        return b"".join(parts)

    @staticmethod
    def _parse(body_bytes: bytes) -> dict:
        if not body_bytes:
            raise GatewayError(400, "request body is empty; expected a JSON object", INVALID_REQUEST)
        try:
            body = _decoder.decode(body_bytes)
        except msgspec.DecodeError as err:
            raise GatewayError(400, f"request body is not valid JSON: {err}", INVALID_REQUEST) from None
        except RecursionError:
            # msgspec recurses per nesting level and gives up at the interpreter's limit:
            # the client's mistake (or attack), not the gateway's.
            raise _too_deep() from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object", INVALID_REQUEST)
        return body

    # -- other routes -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if self.config.models is not None:
            created = int(self.wall())
            data = [{"id": m, "object": "model", "created": created, "owned_by": "sluice"}
                    for m in self.config.models]
            return JSONResponse({"object": "list", "data": data})
        merged = await self.parts.models.from_workers()
        if merged is None:
            return error_response(503, "no healthy worker answered /v1/models", UNAVAILABLE)
        return JSONResponse({"object": "list", "data": merged})

    async def health(self, request: Request) -> Response:
        states = self.parts.workers.states.values()
        healthy = sum(1 for s in states if s.healthy)
        body = {"status": "ok" if healthy else "unavailable", "workers_healthy": healthy,
                "workers": len(self.parts.workers.states)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics(self, request: Request) -> Response:
        return self.parts.metrics.render()


async def _drain(chunks: AsyncIterator[bytes], expected: int) -> None:
    """Read and drop the rest of a refused body (up to DRAIN_LIMIT_BYTES)."""
    if expected > DRAIN_LIMIT_BYTES:
        return  # not worth reading; the client sees the connection close
    seen = expected
    async for chunk in chunks:
        seen += len(chunk)
        if seen > DRAIN_LIMIT_BYTES:
            return


def _too_deep() -> GatewayError:
    return GatewayError(400, "request body is nested too deeply to process", INVALID_REQUEST)


# How the answer of a call without identity is read, per route (completions: no answer is
# carried back as a message, so each such call is its own program).
_ANSWER_KINDS = {ROUTE_CHAT: "chat", ROUTE_MESSAGES: "messages", ROUTE_RESPONSES: "responses"}


def _max_output(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class _ProxyCall:
    """The rest of one call, run so it can watch for the client going away the whole time:
    while held, while the worker computes, while streaming."""

    __slots__ = ("g", "route", "path", "raw_headers_in", "call", "identity", "content", "stream",
                 "drop_usage", "received", "received_wall", "admitted", "accounted", "finished",
                 "started", "status", "sent_upstream_at", "first_byte_at", "_send", "_scope",
                 "cut", "answer_kind", "answered", "usage", "error", "recorded",
                 "sends_priority")

    def __init__(self, gateway: _Gateway, route: str, path: bytes,
                 raw_headers: list[tuple[bytes, bytes]], call: CallRequest, identity: Identity,
                 content: bytes, stream: bool, drop_usage: bool, received: float,
                 received_wall: float, sends_priority: bool) -> None:
        self.g = gateway
        self.route = route
        self.path = path
        self.raw_headers_in = raw_headers
        self.call = call
        self.identity = identity
        self.content = content
        self.stream = stream
        self.drop_usage = drop_usage
        self.received = received
        self.received_wall = received_wall
        self.admitted: Admitted | None = None
        self.accounted = False  # the policy heard how the call ended
        self.finished = False   # the last byte to the client is on its way
        self.started = False    # response headers sent
        self.status = 0
        self.sent_upstream_at: float | None = None
        self.first_byte_at: float | None = None
        self._send: Send | None = None
        self._scope: anyio.CancelScope | None = None
        self.cut = False  # ended by the shutdown drain
        # A call without identity: how to read its answer (the next call of its program
        # carries it back: controller/conversations.py), and whether it was read.
        self.answer_kind = (_ANSWER_KINDS.get(route) if identity.source == CONTENT_SOURCE
                            else None)
        self.answered = False
        self.usage: Usage | None = None  # what the worker reported (or the estimate), if it ran
        self.error: str | None = None  # why the call did not complete, if it did not
        self.recorded = False  # its request_end record is written (before its last byte goes)
        # the call carries the policy's engine priority to a worker that orders by it
        # (controller/upstream.py sends_engine_priority)
        self.sends_priority = sends_priority

    async def __call__(self, receive: Receive, send: Send) -> None:
        self._send = send
        drain = self.g.parts.drain
        # One cancel scope and one plain task watching ``receive`` (an anyio task group per
        # call cost ~140 us): the scope's shields still protect the policy's bookkeeping.
        with anyio.CancelScope() as scope:
            self._scope = scope
            drain.track(self)
            watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, scope))
            try:
                await self._run()
            finally:
                drain.untrack(self)
                if not watcher.done():
                    watcher.cancel()
                if self.identity.source == CONTENT_SOURCE and not self.answered:
                    # refused, failed or cut: a retry of it continues the same program
                    self.g.parts.conversations.failed(self.call.session_id, self.identity.chain.head)
        if self.cut and not self.finished:
            await self._end_for_shutdown()
        elif not self.finished:
            self.g.count_request(self.route, 499)
            self.status, self.error = 499, "the client disconnected"
            self.g.log.info("client disconnected", request_id=self.call.request_id,
                            session_id=self.call.session_id,
                            stage="held" if self.admitted is None else
                            ("streaming" if self.started else "upstream"))
        if not self.recorded:
            self._record()

    async def _end_for_shutdown(self) -> None:
        """End a call the drain cut, in a way its client can read."""
        err = GatewayError(503, "the gateway is shutting down; retry the call", UNAVAILABLE,
                           retry_after_s=self.g.config.limits.retry_after_s)
        self.error = err.message
        self.g.log.info("call cut by shutdown", request_id=self.call.request_id,
                        session_id=self.call.session_id,
                        stage="held" if self.admitted is None else
                        ("streaming" if self.started else "upstream"))
        if self.started:
            self.finished = True
            self._record()
            await self._body(err.sse_event(self.route), more=False)
            self.g.count_request(self.route, 503)
        else:
            await self._send_error(err)

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        # The body was read already: what comes now is the disconnect (uvicorn also sends it
        # once the response is complete, which ends this task).
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finished:
                    scope.cancel()
                return

    # -- the call ---------------------------------------------------------------------

    async def _run(self) -> None:
        response: RelayResponse | None = None
        worker = None
        try:
            opened = await self._admit_and_open()
            if opened is None:
                return  # answered already (refused, or no worker could take it)
            worker, response = opened
            if self.stream and 200 <= response.status_code < 300:
                await self._relay_stream(response, worker)
            else:
                await self._relay_whole(response, worker)
        except Exception:
            self.g.log.exception("call failed", request_id=self.call.request_id,
                                 session_id=self.call.session_id, worker=worker)
            if not self.started:
                await self._send_error(GatewayError(500, "internal error in the gateway", INTERNAL))
        finally:
            # No shield needed here: closing does not wait, and _account shields itself.
            if response is not None:
                response.close()
            if self.admitted is not None and not self.accounted:
                await self._account(None)

    async def _admit_and_open(self) -> tuple[str, RelayResponse] | None:
        """Admit the call and open it on its worker. A call the worker never received (it
        refused the connection) is placed again, at most once per worker, and a worker that
        could not be connected to at all is taken out at once. None when the client has its
        answer already."""
        parts = self.g.parts
        first_id = self.call.request_id
        last_error: GatewayError | None = None
        for attempt in range(len(parts.workers.states) + 1):
            if not parts.workers.can_take_calls():
                # Nothing to hold for: answer now and let the client retry. (A worker whose
                # capacity is still unknown is healthy, and one asleep will be woken: calls
                # wait for them.)
                await self._send_error(last_error or GatewayError(
                    503, "no healthy worker: every worker fails its health checks", UNAVAILABLE,
                    retry_after_s=self.g.config.limits.retry_after_s))
                return None
            if attempt:
                self.call = dataclasses.replace(self.call, request_id=f"{first_id}-{attempt}")
                self.admitted, self.accounted = None, False
            try:
                self.admitted = await parts.admission.arrive(self.call)
            except GatewayError as err:
                await self._send_error(err)
                return None
            except Exception:
                self.g.log.exception("admission failed", request_id=self.call.request_id,
                                     session_id=self.call.session_id)
                await self._send_error(GatewayError(500, "internal error while admitting the call",
                                                    INTERNAL))
                return None
            if self.admitted.held_s > 0:
                parts.metrics.hold_seconds.observe(self.admitted.held_s)
            worker = self.admitted.worker
            headers = forward_headers(self.raw_headers_in, self.call.session_id,
                                      self.g.forwards_client_priority)
            content = self.content
            if self.sends_priority and parts.pool.takes_priority(worker):
                # this worker's treatment (a call placed again may land on another kind)
                content = with_engine_priority(content, self.admitted.engine_priority)
            self.sent_upstream_at = self.g.clock()
            try:
                return worker, await open_upstream(parts.pool, worker, self.path, content,
                                                   headers)
            except WorkerUnreachable as err:
                await self._account(None)  # it never ran: out of the policy before it goes again
                self.g.log.warning("worker unreachable", action="placing the call again",
                                   request_id=self.call.request_id,
                                   session_id=self.call.session_id, worker=err.worker,
                                   problem=err.message, worker_down=err.worker_down)
                if err.worker_down:
                    await parts.workers.mark_unreachable(err.worker, err.message)
                last_error = err
            except GatewayError as err:
                await self._account(None)
                self.g.log.warning("upstream failed", request_id=self.call.request_id,
                                   session_id=self.call.session_id, worker=worker,
                                   status=err.status, problem=err.message)
                await self._send_error(err)
                return None
        assert last_error is not None  # the loop only runs out after refusals
        await self._send_error(last_error)
        return None

    def cut_by_drain(self) -> None:
        """The gateway's shutdown grace ran out (controller/drain.py): end the call now."""
        self.cut = True
        if self._scope is not None:
            self._scope.cancel()

    async def _relay_whole(self, response: RelayResponse, worker: str) -> None:
        try:
            body = await response.aread()
        except TransportError as err:
            await self._account(None)
            await self._send_error(transport_error(worker, err, mid_stream=True))
            return
        self.first_byte_at = self.g.clock()
        counts = UsageCounts()
        ok = 200 <= response.status_code < 300
        if ok:
            obj = decode_json(body)
            usage = find_usage(obj)
            if usage is not None:
                counts.update(usage)
            response_id = find_response_id(obj)
            if response_id is not None:
                self.g.parts.responses.put(response_id, self.call.session_id)
            answer = answer_from_body(self.answer_kind, obj) if self.answer_kind else None
            await self._account(counts, answer)
        else:
            await self._account(None)  # the worker refused it: nothing ran
            snippet = body[:ERROR_SNIPPET_BYTES].decode("utf-8", "replace").strip()
            self.error = f"worker {worker} answered {response.status_code}: {snippet}"
        headers = response_headers(response.headers)
        headers.append((b"content-length", str(len(body)).encode()))
        self.status = response.status_code
        self._observe(worker, counts if ok else None)
        self.finished = True
        self._record()
        await self._start(response.status_code, headers)
        await self._body(body, more=False)

    async def _relay_stream(self, response: RelayResponse, worker: str) -> None:
        tap = StreamTap(self.drop_usage, AnswerTap(self.answer_kind) if self.answer_kind else None)
        await self._start(response.status_code, response_headers(response.headers))
        try:
            async for chunk in response.aiter_raw():
                if self.first_byte_at is None:
                    self.first_byte_at = self.g.clock()
                out = tap.feed(chunk)
                if tap.done and not self.accounted:
                    await self._finish_stream(tap)
                if out:
                    await self._body(out)
            rest = tap.flush()
            if rest:
                await self._body(rest)
        except TransportError as err:
            error = transport_error(worker, err, mid_stream=True)
            self.error = error.message
            self.g.log.warning("upstream stream broke", request_id=self.call.request_id,
                               session_id=self.call.session_id, worker=worker, problem=error.message)
            if not self.accounted:
                await self._account(None)
            self.finished = True
            self._record()
            await self._body(error.sse_event(self.route), more=False)
            return
        if not self.accounted:
            await self._finish_stream(tap)
        self._observe(worker, tap.usage)
        self.finished = True
        self._record()
        await self._body(b"", more=False)

    async def _finish_stream(self, tap: StreamTap) -> None:
        if tap.response_id is not None:
            self.g.parts.responses.put(tap.response_id, self.call.session_id)
        await self._account(tap.usage, tap.answer.answer() if tap.answer is not None else None)

    # -- bookkeeping ------------------------------------------------------------------

    async def _account(self, counts: UsageCounts | None, answer: Answer | None = None) -> None:
        """Tell the policy how the call ended (once); shielded, so a client leaving at that
        moment cannot leave the policy thinking the call still runs. A call without identity
        that completed leaves its ``answer`` for the program's next call to carry on from,
        before the client has it."""
        if self.accounted:
            return
        self.accounted = True
        if counts is not None and self.identity.source == CONTENT_SOURCE:
            self.answered = True
            self.g.parts.conversations.answered(self.call.session_id, self.identity.chain.head,
                                                answer)
        with anyio.CancelScope(shield=True):
            admission = self.g.parts.admission
            if counts is None:
                await admission.abort(self.call.request_id)
                return
            if not counts.known:
                self.g.log.info("no usage in the response; using the estimate",
                                request_id=self.call.request_id, route=self.route)
            await admission.complete(self.call.request_id, counts.to_usage(self.identity.prompt_tokens))

    def _observe(self, worker: str, counts: UsageCounts | None) -> None:
        """Metrics of a call the worker answered (``counts`` None: it refused it)."""
        parts = self.g.parts
        now = self.g.clock()
        self.g.count_request(self.route, self.status)
        if self.sent_upstream_at is not None:
            self.g.observe_upstream(
                worker, self.stream, now - self.sent_upstream_at,
                None if self.first_byte_at is None else self.first_byte_at - self.sent_upstream_at)
        if counts is None:
            return
        usage = self.usage = counts.to_usage(self.identity.prompt_tokens)
        parts.metrics.count_usage(worker, usage.prompt_tokens, usage.cached_tokens,
                                  usage.completion_tokens)

    def _record(self) -> None:
        """Every call, however it ended, leaves a ``request_end`` record (when the request log
        is on) and a ``call done`` line: its status, and why it did not complete if it did not.
        Written once, before the call's last byte is sent (a client that reads the log after
        its answer finds the record there)."""
        self.recorded = True
        parts = self.g.parts
        now = self.g.clock()
        usage = self.usage
        held = self.admitted.held_s if self.admitted is not None else 0.0
        worker = self.admitted.worker if self.admitted is not None else None
        ttft = (self.first_byte_at - self.received) if (self.stream and self.first_byte_at) else None
        if parts.request_log.path is not None:  # else the record would be built for nothing
            extra: dict[str, Any] = {"worker": worker, "route": self.route, "stream": self.stream,
                                     "status": self.status,
                                     "identity_source": self.identity.source}
            if self.identity.group_id is not None:
                extra["group_id"] = self.identity.group_id
            if self.error is not None:
                extra["error"] = self.error
            parts.request_log.write(request_end_record(
                request_id=self.call.request_id,
                session_id=self.call.session_id,
                parent_session_id=self.call.parent_session_id,
                model=self.identity.model,
                input_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
                cached_tokens=usage.cached_tokens if usage else 0,
                received_unix_s=self.received_wall,
                total_s=now - self.received,
                ttft_s=ttft,
                queue_s=held,
                now_unix_s=self.g.wall(),
                extra=extra,
            ))
        line: dict[str, Any] = {
            "request_id": self.call.request_id, "session_id": self.call.session_id,
            "worker": worker, "route": self.route, "status": self.status, "stream": self.stream,
            "held_s": round(held, 4)}
        if usage is not None:
            line.update(prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens)
        if self.error is not None:
            line["error"] = self.error
        self.g.call_lines.info("call done", line)

    # -- ASGI -------------------------------------------------------------------------

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert self._send is not None
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, more: bool = True) -> None:
        assert self._send is not None
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send_error(self, err: GatewayError) -> None:
        if self.error is None:
            self.error = err.message
        if self.started:
            return
        body = _encode(err.body(self.route))
        self.finished = True
        self.status = err.status
        self._record()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(name.encode(), value.encode()) for name, value in err.headers().items()]
        await self._start(err.status, headers)
        await self._body(body, more=False)
        self.g.count_request(self.route, err.status)
