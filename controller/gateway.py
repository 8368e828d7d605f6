"""The gateway's composition root: :func:`create_app` builds one OpenAI/Anthropic-compatible
proxy that admits programs from a :class:`ServeConfig`, and its lifespan starts and stops it.

Nothing is global and nothing is started until the app's lifespan starts the tick loop, the
fleet (each worker's connections, sockets, health checks, capacity probe and KV events:
controller/fleet.py) and the config watcher, and stops them again. What the app is made of
is :class:`~controller.parts.Parts` (``app.state.sluice``); its routes are the endpoints'
(controller/endpoints.py: a request read and made into a call; controller/relay.py: the
call relayed) and the admin API's (controller/admin_api.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import IO, Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from controller.admin_api import AdminApi
from controller.admission import Admission, DirectiveSink, warn_if_hold_shorter_than_wait
from controller.client_keys import load_client_keys
from controller.config_reload import ConfigReloader
from controller.directives import ZmqDirectiveSink
from controller.drain import Drain
from controller.endpoints import ROUTE_COUNT_TOKENS, Endpoints
from controller.errors import INTERNAL, INVALID_REQUEST, NOT_FOUND, error_response
from controller.fleet import Fleet, WorkerTables
from controller.identity import ResponseSessions
from controller.logs import CallLines, make_logger
from controller.metrics import Metrics
from controller.model_catalog import ModelCatalog
from controller.parts import Parts
from controller.prompt import ROUTES
from controller.request_log import RequestLog
from controller.serve_config import ServeConfig
from controller.shard_forward import ShardForwarder
from controller.subscriber import KvEventSubscriber
from controller.upstream import UpstreamPool
from controller.workers import WorkerRegistry
from controller.zmq_keys import GatewayZmqKeys
from scheduler.policies import make_policy


def create_app(config: ServeConfig, *, clock: Callable[[], float] = time.monotonic,
               wall_clock: Callable[[], float] = time.time,
               directive_sink: DirectiveSink | None = None,
               log_stream: IO[str] | None = None,
               metrics_dir: str | None = None) -> Starlette:
    """Build the gateway for ``config``. ``clock`` is the policy's (monotonic) time;
    ``wall_clock`` stamps request records and worker checks. ``metrics_dir``: the policy
    process of ``sluice serve --relays N``, whose metrics add up every process's
    (controller/metrics.py)."""
    log_stream = log_stream if log_stream is not None else sys.stderr
    log = make_logger(config.log_level, log_stream)
    policy = make_policy(config.policy)
    if directive_sink is None:
        # Retention directives to the engines' Sluice plugin (controller/directives.py)
        directive_sink = ZmqDirectiveSink(log, GatewayZmqKeys(config))
    # Client API keys (controller/client_keys.py): None when clients need none. Read before
    # anything starts, so a key source that cannot be read stops the gateway here.
    client_keys = load_client_keys(config)
    admission = Admission(policy, clock=clock, log=log, sink=directive_sink, limits=config.limits,
                          clients=client_keys)
    pool = UpstreamPool([], config.upstream)
    workers = WorkerRegistry(config, pool, admission, log, wall_clock)
    metrics = Metrics(admission, metrics_dir)
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
    endpoints = Endpoints(parts, clock, wall_clock, CallLines(config.log_level, log_stream),
                          client_keys)
    admin = AdminApi(config.resolved_admin_token(), admission, fleet, reloader, clock)
    forwarder = None if config.shards is None else ShardForwarder(
        config.shards, pool.limits, config.max_body_bytes, metrics.series_registry, log)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        request_log.open()
        parts.drain.open()
        log.info("gateway starting", policy=policy.name, workers=[w.name for w in config.workers],
                 config=str(config.path) if config.path else None)
        warn_if_hold_shorter_than_wait(log, config.limits, config.policy)
        if client_keys is not None:  # their names only: keys are never logged
            log.info("client keys required", keys=[key.name for key in client_keys.keys])
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
                if forwarder is not None:
                    await forwarder.aclose()
            request_log.close()
            parts.drain.close()
            log.info("gateway stopped")

    # Reached through Starlette's router only when the app is mounted under another one:
    # the app itself sends these POSTs straight to the relay (_SluiceApp).
    routes = [Route(path, _RelayEndpoint(endpoints), methods=["POST"]) for path in sorted(ROUTES)]
    routes += [
        Route(ROUTE_COUNT_TOKENS, endpoints.count_tokens, methods=["POST"]),
        Route("/v1/models", endpoints.models, methods=["GET"]),
        Route("/health", endpoints.health, methods=["GET"]),
        Route("/metrics", endpoints.metrics, methods=["GET"]),
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
        endpoints,
        forwarder,
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.sluice = parts
    # what the relay processes of ``sluice serve --relays N`` reach the parts through
    # (controller/policy_service.py)
    app.state.policy_link = endpoints.local_link
    return app


class _SluiceApp(Starlette):
    """Starlette, with the proxied routes' POSTs taken before its middleware and router:
    on the relay path those cost more than the rest of a call's bookkeeping, and the relay
    answers its own errors (in the route's API shape) and logs its own failures."""

    def __init__(self, endpoints: Endpoints, forwarder: ShardForwarder | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._relay = endpoints.relay
        self._forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTES:
            if self._forwarder is not None:
                owner = self._forwarder.owner(scope["headers"])
                if owner is not None:
                    await self._forwarder.forward(scope, receive, send, owner)
                    return
            await self._relay(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class _RelayEndpoint:
    """The relay as a raw ASGI endpoint of a Starlette route."""

    def __init__(self, endpoints: Endpoints) -> None:
        self._endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._endpoints.relay(scope, receive, send)
