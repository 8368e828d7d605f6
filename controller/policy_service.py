"""The policy process's side of ``sluice serve --relays N``: a Unix socket server that
answers the relays' asks (controller/relay_wire.py) with the process's own
:class:`~controller.policy_link.LocalPolicyLink`, and runs the requests they pass on to the
gateway's app (admin API, metrics, health, models, token counts).

**Invariants**

1. A call a relay admitted and then let go of is aborted in the policy, whichever comes
   first: the abandon or the admission (:meth:`PolicyService._abandon`).
2. A relay whose connection closes (it stopped, or died) leaves none of its calls in the
   policy: held ones are cancelled, admitted ones aborted (:meth:`PolicyService._gone`).

Asks are answered in the order their work ends: an admit waits while its call is held, and
every other ask of the same relay is answered meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.types import Message

from controller.errors import GatewayError
from controller.parts import Parts
from controller.policy_link import LocalPolicyLink
from controller import relay_wire as wire

_encode = msgspec.msgpack.Encoder().encode
_decode_ask = msgspec.msgpack.Decoder(wire.Ask).decode
_NIL = msgspec.Raw(b"\xc0")


class _RelayConnection(asyncio.Protocol):
    """One relay's connection: its frames in, its answers out."""

    def __init__(self, service: PolicyService) -> None:
        self.service = service
        self.name = "?"  # until its hello
        self.writer: wire.FrameWriter | None = None  # once connected
        self.reader = wire.FrameReader(service.frame_limit)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.writer = wire.FrameWriter(transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except wire.FrameTooLarge as err:
            self.service.log.error("relay connection closed", relay=self.name, problem=str(err))
            assert self.writer is not None
            self.writer.transport.close()
            return
        for ask_id, payload in frames:
            self.service.received(self, ask_id, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.service.gone(self)

    def send(self, ask_id: int, answer: wire.Answer) -> None:
        assert self.writer is not None  # answers follow asks, which follow the connection
        self.writer.write(ask_id, _encode(answer))


class PolicyService:
    """Serves the relays' asks on the Unix socket at ``path`` until :meth:`aclose`."""

    def __init__(self, parts: Parts, link: LocalPolicyLink, app: Callable[..., Any],
                 path: str, frame_limit: int) -> None:
        self._parts = parts
        self._link = link
        self._app = app
        self.path = path
        self.frame_limit = frame_limit
        self.log = parts.log
        self._server: asyncio.AbstractServer | None = None
        # (relay, request id) -> the task admitting it; admitted calls stay until they end
        self._arrivals: dict[tuple[_RelayConnection, str], asyncio.Task] = {}
        self._admitted: dict[_RelayConnection, set[str]] = {}  # relay -> its admitted calls
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _RelayConnection(self), self.path)

    def received(self, relay: _RelayConnection, ask_id: int, payload: bytes) -> None:
        try:
            ask = _decode_ask(payload)
        except msgspec.ValidationError as err:  # a relay of another version: say so loudly
            self.log.error("relay ask not understood", relay=relay.name, problem=str(err))
            return
        if isinstance(ask, wire.Abandon):
            self._spawn(self._abandon(relay, ask.request_id))
            return
        if isinstance(ask, wire.Hello):
            relay.name = ask.relay
            relay.send(ask_id, wire.Answer())
            return
        task = self._spawn(self._answer(relay, ask_id, ask))
        if isinstance(ask, wire.Admit):
            self._arrivals[(relay, ask.call.request_id)] = task

    def _spawn(self, work: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _answer(self, relay: _RelayConnection, ask_id: int, ask: Any) -> None:
        try:
            value = await self._serve(relay, ask)
            answer = wire.Answer(_NIL if value is None else msgspec.Raw(_encode(value)))
        except GatewayError as err:
            answer = wire.Answer(refusal=wire.Refusal(err.status, err.message, err.type, err.param,
                                            err.code, err.retry_after_s))
        except asyncio.CancelledError:
            if isinstance(ask, wire.Admit):
                return  # abandoned, or its relay is gone: nobody waits for an answer
            raise
        except Exception as err:
            self.log.exception("relay ask failed", ask=type(ask).__name__, relay=relay.name)
            answer = wire.Answer(refusal=wire.Refusal(
                500, f"internal error in the policy process: {err}", "server_error"))
        relay.send(ask_id, answer)

    async def _serve(self, relay: _RelayConnection, ask: Any) -> Any:
        link = self._link
        if isinstance(ask, wire.Admit):
            key = (relay, ask.call.request_id)
            try:
                admitted = await link.admit(ask.call)
            finally:
                self._arrivals.pop(key, None)
            if admitted is not None:
                self._admitted.setdefault(relay, set()).add(ask.call.request_id)
            record = None if admitted is None else self._parts.fleet.records.get(admitted.worker)
            url = None if record is None else record.config.url
            return wire.AdmitAnswer(admitted, url, link.worker_count())
        if isinstance(ask, wire.Complete):
            self._ended(relay, ask.request_id)
            return await link.complete(ask.request_id, ask.usage)
        if isinstance(ask, wire.Abort):
            self._ended(relay, ask.request_id)
            return await link.abort(ask.request_id)
        if isinstance(ask, wire.Unreachable):
            return await link.worker_unreachable(ask.worker, ask.problem)
        if isinstance(ask, wire.ModelServed):
            return await link.model_served(ask.model)
        if isinstance(ask, wire.LookupResponse):
            return await link.lookup_response(ask.response_id)
        if isinstance(ask, wire.RememberResponse):
            return await link.remember_response(ask.response_id, ask.session_id)
        if isinstance(ask, wire.ContinueConversation):
            return await link.continue_conversation(ask.group, ask.continues, ask.head,
                                                    ask.client, ask.fresh_head)
        if isinstance(ask, wire.ConversationEnded):
            return await link.conversation_ended(ask.session_id, ask.head, ask.answered,
                                                 ask.fingerprint)
        if isinstance(ask, wire.Claim):
            return await link.claim(ask.client, ask.session_id, ask.parent_id)
        if isinstance(ask, wire.CallEnded):
            return await link.call_ended(ask.client, ask.session_id)
        if isinstance(ask, wire.WorkerEndpoint):
            record = self._parts.fleet.records.get(ask.worker)
            return None if record is None else record.config.model_dump(mode="json")
        if isinstance(ask, wire.HttpRequest):
            return await self._http(ask)
        raise TypeError(f"no handler for {type(ask).__name__}")

    def _ended(self, relay: _RelayConnection, request_id: str) -> None:
        calls = self._admitted.get(relay)
        if calls is not None:
            calls.discard(request_id)

    async def _abandon(self, relay: _RelayConnection, request_id: str) -> None:
        """Keeps invariant 1: a held admit is cancelled (Admission aborts it as it unwinds);
        an admit that won already is aborted like a call that ended without running."""
        task = self._arrivals.get((relay, request_id))
        if task is not None and not task.done():
            task.cancel()
            return
        calls = self._admitted.get(relay)
        if calls is not None and request_id in calls:
            calls.discard(request_id)
            await self._link.abort(request_id)

    def gone(self, relay: _RelayConnection) -> None:
        """Keeps invariant 2 (the connection closed)."""
        self._spawn(self._gone(relay))

    async def _gone(self, relay: _RelayConnection) -> None:
        held = [task for (owner, _), task in self._arrivals.items() if owner is relay]
        for task in held:
            task.cancel()
        left = self._admitted.pop(relay, set())
        for request_id in left:
            await self._link.abort(request_id)
        if held or left:
            self.log.warning("relay gone; its calls aborted in the policy", relay=relay.name,
                             held=len(held), calls=len(left))

    async def _http(self, ask: wire.HttpRequest) -> wire.HttpAnswer:
        """Run ``ask`` through the gateway's app, as uvicorn would, and answer it whole."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": ask.method, "scheme": "http", "path": ask.path,
            "raw_path": ask.path.encode(), "query_string": ask.query, "root_path": "",
            "headers": ask.headers, "client": ask.client, "server": None,
        }
        sent = False
        finished = asyncio.Event()

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": ask.body, "more_body": False}
            await finished.wait()
            return {"type": "http.disconnect"}

        answer = wire.HttpAnswer(500, [], b"")
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    finished.set()

        await self._app(scope, receive, send)
        finished.set()
        answer.body = b"".join(chunks)
        return answer

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
