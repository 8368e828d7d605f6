"""Which program a call without any identity carries on (architecture.md §5.2, "Calls
without identity").

Clients that send no session header and no identity field (the openai-agents SDK,
mini-swe-agent, litellm, plain SDK loops: the shape of GRPO rollouts and pass@k runs) are
told apart by what they send back. A call *continues* a program when its messages extend
that program's last call plus the answer the worker gave it: the chain id before its last
assistant turn is the program's last prompt (:attr:`Identity.chain`'s head) and the turn's
fingerprint is the answer's. Everything else starts a new program:

- a call with no assistant turn (the opening of a conversation, a GRPO sample, the next
  pass@k run of the same task, a sub-agent);
- a call that matches only an earlier prefix of a program (a fork, a rerun from a turn);
- a call that would join a program with a call in flight (two samples that answered
  alike and came back at once: one joins, the other is new).

A retry of a failed call carries the same messages again, so it continues the same
program; a retry of a program's very first call (nothing answered yet) finds it by the
failed call's prompt. New programs of one opening (model, salt, system prompt, first user
message) share a *group*, named by the opening's hash; a program is the group's id with a
serial number.

**Fingerprints.** An answer is identified by the ids of its tool calls when it made any
(clients must send those ids back unchanged to pair tool results with them, and engines
make them unique per call), else by its text with all whitespace removed (clients re-indent
or trim, rarely rewrite). Reasoning and thinking blocks are left out: many clients drop
them. Readers here take an answer from a request's assistant turn (chat message, Anthropic
message, a run of Responses output items) and from a response (a body, or a stream read
event by event with :class:`AnswerTap`).

Bounded: at most ``limit`` answers and as many failed openings are remembered, oldest
dropped first; a program whose answer was dropped starts anew at its next call. Pure: no
I/O, no clock; the gateway calls :meth:`Conversations.assign` when a call arrives and
:meth:`Conversations.answered` / :meth:`Conversations.failed` when it ends.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from scheduler.coordinates import ContinuationId, SessionId

ANSWER_NAMESPACE = b"sluice.answer.v1"
DEFAULT_LIMIT = 100_000
# Responses API output item types that are not "<kind>_call" items but belong to an answer.
_OUTPUT_ITEM_TYPES = frozenset({"reasoning"})
_TEXT_PART_TYPES = frozenset({"text", "output_text"})


@dataclass(frozen=True, slots=True)
class Answer:
    """What identifies one assistant turn: its text parts and its tool calls' ids."""

    texts: tuple[str, ...] = ()
    tool_ids: tuple[str, ...] = ()


class AnswerKey(NamedTuple):
    """One assistant turn as a later call carries it: the chain id of everything before it
    and the turn's fingerprint (:func:`answer_fingerprint`)."""

    prefix: ContinuationId
    fingerprint: str


def answer_fingerprint(answer: Answer) -> str:
    """The tool-call ids when there are any, else the text without whitespace, hashed."""
    if answer.tool_ids:
        material = b"tools\x00" + "\x00".join(answer.tool_ids).encode("utf-8", "surrogatepass")
    else:
        text = "".join("".join(answer.texts).split())
        material = b"text\x00" + text.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(digest_size=16)
    h.update(ANSWER_NAMESPACE)
    h.update(material)
    return h.hexdigest()


# -- answers as requests carry them back ----------------------------------------------------


def _texts_of(content: Any) -> list[str]:
    """Text of a message's content: a string, or the text of its text parts."""
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES:
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
    return texts


def chat_answer(message: dict) -> Answer:
    """An OpenAI chat assistant message (request or response)."""
    ids = []
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        ids = [c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)]
    return Answer(tuple(_texts_of(message.get("content"))), tuple(ids))


def anthropic_answer(content: Any) -> Answer:
    """An Anthropic assistant message's content (request or response): text blocks and
    ``tool_use`` / ``server_tool_use`` ids."""
    if isinstance(content, str):
        return Answer((content,))
    texts: list[str] = []
    ids: list[str] = []
    if isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("tool_use", "server_tool_use") and isinstance(block.get("id"), str):
                ids.append(block["id"])
    return Answer(tuple(texts), tuple(ids))


def is_response_output_item(item: Any) -> bool:
    """Whether a Responses API item is (part of) an answer: an assistant message, a
    ``*_call`` item (not its ``*_call_output``) or reasoning."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type", "message")
    if kind == "message":
        return item.get("role") == "assistant"
    return isinstance(kind, str) and (kind.endswith("_call") or kind in _OUTPUT_ITEM_TYPES)


def responses_answer(items: Iterable[Any]) -> Answer:
    """A run of Responses API output items (request input or response output)."""
    texts: list[str] = []
    ids: list[str] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            texts += _texts_of(item.get("content"))
        elif isinstance(kind, str) and kind.endswith("_call"):
            call_id = item.get("call_id", item.get("id"))
            if isinstance(call_id, str):
                ids.append(call_id)
    return Answer(tuple(texts), tuple(ids))


# -- answers as workers give them -----------------------------------------------------------


def answer_from_body(route_kind: str, body: Any) -> Answer | None:
    """The answer of a whole (non-streamed) response; ``route_kind`` is ``"chat"``,
    ``"messages"`` or ``"responses"``. None when the body has none (an error, a shape not
    known)."""
    if not isinstance(body, dict):
        return None
    if route_kind == "chat":
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            if isinstance(message, dict):
                return chat_answer(message)
        return None
    if route_kind == "messages":
        if body.get("type") == "message":
            return anthropic_answer(body.get("content"))
        return None
    if route_kind == "responses":
        output = body.get("output")
        if isinstance(output, list):
            return responses_answer(i for i in output if is_response_output_item(i))
        return None
    return None


class AnswerTap:
    """Builds a streamed answer from the stream's events (each event's decoded ``data``).

    Chat: ``choices[0].delta`` content and tool calls (a tool call's id comes with its first
    delta); Anthropic: ``content_block_start`` (text, tool_use) and ``text_delta``; Responses:
    the whole response on ``response.completed`` (or ``.incomplete``).
    """

    __slots__ = ("route_kind", "_texts", "_ids", "_final")

    def __init__(self, route_kind: str) -> None:
        self.route_kind = route_kind
        self._texts: list[str] = []
        self._ids: list[str] = []
        self._final: Answer | None = None

    def feed(self, event: Any) -> None:
        if not isinstance(event, dict):
            return
        if self.route_kind == "chat":
            self._chat(event)
        elif self.route_kind == "messages":
            self._messages(event)
        elif self.route_kind == "responses":
            if event.get("type") in ("response.completed", "response.incomplete"):
                self._final = answer_from_body("responses", event.get("response"))

    def _chat(self, event: dict) -> None:
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        delta = choices[0].get("delta")
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if isinstance(content, str):
            self._texts.append(content)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    self._ids.append(call["id"])

    def _messages(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict):
                if block.get("type") == "text" and isinstance(block.get("text"), str):
                    self._texts.append(block["text"])
                elif block.get("type") in ("tool_use", "server_tool_use") and isinstance(block.get("id"), str):
                    self._ids.append(block["id"])
        elif kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                text = delta.get("text")
                if isinstance(text, str):
                    self._texts.append(text)

    def answer(self) -> Answer | None:
        if self.route_kind == "responses":
            return self._final
        return Answer(("".join(self._texts),), tuple(self._ids))


# -- which program ---------------------------------------------------------------------------


class Conversations:
    """The programs of calls without identity, by the answers they continue."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be ≥ 1, got {limit}")
        self._limit = limit
        # answer key -> programs whose last answer it is (several when two answered alike)
        self._answers: OrderedDict[AnswerKey, list[SessionId]] = OrderedDict()
        self._last: dict[SessionId, AnswerKey] = {}
        # prompt of a program's failed first call -> such programs (a retry finds them)
        self._failed_openings: OrderedDict[ContinuationId, list[SessionId]] = OrderedDict()
        self._in_flight: dict[SessionId, int] = {}
        self._serial = itertools.count(1)

    def __len__(self) -> int:
        return len(self._answers)

    def in_flight(self, session_id: SessionId) -> int:
        return self._in_flight.get(session_id, 0)

    def find(self, continues: AnswerKey | None, prompt_head: ContinuationId) -> SessionId | None:
        """The program a call would continue, without counting it (for a token count)."""
        if continues is not None:
            return self._idle_among(self._answers.get(continues))
        return self._idle_among(self._failed_openings.get(prompt_head))

    def assign(self, group: SessionId, continues: AnswerKey | None,
               prompt_head: ContinuationId) -> SessionId:
        """The program of a call that arrives (counted in flight until it ends): the one
        whose last answer it continues, or whose failed first call it retries, if that one
        has no call in flight; else a new program of ``group``."""
        session = self.find(continues, prompt_head)
        if session is None:
            session = SessionId(f"{group}-{next(self._serial)}")
        elif continues is None:
            self._drop(self._failed_openings, prompt_head, session)
        self._in_flight[session] = self._in_flight.get(session, 0) + 1
        return session

    def answered(self, session_id: SessionId, prompt_head: ContinuationId,
                 answer: Answer | None) -> None:
        """A call of ``session_id`` completed with ``answer`` to the prompt ``prompt_head``:
        the next call that carries that answer continues it. ``answer`` None (not readable)
        leaves the program without one: its next call starts a new program."""
        self.answered_as(session_id, prompt_head,
                         None if answer is None else answer_fingerprint(answer))

    def answered_as(self, session_id: SessionId, prompt_head: ContinuationId,
                    fingerprint: str | None) -> None:
        """:meth:`answered`, with the answer's fingerprint (:func:`answer_fingerprint`)
        taken where the answer was read (a relay process sends only that)."""
        self._ended(session_id)
        previous = self._last.pop(session_id, None)
        if previous is not None:
            self._drop(self._answers, previous, session_id)
        if fingerprint is None:
            return
        key = AnswerKey(prompt_head, fingerprint)
        self._answers.setdefault(key, []).append(session_id)
        self._answers.move_to_end(key)
        self._last[session_id] = key
        while len(self._answers) > self._limit:
            _, sessions = self._answers.popitem(last=False)
            for session in sessions:
                self._last.pop(session, None)

    def failed(self, session_id: SessionId, prompt_head: ContinuationId) -> None:
        """A call of ``session_id`` ended without an answer (refused, failed, cut). A program
        that has answered before keeps its last answer; one that never has is found again by
        this prompt, so that a retry of its first call continues it."""
        self._ended(session_id)
        if session_id in self._last:
            return
        sessions = self._failed_openings.setdefault(prompt_head, [])
        if session_id not in sessions:
            sessions.append(session_id)
        self._failed_openings.move_to_end(prompt_head)
        while len(self._failed_openings) > self._limit:
            self._failed_openings.popitem(last=False)

    def _ended(self, session_id: SessionId) -> None:
        left = self._in_flight.get(session_id, 0) - 1
        if left > 0:
            self._in_flight[session_id] = left
        else:
            self._in_flight.pop(session_id, None)

    def _idle_among(self, sessions: list[SessionId] | None) -> SessionId | None:
        for session in sessions or ():
            if not self._in_flight.get(session):
                return session
        return None

    @staticmethod
    def _drop(table: OrderedDict, key: Any, session_id: SessionId) -> None:
        sessions = table.get(key)
        if sessions is None:
            return
        if session_id in sessions:
            sessions.remove(session_id)
        if not sessions:
            del table[key]
