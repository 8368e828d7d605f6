"""A call for another shard, forwarded once to the gateway that owns it (`shards:`).

K gateways, each with its own workers and policy (docs/architecture.md §8), may sit behind a
balancer that knows nothing of programs: round robin, a Kubernetes Service, DNS. Each
gateway is given the same list of all K (``shards.gateways``, in the same order everywhere)
and its own place in it (``shards.index``). A proxied call whose program's root session
(:func:`controller.identity.shard_key`) hashes to another gateway
(:func:`scheduler.rendezvous.rendezvous_shard`: the hash of the Ray Serve router and of
``sluice sim --shards``) is sent there as it came, with ``x-sluice-forwarded`` naming the
sender, and the answer is streamed back as it arrives. A call that carries that header is
served where it lands: no call travels twice, whatever two gateways think of the list.

Behind an ingress that hashes the same way (Ray Serve's ShardRouter) nothing is forwarded;
behind nginx's ``hash ... consistent`` (ketama, another hash) about (K−1)/K of the programs
are, on each of their calls, so there the gateways run without ``shards:``.

Only the proxied routes are forwarded; everything else (the admin API, ``/metrics``,
``/health``, ``/v1/models``, ``count_tokens``) is this gateway's own. The owner checks the
call as any other (client keys, body, identity); this gateway reads the body within
``max_body_bytes`` and nothing more. A gateway that cannot be reached gets the call a 502
``shard_unreachable`` with ``Retry-After``; one that breaks off an answer mid-stream, a
stream's error event (what the relay sends when a worker does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter
from starlette.types import Receive, Scope, Send

from controller.errors import UPSTREAM, GatewayError
from controller.identity import asgi_headers, shard_key
from controller.relay_client import (
    ConnectError,
    ConnectTimeout,
    Limits,
    PoolTimeout,
    RelayResponse,
    TransportError,
    WorkerConnections,
)
from controller.request_body import ClientGone, read_asgi_body
from controller.shards_config import ShardsConfig
from controller.upstream import HOP_BY_HOP, response_headers
from scheduler.rendezvous import rendezvous_shard

FORWARDED_HEADER_NAME = "x-sluice-forwarded"
FORWARDED_HEADER = FORWARDED_HEADER_NAME.encode()
SHARD_UNREACHABLE = "shard_unreachable"
UNREACHABLE_RETRY_AFTER_S = 5
_NOT_FORWARDED = frozenset(name.encode() for name in HOP_BY_HOP) | {FORWARDED_HEADER}


def _forwarded_headers(raw: Iterable[tuple[bytes, bytes]], sender: int) -> list[tuple[bytes, bytes]]:
    """The client's headers as the owner should get them: all of them (its key included:
    the owner checks it), less the connection's own, plus who forwarded the call."""
    out = [(name, value) for name, value in raw if name.lower() not in _NOT_FORWARDED]
    out.append((FORWARDED_HEADER, str(sender).encode()))
    return out


async def _cancel_when_client_leaves(receive: Receive, scope: anyio.CancelScope) -> None:
    # the body was read to its end: what ASGI delivers next is the disconnect
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class ShardForwarder:
    """Which gateway owns a call, and the forwarding of those this one does not own."""

    def __init__(self, config: ShardsConfig, limits: Limits, max_body_bytes: int,
                 registry: CollectorRegistry | None, log: Any) -> None:
        self.index = config.index
        self.gateways = config.gateways
        self._max_body_bytes = max_body_bytes
        self._log = log
        self._peers = {shard: WorkerConnections(url, limits) for shard, url in enumerate(self.gateways)
                       if shard != self.index}
        self._forwards = Counter(
            "sluice_shard_forwards", "Calls forwarded to the gateway that owns their program, by "
            "its shard and outcome (answered, unreachable, broken).", ["shard", "outcome"],
            registry=registry)

    def owner(self, raw_headers: Iterable[tuple[bytes, bytes]]) -> int | None:
        """The shard to forward the call to; None when this gateway serves it (it owns the
        program, or the call was forwarded to it already)."""
        headers = asgi_headers(raw_headers)
        if FORWARDED_HEADER_NAME in headers:
            return None
        shard = rendezvous_shard(shard_key(headers), len(self.gateways))
        return None if shard == self.index else shard

    async def forward(self, scope: Scope, receive: Receive, send: Send, shard: int) -> None:
        route = scope["path"]
        raw = scope["headers"]
        try:
            declared = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw
                        if name.lower() == b"content-length"}
            body = await read_asgi_body(receive, declared, self._max_body_bytes)
        except ClientGone:
            return
        except GatewayError as err:
            await err.response(path=route)(scope, receive, send)
            return
        path = scope.get("raw_path") or route.encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        url = self.gateways[shard]
        try:
            answer = await self._peers[shard].request(b"POST", path, _forwarded_headers(raw, self.index), body)
        except TransportError as err:
            self._forwards.labels(str(shard), "unreachable").inc()
            self._log.warning("shard unreachable", shard=shard, gateway=url, route=route,
                              problem=str(err) or type(err).__name__)
            unsent = isinstance(err, (ConnectError, ConnectTimeout, PoolTimeout))
            await GatewayError(
                502, f"the Sluice gateway that owns this program (shard {shard}) "
                f"{'could not be reached' if unsent else 'did not answer'}: "
                f"{str(err) or type(err).__name__}; retry shortly", UPSTREAM, code=SHARD_UNREACHABLE,
                retry_after_s=UNREACHABLE_RETRY_AFTER_S).response(path=route)(scope, receive, send)
            return
        try:
            async with anyio.create_task_group() as relaying:
                # A client that leaves stops the relay, and closing the owner's answer unread
                # makes the owner abort the call (it sees its client gone) rather than compute
                # it for nobody.
                relaying.start_soon(_cancel_when_client_leaves, receive, relaying.cancel_scope)
                await self._relay_answer(answer, send, shard, url, route)
                relaying.cancel_scope.cancel()
        finally:
            answer.close()

    async def _relay_answer(self, answer: RelayResponse, send: Send, shard: int, url: str,
                            route: str) -> None:
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": response_headers(answer.headers)})
        try:
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TransportError as err:
            self._forwards.labels(str(shard), "broken").inc()
            self._log.warning("shard broke off an answer", shard=shard, gateway=url, route=route,
                              problem=str(err) or type(err).__name__)
            broken = GatewayError(502, f"the Sluice gateway that owns this program (shard "
                                  f"{shard}) broke off the answer: {str(err) or type(err).__name__}",
                                  UPSTREAM, code=SHARD_UNREACHABLE)
            is_stream = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                            for name, value in answer.headers)
            await send({"type": "http.response.body", "more_body": False,
                        "body": broken.sse_event(route) if is_stream else b""})
            return
        self._forwards.labels(str(shard), "answered").inc()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def aclose(self) -> None:
        for peer in self._peers.values():
            await peer.aclose()
