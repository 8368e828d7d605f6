"""A worker's answer as the relay reads it on its way to the client: the usage it reports
(in any of the APIs' shapes), its Responses id, and, for a call without identity, the answer
itself (controller/conversations.py ``AnswerTap``), from a whole body or off an SSE stream.

- :class:`UsageCounts`: the usage seen so far, later reports winning (Anthropic's
  ``message_delta`` is cumulative), and the :class:`~scheduler.calls.Usage` the policy gets.
- :func:`find_usage` / :func:`find_response_id`: where a body or stream event carries them.
- :class:`StreamTap`: watches an SSE byte stream for usage (and a Responses API id),
  passing bytes on as they arrive; in drop mode it holds back at most one unfinished event
  and removes exactly the usage-only chunk Sluice asked for on the client's behalf.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from controller.conversations import AnswerTap
from scheduler.calls import Usage

_json_decode = msgspec.json.Decoder().decode


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(slots=True)
class UsageCounts:
    """Usage seen so far; later reports win (Anthropic's message_delta is cumulative)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.prompt_tokens is not None or self.completion_tokens is not None

    def update(self, usage: Mapping[str, Any]) -> None:
        # OpenAI chat/completions: prompt_tokens, completion_tokens, prompt_tokens_details.
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        # Responses API: input_tokens (cached included), input_tokens_details.cached_tokens.
        # Anthropic: input_tokens excludes cache reads and writes, which come separately.
        if prompt is None and _int(usage.get("input_tokens")) is not None:
            cache_read = _int(usage.get("cache_read_input_tokens")) or 0
            cache_write = _int(usage.get("cache_creation_input_tokens")) or 0
            prompt = usage["input_tokens"] + cache_read + cache_write
            details = usage.get("input_tokens_details")
            if isinstance(details, dict) and _int(details.get("cached_tokens")) is not None:
                cached = details["cached_tokens"]
            elif "cache_read_input_tokens" in usage:
                cached = cache_read
        if completion is None:
            completion = _int(usage.get("output_tokens"))
        if prompt is not None and not (prompt == 0 and self.prompt_tokens):
            self.prompt_tokens = prompt
        if completion is not None:
            self.completion_tokens = completion
        if cached is not None:
            self.cached_tokens = cached

    def to_usage(self, prompt_estimate: int) -> Usage:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else prompt_estimate
        cached = min(self.cached_tokens or 0, prompt)
        return Usage(prompt, self.completion_tokens or 0, cached)


def find_usage(obj: Any) -> Mapping[str, Any] | None:
    """The usage object of a response body or stream event, in any of the API shapes."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        return usage
    for key in ("message", "response"):  # Anthropic message_start; Responses API events
        inner = obj.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]
    return None


def find_response_id(obj: Any) -> str | None:
    """The id of a Responses API response (a body, or a response.* stream event)."""
    if not isinstance(obj, dict):
        return None
    if obj.get("object") == "response" and isinstance(obj.get("id"), str):
        return obj["id"]
    inner = obj.get("response")
    if isinstance(inner, dict) and isinstance(inner.get("id"), str):
        return inner["id"]
    return None


def decode_json(data: bytes) -> Any:
    try:
        return _json_decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_SPLIT = re.compile(rb"\r\n|\n|\r")
_SCAN_LIMIT = 4 * 1024 * 1024
_RESPONSE_EVENT_WORTH_PARSING = re.compile(rb"response\.(?:created|completed|failed|incomplete)")
_END_EVENT_TYPES = frozenset({"message_stop", "response.completed", "response.failed",
                              "response.incomplete"})


def _worth_parsing(event: bytes) -> bool:
    """Whether an event may carry usage, a response id or the end marker (plain substring
    tests first: a regex over every token's event costs more than the rest of its relay)."""
    if b"usage" in event or b"[DONE]" in event or b"message_stop" in event:
        return True
    return b"response." in event and _RESPONSE_EVENT_WORTH_PARSING.search(event) is not None


def _event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one SSE event (without its terminator)."""
    parts = []
    for line in _LINE_SPLIT.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


class StreamTap:
    """Reads usage off an SSE stream while passing it on.

    Without ``drop_usage_chunk`` each chunk is returned as it came, unchanged; events are
    scanned on the side. With it, complete events are returned as soon as they are complete
    (an unfinished one waits for its end) and the first usage-only chunk — empty
    ``choices`` and a ``usage`` object, the one the gateway asked for — is left out.
    Everything else is byte-identical.
    """

    __slots__ = ("drop_usage_chunk", "dropped", "done", "usage", "response_id", "answer",
                 "_pending")

    def __init__(self, drop_usage_chunk: bool, answer: AnswerTap | None = None) -> None:
        self.drop_usage_chunk = drop_usage_chunk
        # Given, every event is decoded and fed to it (a call without identity, whose
        # answer names its program: controller/conversations.py); else only the few events
        # that may carry usage are.
        self.answer = answer
        self.dropped = False
        # The stream's end marker went by: ``data: [DONE]`` (OpenAI), ``message_stop``
        # (Anthropic), ``response.completed`` (Responses API). Usage is known by then.
        self.done = False
        self.usage = UsageCounts()
        self.response_id: str | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.drop_usage_chunk and not self._pending:
            # The usual chunk: exactly one whole event (an engine step's token).
            match = _EVENT_END.search(chunk)
            if match is not None and match.end() == len(chunk):
                if self._inspect(chunk[:match.start()]) and not self.dropped:
                    self.dropped = True
                    return b""
                return chunk
        buffer = self._pending + chunk if self._pending else chunk
        start = 0
        if not self.drop_usage_chunk:
            for match in _EVENT_END.finditer(buffer):
                self._inspect(buffer[start:match.start()])
                start = match.end()
            # Only scanned, never sent from here: a stream without event ends must not
            # grow the buffer without bound (its usage is then simply not seen).
            self._pending = buffer[start:] if len(buffer) - start <= _SCAN_LIMIT else b""
            return chunk
        kept: list[bytes] = []
        for match in _EVENT_END.finditer(buffer):
            end = match.end()
            if self._inspect(buffer[start:match.start()]) and not self.dropped:
                self.dropped = True
            else:
                kept.append(buffer[start:end])
            start = end
        self._pending = buffer[start:]
        if len(kept) == 1:
            return kept[0]
        return b"".join(kept)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an event without a terminator)."""
        rest, self._pending = self._pending, b""
        if rest:
            self._inspect(rest)
        return rest if self.drop_usage_chunk else b""

    def _inspect(self, event: bytes) -> bool:
        """Scan one event; True when it is a usage-only chunk."""
        worth = _worth_parsing(event)
        if not worth and self.answer is None:
            return False
        data = _event_data(event)
        if data is None:
            return False
        if data == b"[DONE]":
            self.done = True
            return False
        obj = decode_json(data)
        if self.answer is not None:
            self.answer.feed(obj)
            if not worth:
                return False
        if isinstance(obj, dict) and obj.get("type") in _END_EVENT_TYPES:
            self.done = True
        usage = find_usage(obj)
        if usage is not None:
            self.usage.update(usage)
        if self.response_id is None:
            self.response_id = find_response_id(obj)
        return (
            isinstance(obj, dict)
            and obj.get("choices") == []
            and isinstance(obj.get("usage"), dict)
        )
