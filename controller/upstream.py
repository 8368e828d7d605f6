"""Talking to the workers: pooled clients, and what is forwarded to them.

- :class:`UpstreamPool`: per worker, the relay's keep-alive pool
  (:mod:`controller.relay_client`) and an httpx client for health, capacity and models.
- :func:`forward_headers`: only the client headers ``forward_client_headers`` names (none by
  default: a client's ``Authorization``, ``Cookie``, ``x-api-key`` are the gateway's to read,
  not a worker's), less hop-by-hop ones (and any the client's ``Connection`` names);
  vLLM's ``X-Vllm-Priority`` only when the client's priority is forwarded; ``Content-Type:
  application/json`` (the body is the gateway's own encoding), ``X-Session-ID`` and
  ``Accept-Encoding: identity`` (so what comes back can be passed on byte for byte) set.
  A worker with an API key gets its own ``Authorization`` from its connections
  (:class:`UpstreamPool`), in place of any the client's.
- :func:`strip_client_engine_keys`: the client's ``priority``, ``vllm_xargs`` and engine-control
  keys (``kv_transfer_params``, ``ec_transfer_params``, ``request_id``:
  controller/serve_config.py ``ENGINE_CONTROL_KEYS``) dropped unless the config's
  ``forward_client_keys`` names them.
- :func:`prepare_body`: ``session_id`` and ``vllm_xargs.continuation_id`` set; a stream whose
  client did not ask for usage asks for it (the gateway drops that chunk again).
- :func:`sends_engine_priority` / :func:`with_engine_priority`: whether a call gets the
  policy's engine priority on a worker started with ``--scheduling-policy priority``, and the
  encoded body with it spliced in once the call is admitted (the body is encoded before
  admission; it is not encoded again).
- :func:`open_upstream`: sends, maps transport failures and 5xx to :class:`GatewayError`
  (:class:`WorkerUnreachable` when the call was never sent; a 503 that blames no worker when
  the gateway itself ran out of descriptors, buffers or memory, :func:`transport_error`).

What comes back (usage, a Responses id, the answer) is read by controller/worker_answers.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from controller.errors import (
    UPSTREAM,
    UPSTREAM_TIMEOUT,
    GatewayError,
    local_shortage,
    out_of_local_resources,
)
from controller.relay_client import (
    ConnectError,
    ConnectTimeout,
    Limits,
    RelayResponse,
    TransportError,
    WorkerConnections,
)
from controller.serve_config import ENGINE_CONTROL_KEYS, UpstreamConfig, WorkerConfig

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
# Not hop-by-hop, but replaced: the gateway sets them itself.
_REPLACED = frozenset({"accept-encoding", "x-session-id", "content-type"})
# The same, as the bytes header names arrive in (compared without decoding them per call).
_NOT_FORWARDED = frozenset(name.encode() for name in HOP_BY_HOP | _REPLACED)
_IDENTITY_ENCODING = (b"accept-encoding", b"identity")
# The body the gateway sends is its own JSON encoding, whatever the client's said; vLLM
# refuses a call whose media type is not application/json (entrypoints/serve/utils/
# api_utils.py validate_json_request).
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
# vLLM 0.32 reads a request's priority from this header before its body's ``priority``
# (entrypoints/generate/base/serving.py ``_get_priority``): the client's priority by another
# road, dropped like the body key.
PRIORITY_HEADER = b"x-vllm-priority"
# Routes whose streams carry OpenAI ``stream_options.include_usage`` chunks.
USAGE_CHUNK_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
ERROR_SNIPPET_BYTES = 2048


class ClientHeaders:
    """Which client headers go to the workers: the names and ``*`` prefixes of
    ``forward_client_headers`` (lower case), and vLLM's priority header when the client's
    priority is forwarded (``client_priority``)."""

    __slots__ = ("names", "prefixes")

    def __init__(self, named: Iterable[str] = (), client_priority: bool = False) -> None:
        named = [n.lower() for n in named]
        self.names = frozenset(n.encode("latin-1") for n in named if not n.endswith("*"))
        if client_priority:
            self.names |= {PRIORITY_HEADER}
        self.prefixes = tuple(n[:-1].encode("latin-1") for n in named if n.endswith("*"))

    def allows(self, lower: bytes) -> bool:
        return lower in self.names or (bool(self.prefixes) and lower.startswith(self.prefixes))


NO_CLIENT_HEADERS = ClientHeaders()


def forward_headers(raw: Iterable[tuple[bytes, bytes]], session_id: str,
                    client_headers: ClientHeaders = NO_CLIENT_HEADERS) -> list[tuple[bytes, bytes]]:
    """The headers the worker gets (``raw``: the client's, as ASGI gives them): those of the
    client that ``client_headers`` allows, less hop-by-hop ones and any the client's
    ``Connection`` names, then the gateway's own."""
    out: list[tuple[bytes, bytes]] = []
    named_by_connection: set[bytes] | None = None
    for name, value in raw:
        lower = name.lower()
        if lower == b"connection":
            named_by_connection = named_by_connection or set()
            named_by_connection.update(
                token.strip().lower() for token in value.split(b",") if token.strip())
            continue
        if (not client_headers.allows(lower) or lower in _NOT_FORWARDED
                or lower.startswith(b"proxy-")):
            continue
        out.append((name, value))
    if named_by_connection:
        out = [pair for pair in out if pair[0].lower() not in named_by_connection]
    out.append(_JSON_CONTENT_TYPE)
    out.append((b"x-session-id", session_id.encode("latin-1")))
    out.append(_IDENTITY_ENCODING)
    return out


# The gateway's own server adds these; the worker's would appear twice.
_SERVER_SET = frozenset({"date", "server"})
_NOT_RELAYED = frozenset(name.encode() for name in HOP_BY_HOP | _SERVER_SET)


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The worker's response headers (raw pairs, as received) as the client should see them."""
    out = []
    for name, value in raw:
        lower = name.lower()
        if lower not in _NOT_RELAYED and not lower.startswith(b"proxy-"):
            out.append((name, value))
    return out


PRIORITY_KEY = "priority"
VLLM_XARGS_KEY = "vllm_xargs"
# The routes whose vLLM 0.32 request has a ``priority`` field (entrypoints/openai/
# {chat_completion,completion,responses}/protocol.py). Its Anthropic Messages request has
# none and ignores unknown keys (entrypoints/anthropic/protocol.py): a Messages call runs at
# priority 0 there, so nothing is sent.
ENGINE_PRIORITY_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def strip_client_engine_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """Drop (in place) the client's ``priority``, ``vllm_xargs`` and engine-control keys
    (``ENGINE_CONTROL_KEYS``) that ``allowed`` (``ServeConfig.forward_client_keys``) does not
    name: they steer the engine's scheduler, cache reports, KV transfers and request ids,
    which are the gateway's and the policy's to decide. ``vllm_xargs`` in ``allowed`` keeps
    the whole object; ``vllm_xargs.<key>`` keeps that key. The client's ``vllm_xargs`` dict
    is replaced, never mutated (it may be shared with the parsed body)."""
    if PRIORITY_KEY in body and PRIORITY_KEY not in allowed:
        del body[PRIORITY_KEY]
    for key in ENGINE_CONTROL_KEYS:
        if key in body and key not in allowed:
            del body[key]
    xargs = body.get(VLLM_XARGS_KEY)
    if not isinstance(xargs, dict) or VLLM_XARGS_KEY in allowed:
        return
    kept = {key: value for key, value in xargs.items() if f"{VLLM_XARGS_KEY}.{key}" in allowed}
    if kept:
        body[VLLM_XARGS_KEY] = kept
    else:
        del body[VLLM_XARGS_KEY]


def sends_engine_priority(route: str, body: dict[str, Any]) -> bool:
    """Whether a call on ``route`` whose forwarded body is ``body`` gets the policy's engine
    priority when it goes to a ``scheduling_policy: priority`` worker: on the routes vLLM reads
    it on, unless the body carries the client's own ``priority`` (kept only when
    ``forward_client_keys`` names it: then the operator lets clients steer the engine, and the
    client's value goes as sent)."""
    return route in ENGINE_PRIORITY_ROUTES and PRIORITY_KEY not in body


def with_engine_priority(content: bytes, priority: int) -> bytes:
    """``content``, a JSON object as the relay encoded it (no ``priority`` key), with
    ``"priority": priority`` spliced in as its first key: one copy of the bytes instead of
    encoding the body again after admission (measured: 0.5 µs for a 10 KB body, 18 µs for
    500 KB, where msgspec takes 4 µs and 200 µs to encode it again)."""
    if content[:1] != b"{":
        raise ValueError("the relay's body must be an encoded JSON object")
    if content[1:2] == b"}":
        return b'{"priority":%d}' % priority
    return b"".join((b'{"priority":%d,' % priority, memoryview(content)[1:]))


def prepare_body(route: str, body: dict[str, Any], session_id: str,
                 continuation_id: str | None) -> bool:
    """Set what the worker needs on ``body`` (in place). Returns True when the gateway asked
    for stream usage on the client's behalf, so the usage chunk must be dropped."""
    body["session_id"] = session_id
    if continuation_id is not None:
        xargs = body.get("vllm_xargs")
        xargs = dict(xargs) if isinstance(xargs, dict) else {}
        xargs["continuation_id"] = continuation_id
        body["vllm_xargs"] = xargs
    if route in USAGE_CHUNK_ROUTES and body.get("stream") is True:
        options = body.get("stream_options")
        if not isinstance(options, dict) or options.get("include_usage") is not True:
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            body["stream_options"] = options
            return True
    return False


# -- the pool --------------------------------------------------------------------------------

class UpstreamPool:
    """The connections to each worker: opened by :meth:`add` when it joins the fleet, closed
    by :meth:`remove` when it leaves, and all together by :meth:`aclose` at shutdown.

    - :meth:`relay`: the relay path's keep-alive pool (:mod:`controller.relay_client`), sized
      by ``upstream.max_connections`` / ``max_keepalive_connections``.
    - :meth:`client`: one :class:`httpx.AsyncClient` per worker for the rare control calls
      (health, capacity, models), where httpx's convenience costs nothing that matters.

    A worker with an API key (``api_key_env`` / ``api_key_file``, read by :meth:`add`) gets
    ``Authorization: Bearer <key>`` on every request of both, and no other worker gets it.
    vLLM 0.32 checks it only under /v1, /v2, /inference and /cohere (entrypoints/serve/
    middleware/authenticate.py ``GUARDED_PREFIX``): calls and /v1/models, not /health nor
    /metrics; it is sent on those too, for a proxy in front of the engine that guards all.
    """

    def __init__(self, workers: Iterable[WorkerConfig], config: UpstreamConfig) -> None:
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.write_timeout_s,
            pool=config.pool_timeout_s,
        )
        limits = Limits(
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s,
            write_timeout_s=config.write_timeout_s,
            pool_timeout_s=config.pool_timeout_s,
            max_connections=config.max_connections,
            max_idle_connections=config.max_keepalive_connections,
            idle_expiry_s=config.idle_expiry_s,
        )
        self._timeout, self._limits = timeout, limits
        self._workers: dict[str, _WorkerUpstream] = {}
        for worker in workers:
            self.add(worker)

    def add(self, worker: WorkerConfig) -> None:
        """Open ``worker``'s connections; its API key is read now (a ConfigError naming
        ``api_key_env`` or ``api_key_file`` when it cannot be)."""
        if worker.name in self._workers:
            raise ValueError(f"upstream: a worker named {worker.name!r} exists already")
        api_key = worker.api_key()
        authorization = None if api_key is None else f"Bearer {api_key}"
        # trust_env=False: workers are internal addresses; a proxy from the environment
        # (HTTP_PROXY) must not sit between the gateway and its engines.
        client = httpx.AsyncClient(
            base_url=worker.url, timeout=self._timeout, trust_env=False, follow_redirects=False,
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=2),
            headers=None if authorization is None else {"Authorization": authorization},
        )
        self._workers[worker.name] = _WorkerUpstream(
            client, WorkerConnections(worker.url, self._limits, authorization),
            worker.scheduling_policy == "priority")

    @property
    def limits(self) -> Limits:
        """The relay connections' timeouts and pool sizes (``upstream:``)."""
        return self._limits

    async def remove(self, name: str) -> None:
        """Close the worker's connections (it has no call in flight: it was drained)."""
        upstream = self._workers.pop(name)
        await upstream.relay.aclose()
        await upstream.client.aclose()

    def client(self, worker: str) -> httpx.AsyncClient:
        return self._workers[worker].client

    def relay(self, worker: str) -> WorkerConnections:
        return self._workers[worker].relay

    def takes_priority(self, worker: str) -> bool:
        """Whether ``worker``'s vLLM runs ``--scheduling-policy priority`` (its config says so)."""
        upstream = self._workers.get(worker)
        return upstream is not None and upstream.takes_priority

    def names(self) -> list[str]:
        return list(self._workers)

    async def aclose(self) -> None:
        for upstream in self._workers.values():
            await upstream.relay.aclose()
        for upstream in self._workers.values():
            await upstream.client.aclose()


@dataclass(frozen=True, slots=True)
class _WorkerUpstream:
    """One worker's connections, and how its engine orders its queue."""

    client: httpx.AsyncClient  # control calls: health, capacity, models
    relay: WorkerConnections  # the relay path's keep-alive pool
    takes_priority: bool  # its vLLM runs --scheduling-policy priority (scheduling_policy)


class WorkerUnreachable(GatewayError):
    """The call was never sent: the worker refused the connection (or did not accept it in
    time, or none of its connections came free). The gateway may place it elsewhere."""

    def __init__(self, worker: str, status: int, message: str, type_: str,
                 worker_down: bool = False) -> None:
        super().__init__(status, message, type_)
        self.worker = worker
        # No connection could be made at all (refused, or connecting timed out), as
        # opposed to a pool with no free connection: the worker itself is down.
        self.worker_down = worker_down


def transport_error(worker: str, err: TransportError, mid_stream: bool = False) -> GatewayError:
    """A failure to talk to ``worker`` as the client should see it (502 or 504); a
    :class:`WorkerUnreachable` when the request provably never left; a 503 that blames no
    worker when the gateway itself ran out of descriptors, buffers or memory."""
    shortage = local_shortage(err)
    if shortage is not None:
        # The gateway's own shortage (say EMFILE on connect): the worker is not down, and
        # placing the call elsewhere would fail the same way, so neither happens.
        doing = f"talking to worker {worker}" if err.sent else f"connecting to worker {worker}"
        return out_of_local_resources(doing, shortage)
    detail = str(err) or type(err).__name__
    if err.timeout:
        status, type_ = 504, UPSTREAM_TIMEOUT
        message = f"worker {worker} did not answer in time ({type(err).__name__}: {detail})"
    elif mid_stream:
        status, type_ = 502, UPSTREAM
        message = f"worker {worker} broke off the response: {detail}"
    else:
        status, type_ = 502, UPSTREAM
        message = f"cannot reach worker {worker}: {detail}"
    if not err.sent:
        return WorkerUnreachable(worker, status, message, type_,
                                 worker_down=isinstance(err, (ConnectError, ConnectTimeout)))
    return GatewayError(status, message, type_)


async def open_upstream(pool: UpstreamPool, worker: str, path: bytes, content: bytes,
                        headers: list[tuple[bytes, bytes]]) -> RelayResponse:
    """POST and return the response as it streams in; transport errors and 5xx raise
    GatewayError (the 5xx response is read and closed first)."""
    try:
        response = await pool.relay(worker).request(b"POST", path, headers, content)
    except TransportError as err:
        raise transport_error(worker, err) from None
    if response.status_code >= 500:
        try:
            body = await _read_snippet(response)
        except TransportError:
            body = b""
        finally:
            await response.aclose()
        text = body.decode("utf-8", "replace").strip() or "(empty body)"
        raise GatewayError(
            502, f"worker {worker} answered {response.status_code}: {text}", UPSTREAM
        )
    return response


async def _read_snippet(response: RelayResponse) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        parts.append(chunk)
        size += len(chunk)
        if size >= ERROR_SNIPPET_BYTES:
            break
    return b"".join(parts)[:ERROR_SNIPPET_BYTES]
