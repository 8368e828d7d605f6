"""The app of one relay process of ``sluice serve --relays N`` (controller/relay_processes.py).

It relays the proxied routes' calls itself — reading, identity, the upstream request and the
answer, the same :class:`~controller.endpoints.CallEndpoint` as the one-process gateway —
and reaches the policy and the shared tables through a
:class:`~controller.relay_link.RemotePolicyLink`. Every other route (admin API, metrics,
health, models, token counts) is passed whole to the policy process, which answers it with
the gateway's own app, so those answers are the same whichever relay takes the connection.
With ``shards:``, a call another shard owns is forwarded there, as by the one process.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

from starlette.types import Receive, Scope, Send

from controller.client_keys import load_client_keys
from controller.drain import Drain
from controller.endpoints import CallEndpoint
from controller.errors import GatewayError
from controller.identity import asgi_headers
from controller.logs import CallLines, make_logger
from controller.metrics import Metrics
from controller.prompt import ROUTES
from controller.relay import RelayParts
from controller.relay_link import RemotePolicyLink
from controller.relay_wire import ANSWER_LIMIT_BYTES, HttpRequest
from controller.request_body import ClientGone, read_asgi_body
from controller.request_log import RequestLog
from controller.serve_config import ServeConfig
from controller.shard_forward import ShardForwarder
from controller.upstream import UpstreamPool


class RelayApp:
    """A raw ASGI app: the proxied POSTs relayed here, the rest passed to the policy process."""

    def __init__(self, config: ServeConfig, name: str, policy_socket: str,
                 metrics_dir: str) -> None:
        log = make_logger(config.log_level, sys.stderr).bind(relay=name)
        pool = UpstreamPool([], config.upstream)
        metrics = Metrics(None, metrics_dir)
        self.link = RemotePolicyLink(policy_socket, name, pool, log,
                                     max_hold_s=config.limits.max_hold_s,
                                     retry_after_s=config.limits.retry_after_s,
                                     frame_limit=ANSWER_LIMIT_BYTES)
        # Every process appends whole records to the one file (O_APPEND: lines do not mix).
        self.parts = RelayParts(config, self.link, pool, metrics,
                                RequestLog(config.request_log, log),
                                Drain(config.shutdown_grace_s), log)
        self.calls = CallEndpoint(self.parts, time.monotonic, time.time,
                                  CallLines(config.log_level, sys.stderr, name),
                                  load_client_keys(config))
        self.forwarder = None if config.shards is None else ShardForwarder(
            config.shards, pool.limits, config.max_body_bytes, metrics.series_registry, log)
        # what controller/server.py reads to serve it, as of the gateway's app
        self.state = SimpleNamespace(sluice=self.parts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] != "http":
            return  # no WebSocket routes (uvicorn runs with ws="none")
        elif scope["method"] == "POST" and scope["path"] in ROUTES:
            if self.forwarder is not None:
                owner = self.forwarder.owner(scope["headers"])
                if owner is not None:
                    await self.forwarder.forward(scope, receive, send, owner)
                    return
            await self.calls.relay(scope, receive, send)
        else:
            await self._pass_on(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        parts = self.parts
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    parts.request_log.open()
                    parts.drain.open()
                    await self.link.open()
                except Exception as err:
                    parts.log.exception("relay failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(err)})
                    return
                parts.log.info("relay started")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.forwarder is not None:
                    await self.forwarder.aclose()
                await parts.pool.aclose()
                await self.link.aclose()
                parts.request_log.close()
                parts.drain.close()
                parts.log.info("relay stopped")
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _pass_on(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request to a route the policy process answers, passed on whole."""
        path = scope["path"]
        try:
            body = await read_asgi_body(receive, asgi_headers(scope["headers"]),
                                        self.parts.config.max_body_bytes)
            answer = await self.link.http(HttpRequest(
                scope["method"], path, scope.get("query_string", b""),
                [(bytes(k), bytes(v)) for k, v in scope["headers"]], body,
                tuple(scope["client"]) if scope.get("client") else None))
        except ClientGone:
            return
        except GatewayError as err:
            await err.response(path=path)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": answer.headers})
        await send({"type": "http.response.body", "body": answer.body, "more_body": False})
