"""The relay of one call, from admission to its last byte (architecture.md §5.1, steps 3–7).

The endpoints (controller/endpoints.py) read a request, resolve its identity and hand the
call to a :class:`ProxyCall`, which runs the rest so that it can watch for its client going
away the whole time: while held, while the worker computes, while streaming.

1. The policy admits the call now or holds it (:class:`controller.admission.Admission`); a
   held call waits without polling. A worker that refuses the connection is taken out at
   once and the call placed again, at most once per worker.
2. It is forwarded to the admitted worker with ``session_id``, ``X-Session-ID`` and
   ``vllm_xargs.continuation_id`` set (controller/upstream.py), and, to a worker whose vLLM
   runs ``--scheduling-policy priority`` (``scheduling_policy: priority``), the policy's
   ``priority`` (chat, completions, Responses; :func:`scheduler.actions.engine_priority`);
   the client's own ``priority`` and ``vllm_xargs`` keys are dropped unless
   ``forward_client_keys`` names them (a forwarded client ``priority`` goes as sent).
3. A non-streaming answer is passed on whole; a stream is passed on as it arrives (minus
   the usage chunk Sluice asked for on the client's behalf). The client leaving mid-stream
   closes the upstream request. The answer of a call without identity is read on the way
   (controller/conversations.py), as is a Responses id (controller/identity.py
   ``ResponseSessions``).
4. The real usage goes to the policy (``on_complete``; a tick follows), or, when the call
   did not complete, ``on_abort``; then its metrics, its ``request_end`` record and its
   ``call done`` line.

**Invariants** (cited where kept):

1. The policy hears how a call ended exactly once, whatever ends it (completion, a refusal,
   a failure, the shutdown drain, the client leaving): :meth:`ProxyCall._account`.
2. Every call leaves one ``request_end`` record (when the request log is on) and one
   ``call done`` line, written before its last byte is sent: :meth:`ProxyCall._record`.
3. A call without identity that did not complete is given back to its conversation, so a
   retry of it continues the same program (``Conversations.failed``).
4. What a call changes in shared state (its end, the answer its conversation continues from,
   a Responses id) is acknowledged by the policy link before the call's last byte is sent, so
   the program's next call finds it whichever relay process takes it
   (controller/policy_link.py): :meth:`ProxyCall._account`, :meth:`ProxyCall._finish_stream`,
   :meth:`ProxyCall._relay_whole`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from starlette.types import Receive, Send

from controller.admission import Admitted
from controller.conversations import Answer, AnswerTap, answer_fingerprint, answer_from_body
from controller.errors import INTERNAL, UNAVAILABLE, GatewayError
from controller.identity import CONTENT_SOURCE, Identity
from controller.logs import CallLines
from controller.drain import Drain
from controller.metrics import Metrics
from controller.policy_link import PolicyLink
from controller.request_log import RequestLog
from controller.prompt import ROUTE_CHAT, ROUTE_MESSAGES, ROUTE_RESPONSES
from controller.relay_client import RelayResponse, TransportError
from controller.request_log import request_end_record
from controller.serve_config import ServeConfig
from controller.upstream import (
    ERROR_SNIPPET_BYTES,
    ClientHeaders,
    WorkerUnreachable,
    forward_headers,
    open_upstream,
    response_headers,
    UpstreamPool,
    transport_error,
    with_engine_priority,
)
from controller.worker_answers import (
    StreamTap,
    UsageCounts,
    decode_json,
    find_response_id,
    find_usage,
)
from scheduler.calls import CallRequest, Usage

_encode = msgspec.json.Encoder().encode

# How the answer of a call without identity is read, per route (completions: no answer is
# carried back as a message, so each such call is its own program).
_ANSWER_KINDS = {ROUTE_CHAT: "chat", ROUTE_MESSAGES: "messages", ROUTE_RESPONSES: "responses"}


@dataclass(frozen=True, slots=True)
class RelayParts:
    """What relaying a call needs, the same in the gateway's one process and in each relay
    process of ``sluice serve --relays N`` (controller/relay_processes.py): the shared state
    only through ``link`` (controller/policy_link.py), the rest the process's own."""

    config: ServeConfig
    link: PolicyLink
    pool: UpstreamPool
    metrics: Metrics
    request_log: RequestLog
    drain: Drain
    log: Any


@dataclass(frozen=True, slots=True)
class RelayContext:
    """What every call one app relays shares: its parts, its clocks (the policy's monotonic
    one, and the wall clock of records), the per-call log lines."""

    parts: RelayParts
    clock: Callable[[], float]
    wall: Callable[[], float]
    call_lines: CallLines
    client_headers: ClientHeaders  # which client headers the workers get

    @property
    def config(self) -> ServeConfig:
        return self.parts.config

    @property
    def log(self) -> Any:
        return self.parts.log

    def count_request(self, route: str, status: int) -> None:
        self.parts.metrics.count_request(route, status)

    def observe_upstream(self, worker: str, stream: bool, total_s: float,
                         first_byte_s: float | None) -> None:
        self.parts.metrics.observe_upstream(worker, stream, total_s, first_byte_s)


class ProxyCall:
    """The rest of one call, run so it can watch for the client going away the whole time:
    while held, while the worker computes, while streaming."""

    __slots__ = ("ctx", "route", "path", "raw_headers_in", "call", "identity", "content", "stream",
                 "drop_usage", "received", "received_wall", "admitted", "accounted", "finished",
                 "started", "status", "sent_upstream_at", "first_byte_at", "_send", "_scope",
                 "cut", "answer_kind", "answered", "usage", "error", "recorded",
                 "sends_priority")

    def __init__(self, ctx: RelayContext, route: str, path: bytes,
                 raw_headers: list[tuple[bytes, bytes]], call: CallRequest, identity: Identity,
                 content: bytes, stream: bool, drop_usage: bool, received: float,
                 received_wall: float, sends_priority: bool) -> None:
        self.ctx = ctx
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
        drain = self.ctx.parts.drain
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
                    # (invariant 3)
                    with anyio.CancelScope(shield=True):
                        await self.ctx.parts.link.conversation_ended(
                            self.call.session_id, self.identity.chain.head, False, None)
        if self.cut and not self.finished:
            await self._end_for_shutdown()
        elif not self.finished:
            self.ctx.count_request(self.route, 499)
            self.status, self.error = 499, "the client disconnected"
            self.ctx.log.info("client disconnected", request_id=self.call.request_id,
                              session_id=self.call.session_id,
                              stage="held" if self.admitted is None else
                              ("streaming" if self.started else "upstream"))
        if not self.recorded:
            self._record()  # invariant 2, for a call its client left

    async def _end_for_shutdown(self) -> None:
        """End a call the drain cut, in a way its client can read."""
        err = GatewayError(503, "the gateway is shutting down; retry the call", UNAVAILABLE,
                           retry_after_s=self.ctx.config.limits.retry_after_s)
        self.error = err.message
        self.ctx.log.info("call cut by shutdown", request_id=self.call.request_id,
                          session_id=self.call.session_id,
                          stage="held" if self.admitted is None else
                          ("streaming" if self.started else "upstream"))
        if self.started:
            self.finished = True
            self._record()
            await self._body(err.sse_event(self.route), more=False)
            self.ctx.count_request(self.route, 503)
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
            self.ctx.log.exception("call failed", request_id=self.call.request_id,
                                   session_id=self.call.session_id, worker=worker)
            if not self.started:
                await self._send_error(GatewayError(500, "internal error in the gateway", INTERNAL))
        finally:
            # No shield needed here: closing does not wait, and _account shields itself.
            # A call admitted and not yet accounted for ends in the policy here (invariant 1).
            if response is not None:
                response.close()
            if self.admitted is not None and not self.accounted:
                await self._account(None)

    async def _admit_and_open(self) -> tuple[str, RelayResponse] | None:
        """Admit the call and open it on its worker. A call the worker never received (it
        refused the connection) is placed again, at most once per worker, and a worker that
        could not be connected to at all is taken out at once. None when the client has its
        answer already."""
        parts = self.ctx.parts
        link = parts.link
        first_id = self.call.request_id
        last_error: GatewayError | None = None
        attempt = 0
        while attempt <= link.worker_count():
            if attempt:
                self.call = dataclasses.replace(self.call, request_id=f"{first_id}-{attempt}")
                self.admitted, self.accounted = None, False
            attempt += 1
            try:
                self.admitted = await link.admit(self.call)
            except GatewayError as err:
                await self._send_error(err)
                return None
            except Exception:
                self.ctx.log.exception("admission failed", request_id=self.call.request_id,
                                       session_id=self.call.session_id)
                await self._send_error(GatewayError(500, "internal error while admitting the call",
                                                    INTERNAL))
                return None
            if self.admitted is None:
                # Nothing to hold for: answer now and let the client retry. (A worker whose
                # capacity is still unknown is healthy, and one asleep will be woken: calls
                # wait for them.)
                await self._send_error(last_error or GatewayError(
                    503, "no healthy worker: every worker fails its health checks", UNAVAILABLE,
                    retry_after_s=self.ctx.config.limits.retry_after_s))
                return None
            if self.admitted.held_s > 0:
                parts.metrics.hold_seconds.observe(self.admitted.held_s)
            worker = self.admitted.worker
            headers = forward_headers(self.raw_headers_in, self.call.session_id,
                                      self.ctx.client_headers)
            content = self.content
            if self.sends_priority and parts.pool.takes_priority(worker):
                # this worker's treatment (a call placed again may land on another kind)
                content = with_engine_priority(content, self.admitted.engine_priority)
            self.sent_upstream_at = self.ctx.clock()
            try:
                return worker, await open_upstream(parts.pool, worker, self.path, content,
                                                   headers)
            except WorkerUnreachable as err:
                await self._account(None)  # it never ran: out of the policy before it goes again
                self.ctx.log.warning("worker unreachable", action="placing the call again",
                                     request_id=self.call.request_id,
                                     session_id=self.call.session_id, worker=err.worker,
                                     problem=err.message, worker_down=err.worker_down)
                if err.worker_down:
                    await link.worker_unreachable(err.worker, err.message)
                last_error = err
            except GatewayError as err:
                await self._account(None)
                self.ctx.log.warning("upstream failed", request_id=self.call.request_id,
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
        self.first_byte_at = self.ctx.clock()
        counts = UsageCounts()
        ok = 200 <= response.status_code < 300
        if ok:
            obj = decode_json(body)
            usage = find_usage(obj)
            if usage is not None:
                counts.update(usage)
            response_id = find_response_id(obj)
            if response_id is not None:  # before the answer goes (invariant 4)
                await self.ctx.parts.link.remember_response(response_id, self.call.session_id)
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
                    self.first_byte_at = self.ctx.clock()
                out = tap.feed(chunk)
                if tap.done and not self.accounted:
                    await self._finish_stream(tap)
                if out:
                    await self._body(out)
                    if self._scope is not None and self._scope.cancel_called:
                        # The client left (or the drain cut the call) while this chunk was
                        # sent. anyio delivers the cancellation only once this task waits on
                        # something not yet done, and a worker whose answer is already
                        # buffered keeps every wait done: stop here instead of relaying the
                        # rest to nobody and counting the call complete.
                        return
            rest = tap.flush()
            if rest:
                await self._body(rest)
        except TransportError as err:
            error = transport_error(worker, err, mid_stream=True)
            self.error = error.message
            self.ctx.log.warning("upstream stream broke", request_id=self.call.request_id,
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
        if tap.response_id is not None:  # before the last byte (invariant 4)
            await self.ctx.parts.link.remember_response(tap.response_id, self.call.session_id)
        await self._account(tap.usage, tap.answer.answer() if tap.answer is not None else None)

    # -- bookkeeping ------------------------------------------------------------------

    async def _account(self, counts: UsageCounts | None, answer: Answer | None = None) -> None:
        """Tell the policy how the call ended, once (invariant 1), and wait for it to hear
        (invariant 4); shielded, so a client leaving at that moment cannot leave the policy
        thinking the call still runs. A call without identity that completed leaves its
        ``answer`` for the program's next call to carry on from, before the client has it."""
        if self.accounted:
            return
        self.accounted = True
        link = self.ctx.parts.link
        with anyio.CancelScope(shield=True):
            if counts is not None and self.identity.source == CONTENT_SOURCE:
                self.answered = True
                await link.conversation_ended(
                    self.call.session_id, self.identity.chain.head, True,
                    None if answer is None else answer_fingerprint(answer))
            if counts is None:
                await link.abort(self.call.request_id)
                return
            if not counts.known:
                self.ctx.log.info("no usage in the response; using the estimate",
                                  request_id=self.call.request_id, route=self.route)
            await link.complete(self.call.request_id, counts.to_usage(self.identity.prompt_tokens))

    def _observe(self, worker: str, counts: UsageCounts | None) -> None:
        """Metrics of a call the worker answered (``counts`` None: it refused it)."""
        parts = self.ctx.parts
        now = self.ctx.clock()
        self.ctx.count_request(self.route, self.status)
        if self.sent_upstream_at is not None:
            self.ctx.observe_upstream(
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
        Written once, before the call's last byte is sent: a client that reads the log after
        its answer finds the record there (invariant 2)."""
        self.recorded = True
        parts = self.ctx.parts
        now = self.ctx.clock()
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
                now_unix_s=self.ctx.wall(),
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
        self.ctx.call_lines.info("call done", line)

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
        self.ctx.count_request(self.route, err.status)
