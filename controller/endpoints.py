"""The gateway's endpoints (architecture.md §5.1, steps 1–2): a proxied request read and
made into a call, then relayed (controller/relay.py); the token count, the model list,
health and metrics.

A proxied request (``POST`` on one of :data:`~controller.prompt.ROUTES`), in order:

1. The body is read (``max_body_bytes``, else 413) and parsed (else 400; nested too deeply
   to parse or walk is a 400 too, as is a ``stream`` that is not a boolean:
   controller/request_body.py). Errors on ``/v1/messages``
   routes come in Anthropic's shape, elsewhere in OpenAI's (:mod:`controller.errors`).
2. Its identity is resolved (:func:`controller.identity.resolve_identity`; an invalid id is
   a 400 naming the header or field; a call without identity continues the program whose
   answer it carries, controller/conversations.py), and a ``model`` no worker serves is a
   404 (:mod:`controller.model_catalog`).
3. It becomes a :class:`~scheduler.calls.CallRequest` and goes to the relay. A request
   refused before that still writes its ``request_end`` record.

With client keys (controller/client_keys.py), a call is first authenticated (401 without a
valid key, before its body is read), its session must not be another key's (403; it becomes
the key's own when nobody's), and its key headers are not forwarded. The token count and the
model list need a key too; health and metrics do not.

``POST /v1/messages/count_tokens`` is not a call: it is relayed to one healthy worker (the
session's home worker when the session is a known program) without the policy hearing of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Mapping

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from controller.client_keys import ClientKey, ClientKeys, without_credentials
from controller.errors import (
    INTERNAL,
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    NOT_FOUND,
    UNAVAILABLE,
    GatewayError,
    error_response,
)
from controller.identity import (
    CONTENT_SOURCE,
    asgi_headers,
    Identity,
    IdentityError,
    resolve_identity,
)
from controller.logs import CallLines
from controller.parts import Parts
from controller.policy_link import LocalPolicyLink
from controller.prompt import ROUTE_MESSAGES, ROUTE_RESPONSES
from controller.relay import ProxyCall, RelayContext, RelayParts
from controller.relay_client import TransportError
from controller.request_body import (
    ClientGone,
    check_stream_flag,
    parse_json_object,
    read_asgi_body,
    read_request_body,
    too_deep,
)
from controller.request_log import request_end_record
from controller.upstream import (
    PRIORITY_KEY,
    ClientHeaders,
    forward_headers,
    open_upstream,
    prepare_body,
    response_headers,
    sends_engine_priority,
    strip_client_engine_keys,
    transport_error,
)
from scheduler.calls import CallRequest
from scheduler.coordinates import ContinuationId, SessionId

ROUTE_COUNT_TOKENS = "/v1/messages/count_tokens"

_encode = msgspec.json.Encoder().encode


class CallEndpoint:
    """The proxied routes' handler: the same in the gateway's one process and in a relay
    process, reaching shared state only through ``relay_parts.link``."""

    def __init__(self, relay_parts: RelayParts, clock: Callable[[], float],
                 wall_clock: Callable[[], float], call_lines: CallLines,
                 client_keys: ClientKeys | None = None) -> None:
        self.relay_parts = relay_parts
        self.link = relay_parts.link
        self.client_keys = client_keys  # None: clients need no key
        self.call_lines = call_lines
        self.config = relay_parts.config
        self.clock = clock
        self.wall = wall_clock
        self.log = relay_parts.log
        self.forwarded_client_keys = frozenset(self.config.forward_client_keys)
        self.forwards_client_priority = PRIORITY_KEY in self.forwarded_client_keys
        # Request ids: a random prefix per app and a counter (uuid4 per call costs more
        # than the rest of the id's uses together).
        self._id_prefix = f"sluice-{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count(1)
        # what every call it hands to the relay shares
        # which client headers the workers get (forward_client_headers; none by default)
        self.client_headers = ClientHeaders(self.config.forward_client_headers,
                                            self.forwards_client_priority)
        self._relay_context = RelayContext(relay_parts, clock, wall_clock, call_lines,
                                           self.client_headers)

    def count_request(self, route: str, status: int) -> None:
        self.relay_parts.metrics.count_request(route, status)

    # -- the proxied routes -----------------------------------------------------------

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One proxied call, as a raw ASGI app (POST on one of
        :data:`~controller.prompt.ROUTES`): read and made into a call, then relayed."""
        received, received_wall = self.clock(), self.wall()
        route = scope["path"]
        assigned: Identity | None = None  # a call without identity, counted in conversations
        client: ClientKey | None = None
        try:
            headers = asgi_headers(scope["headers"])
            try:
                client = self._authenticate(headers, route)
                body_bytes = await read_asgi_body(receive, headers, self.config.max_body_bytes)
                body = parse_json_object(body_bytes)
                check_stream_flag(body)
                lookup = await self._response_lookup(route, body)
                try:
                    identity, forward = resolve_identity(route, headers, body, lookup,
                                                         _tenant(client))
                    strip_client_engine_keys(forward, self.forwarded_client_keys)
                except RecursionError:
                    # A body that decoded just under the interpreter's limit can still be too
                    # deep to walk (identity's canonical JSON).
                    raise too_deep() from None
            except (GatewayError, IdentityError) as err:
                refusal = self._refuse(route, err)
                self._record_refused(route, refusal.status_code, str(err), None, received,
                                     received_wall)
                await refusal(scope, receive, send)
                return
            except ClientGone:
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
                identity = assigned = await self._continue_conversation(identity, client)
            try:
                stream = forward.get("stream") is True
                drop_usage = prepare_body(route, forward, identity.session_id, identity.chain.head)
                content = _encode(forward)
                sends_priority = sends_engine_priority(route, forward)
            except RecursionError:
                # ... or to encode again
                await self._conversation_failed(assigned)
                await self._refuse(route, too_deep())(scope, receive, send)
                return
            call = CallRequest(
                request_id=f"{self._id_prefix}{next(self._ids)}",
                session_id=identity.session_id,
                prompt_tokens=identity.prompt_tokens,
                parent_session_id=identity.parent_session_id,
                chain=identity.chain,
                chain_tokens=identity.chain_tokens,
                final=identity.final,
                group_id=identity.group_id,
                hints=identity.hints,
                prompt_estimated=True,  # controller/prompt.py estimate_tokens: ~4 bytes a token
            )
        except Exception as exc:
            # What Starlette's error middleware does for the other routes: nothing was sent yet.
            self.log.error("unhandled error", path=route, exc_info=exc)
            await self._conversation_failed(assigned)
            await error_response(500, "internal error in the gateway", INTERNAL,
                                 path=route)(scope, receive, send)
            return
        query = scope.get("query_string")
        path = scope.get("raw_path") or route.encode()
        if query:
            path += b"?" + query
        raw_headers = scope["headers"]
        if client is not None:
            assert self.client_keys is not None
            try:
                await self.link.claim(client.name, identity.session_id,
                                      identity.parent_session_id)
            except GatewayError as err:
                self.log.warning("session of another client key", route=route,
                                 client_key=client.name, session_id=identity.session_id,
                                 parent_session_id=identity.parent_session_id)
                await self._conversation_failed(assigned)
                refusal = self._refuse(route, err)
                self._record_refused(route, refusal.status_code, str(err), identity, received,
                                     received_wall)
                await refusal(scope, receive, send)
                return
            raw_headers = without_credentials(raw_headers)
        try:
            await ProxyCall(self._relay_context, route, path, raw_headers, call, identity,
                            content, stream, drop_usage, received, received_wall,
                            sends_priority)(receive, send)
        finally:
            if client is not None:
                with anyio.CancelScope(shield=True):
                    await self.link.call_ended(client.name, identity.session_id)

    async def _response_lookup(self, route: str, body: dict) -> Callable[[str], SessionId | None]:
        """What :func:`resolve_identity` looks a ``previous_response_id`` up with: the one
        id the body names, asked of the link before (the table may live in another process)."""
        previous = body.get("previous_response_id") if route == ROUTE_RESPONSES else None
        if not isinstance(previous, str):
            return _no_response
        found = await self.link.lookup_response(previous)
        return lambda response_id: found if response_id == previous else None

    async def _conversation_failed(self, assigned: Identity | None) -> None:
        """A call without identity that was counted in its conversation ended unanswered."""
        if assigned is not None:
            with anyio.CancelScope(shield=True):
                await self.link.conversation_ended(assigned.session_id, assigned.chain.head,
                                                   False, None)

    def _authenticate(self, headers: Mapping[str, str], route: str) -> ClientKey | None:
        """The client key a request carries; None when the gateway has no keys. A 401
        :class:`GatewayError` when it has keys and the request carries none of them (logged
        by route and reason; the key is never logged)."""
        if self.client_keys is None:
            return None
        try:
            return self.client_keys.authenticate(headers)
        except GatewayError as err:
            self.log.warning("client not authenticated", route=route, problem=err.message)
            raise

    def _record_refused(self, route: str, status: int, error: str, identity: Identity | None,
                        received: float, received_wall: float) -> None:
        """The ``request_end`` record of a request refused before it became a call (invalid,
        too large, a model nobody serves, the client gone during its upload)."""
        request_log = self.relay_parts.request_log
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

    async def _continue_conversation(self, identity: Identity,
                                     client: ClientKey | None) -> Identity:
        """A call without identity: the program whose last answer it carries on, or a new
        one of its opening's group (controller/conversations.py), counted in flight until
        the call ends. With client keys, a program another key owns is not continued: the
        call starts a new program of its own key's group instead."""
        assert identity.group_id is not None  # resolve_identity names the opening's group
        fresh = ContinuationId(f"{self._id_prefix}fresh-{next(self._ids)}")
        session = await self.link.continue_conversation(
            identity.group_id, identity.continues, identity.chain.head,
            None if client is None else client.name, fresh)
        return dataclasses.replace(identity, session_id=session)

    def _refuse(self, route: str, err: GatewayError | IdentityError) -> Response:
        """The gateway's own answer to a request it will not forward, counted by status."""
        if isinstance(err, IdentityError):
            err = GatewayError(400, str(err), INVALID_REQUEST, param=err.source)
        self.count_request(route, err.status)
        return err.response(path=route)

    async def _unknown_model(self, model: str | None) -> GatewayError | None:
        """The 404 for a model no worker serves (None when it is served, or unnamed)."""
        if model is None or await self.link.model_served(model):
            return None
        return GatewayError(404, f"the model `{model}` does not exist: no worker serves it",
                            INVALID_REQUEST, param="model", code=MODEL_NOT_FOUND)


class Endpoints(CallEndpoint):
    """The handlers of all the gateway's routes in the process that holds the policy: the
    proxied one (:class:`CallEndpoint`), the token count, the model list, health, metrics."""

    def __init__(self, parts: Parts, clock: Callable[[], float], wall_clock: Callable[[], float],
                 call_lines: CallLines, client_keys: ClientKeys | None = None) -> None:
        self.parts = parts
        self.local_link = LocalPolicyLink(parts, client_keys)
        super().__init__(RelayParts(parts.config, self.local_link, parts.pool, parts.metrics,
                                    parts.request_log, parts.drain, parts.log),
                         clock, wall_clock, call_lines, client_keys)

    async def count_tokens(self, request: Request) -> Response:
        """Relay an Anthropic token count to a worker. Not a call: it runs nothing on the
        engine worth scheduling, so the policy never hears of it (no program, no hold)."""
        route = request.url.path
        try:
            client = self._authenticate(request.headers, route)
            body = parse_json_object(await read_request_body(request, self.config.max_body_bytes))
            try:
                # Resolved as a Messages body (it is one, minus max_tokens) so it finds the
                # same session, and so the same program, as the call it prepares.
                identity, forward = resolve_identity(ROUTE_MESSAGES, request.headers, body,
                                                     self.parts.responses.get, _tenant(client))
                strip_client_engine_keys(forward, self.forwarded_client_keys)
                content = _encode(forward)
            except RecursionError:
                raise too_deep() from None
            unknown = await self._unknown_model(identity.model)
            if unknown is not None:
                raise unknown
            session = identity.session_id
            if identity.source == CONTENT_SOURCE:
                # the program the call it prepares would continue (nothing is counted)
                found = self.parts.conversations.find(identity.continues, identity.chain.head)
                if found is not None and not (client is not None
                                              and self.local_link.owned_by_another(client, found)):
                    session = found
            raw_headers = request.headers.raw
            if client is not None:
                assert self.client_keys is not None
                # nothing runs, so nothing is claimed; another key's session is still refused
                self.client_keys.check(client, session, identity.parent_session_id,
                                       self.parts.admission.policy.has_program)
                raw_headers = without_credentials(raw_headers)
            worker = self._count_tokens_worker(session)
            if worker is None:
                raise GatewayError(503, "no healthy worker: every worker fails its health checks",
                                   UNAVAILABLE)
            path = route.encode() + (b"?" + request.url.query.encode() if request.url.query else b"")
            headers = forward_headers(raw_headers, session, self.client_headers)
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

    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request.headers, request.url.path)
        except GatewayError as err:
            return self._refuse(request.url.path, err)
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


def _no_response(_response_id: str) -> SessionId | None:
    return None


def _tenant(client: ClientKey | None) -> str | None:
    """What names a client's content sessions apart from other keys' (its key's name)."""
    return client.name if client is not None else None
