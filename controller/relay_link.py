"""A relay process's :class:`~controller.policy_link.PolicyLink`: each method an ask to the
policy process over its Unix socket (controller/relay_wire.py; the policy's side is
controller/policy_service.py).

One connection per relay; its first ask is a hello with the relay's name. Answers come back
on it, matched to their asks by id. An ask the policy process does not answer within
``ask_timeout_s`` (an admit: within ``limits.max_hold_s`` more), or that is waiting when the
connection closes, fails the call with a 503: the relay never waits forever on a process
that is gone.

The relay's own connections to the workers are opened as the policy first admits a call to
each (its config asked once, and again when the worker comes back at another address).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import msgspec

from controller.admission import Admitted
from controller.conversations import AnswerKey
from controller.errors import UNAVAILABLE, GatewayError
from controller import relay_wire as wire
from controller.serve_config import WorkerConfig
from controller.upstream import UpstreamPool
from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import ContinuationId, SessionId

# How long an ask other than an admit may go unanswered before the call fails.
ASK_TIMEOUT_S = 30.0
# How long a relay takes the policy's word that a model is served without asking again: the
# model catalog's own refresh interval (controller/model_catalog.py), so a relay's answer is
# never staler than the catalog's. A model not served is asked about every time.
MODEL_SERVED_S = 2.0

_encode = msgspec.msgpack.Encoder().encode
_decode_answer = msgspec.msgpack.Decoder(wire.Answer).decode
_decode_admit = msgspec.msgpack.Decoder(wire.AdmitAnswer).decode
_decode_http = msgspec.msgpack.Decoder(wire.HttpAnswer).decode
_decode_bool = msgspec.msgpack.Decoder(bool).decode
_decode_session = msgspec.msgpack.Decoder(SessionId | None).decode
_decode_any = msgspec.msgpack.Decoder().decode


class PolicyGone(GatewayError):
    """The policy process did not answer in time."""

    def __init__(self, what: str, retry_after_s: int) -> None:
        super().__init__(503, f"the gateway's policy process did not answer ({what}); retry "
                         "the call", UNAVAILABLE, retry_after_s=retry_after_s)


class _PolicyConnection(asyncio.Protocol):
    def __init__(self, link: RemotePolicyLink, frame_limit: int) -> None:
        self._link = link
        self._reader = wire.FrameReader(frame_limit)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except wire.FrameTooLarge as err:
            self._link.lost(str(err))
            return
        for ask_id, payload in frames:
            self._link.answered(ask_id, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._link.lost("its connection closed" if exc is None else str(exc))


class RemotePolicyLink:
    """The policy process, as a relay reaches it. :meth:`open` before the first ask."""

    def __init__(self, path: str, relay_name: str, pool: UpstreamPool, log: Any, *,
                 max_hold_s: float, retry_after_s: int, frame_limit: int,
                 ask_timeout_s: float = ASK_TIMEOUT_S) -> None:
        self._path = path
        self._name = relay_name
        self._pool = pool
        self._log = log
        self._admit_timeout_s = max_hold_s + ask_timeout_s
        self._ask_timeout_s = ask_timeout_s
        self._retry_after_s = retry_after_s
        self._frame_limit = frame_limit
        self._writer: wire.FrameWriter | None = None  # once connected
        self._gone: str | None = None  # why the connection is gone, once it is
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[bytes]] = {}
        self._worker_count = 0
        self._worker_urls: dict[str, str] = {}  # the workers the pool has, at their addresses
        self._worker_locks: dict[str, asyncio.Lock] = {}
        self._served_until: dict[str, float] = {}  # model -> until when it counts as served

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_unix_connection(
                lambda: _PolicyConnection(self, self._frame_limit), self._path)
        except OSError as err:
            raise PolicyGone(f"cannot connect to {self._path}: {err}",
                             self._retry_after_s) from None
        self._writer = wire.FrameWriter(transport)
        await self._ask(wire.Hello(self._name), "hello")

    async def aclose(self) -> None:
        if self._gone is None:
            self._gone = "the relay closed it"  # its own doing: nothing to report
        if self._writer is not None:
            self._writer.transport.close()

    def answered(self, ask_id: int, payload: bytes) -> None:
        future = self._waiting.pop(ask_id, None)
        if future is not None and not future.done():
            future.set_result(payload)

    def lost(self, why: str) -> None:
        """The connection is gone: every ask waiting, and every later one, fails."""
        if self._gone is None:
            self._gone = why
            self._log.error("connection to the policy process lost", problem=why)
        if self._writer is not None:
            self._writer.transport.close()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(PolicyGone(why, self._retry_after_s))

    async def _ask(self, ask: Any, what: str, timeout_s: float | None = None) -> msgspec.Raw:
        """Send ``ask`` and wait for its answer's value; a refusal raises its GatewayError."""
        writer = self._writer
        if self._gone is not None or writer is None:
            raise PolicyGone(self._gone or "not connected", self._retry_after_s)
        loop = asyncio.get_running_loop()
        ask_id = next(self._ids)
        future: asyncio.Future[bytes] = loop.create_future()
        self._waiting[ask_id] = future
        # a timer rather than asyncio.wait_for: a handle costs less than a task per ask
        timer = loop.call_later(timeout_s or self._ask_timeout_s, _expire, future)
        try:
            writer.write(ask_id, _encode(ask))
            payload = await future
        except TimeoutError:
            raise PolicyGone(what, self._retry_after_s) from None
        finally:
            timer.cancel()
            self._waiting.pop(ask_id, None)
        answer = _decode_answer(payload)
        if answer.refusal is not None:
            r = answer.refusal
            raise GatewayError(r.status, r.message, r.type, r.param, r.code, r.retry_after_s)
        return answer.value

    # -- PolicyLink ---------------------------------------------------------------------

    def worker_count(self) -> int:
        return self._worker_count

    async def admit(self, call: CallRequest) -> Admitted | None:
        try:
            value = await self._ask(wire.Admit(call), "admit", self._admit_timeout_s)
        except GatewayError as err:
            if not isinstance(err, PolicyGone):
                raise  # refused: the policy keeps nothing of the call
            self._abandon(call)
            raise
        except BaseException:
            # The client left, the drain cut the call, or no answer came: the policy must not
            # keep it (controller/policy_service.py aborts it, held or admitted).
            self._abandon(call)
            raise
        answer = _decode_admit(value)
        self._worker_count = answer.worker_count
        admitted = answer.admitted
        if admitted is not None and answer.worker_url is not None:
            await self._connect(admitted.worker, answer.worker_url)
        return admitted

    def _abandon(self, call: CallRequest) -> None:
        # Sent without waiting, so it goes even from a cancelled task; no answer comes.
        writer = self._writer
        if writer is not None and not writer.transport.is_closing():
            writer.write(wire.NO_ANSWER, _encode(wire.Abandon(call.request_id)))

    async def _connect(self, worker: str, url: str) -> None:
        """Open the relay's connections to ``worker`` at ``url`` if they are not open yet."""
        if self._worker_urls.get(worker) == url:
            return
        lock = self._worker_locks.setdefault(worker, asyncio.Lock())
        async with lock:
            if self._worker_urls.get(worker) == url:
                return
            found = _decode_any(await self._ask(wire.WorkerEndpoint(worker), "worker"))
            if found is None:
                raise GatewayError(503, f"worker {worker} left the fleet; retry the call",
                                   UNAVAILABLE, retry_after_s=self._retry_after_s)
            config = WorkerConfig.model_validate(found)
            if worker in self._worker_urls:
                await self._pool.remove(worker)
                del self._worker_urls[worker]
            self._pool.add(config)
            self._worker_urls[worker] = config.url

    async def complete(self, request_id: str, usage: Usage) -> None:
        await self._ask(wire.Complete(request_id, usage), "complete")

    async def abort(self, request_id: str) -> None:
        await self._ask(wire.Abort(request_id), "abort")

    async def worker_unreachable(self, worker: str, problem: str) -> None:
        await self._ask(wire.Unreachable(worker, problem), "worker unreachable")

    async def model_served(self, model: str) -> bool:
        now = time.monotonic()
        if self._served_until.get(model, 0.0) > now:
            return True
        served = _decode_bool(await self._ask(wire.ModelServed(model), "model"))
        if served:
            if len(self._served_until) >= 1024:  # names clients made up cannot grow it
                self._served_until.clear()
            self._served_until[model] = now + MODEL_SERVED_S
        return served

    async def lookup_response(self, response_id: str) -> SessionId | None:
        return _decode_session(await self._ask(wire.LookupResponse(response_id), "response id"))

    async def remember_response(self, response_id: str, session_id: SessionId) -> None:
        await self._ask(wire.RememberResponse(response_id, session_id), "response id")

    async def continue_conversation(self, group: SessionId, continues: AnswerKey | None,
                                    head: ContinuationId, client: str | None,
                                    fresh_head: ContinuationId) -> SessionId:
        ask = wire.ContinueConversation(group, continues, head, client, fresh_head)
        value = await self._ask(ask, "conversation")
        session = _decode_session(value)
        assert session is not None
        return session

    async def conversation_ended(self, session_id: SessionId, head: ContinuationId,
                                 answered: bool, fingerprint: str | None) -> None:
        await self._ask(wire.ConversationEnded(session_id, head, answered, fingerprint),
                        "conversation")

    async def claim(self, client: str, session_id: SessionId,
                    parent_id: SessionId | None) -> None:
        await self._ask(wire.Claim(client, session_id, parent_id), "client key")

    async def call_ended(self, client: str, session_id: SessionId) -> None:
        await self._ask(wire.CallEnded(client, session_id), "client key")

    # -- the routes the relay passes on --------------------------------------------------

    async def http(self, request: wire.HttpRequest) -> wire.HttpAnswer:
        return _decode_http(await self._ask(request, f"{request.method} {request.path}"))


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
