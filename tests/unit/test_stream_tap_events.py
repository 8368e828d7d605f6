"""The SSE tap when each chunk is exactly one event (how an engine's tokens arrive, and the
tap's fast path), across the event shapes of each API."""

from __future__ import annotations

import json

from controller.worker_answers import StreamTap


def _sse(obj, event: str | None = None, end: bytes = b"\n\n") -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj).encode() + end


USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}


def test_one_event_per_chunk_drops_only_the_usage_chunk_and_reads_usage():
    events = [
        _sse({"choices": [{"delta": {"content": "a"}}]}),
        _sse({"choices": [{"delta": {"content": "usage"}}]}, end=b"\r\n\r\n"),
        _sse({"choices": [], "usage": USAGE}),
        _sse({"choices": [], "usage": USAGE}),  # a second one is the worker's own: kept
        b"data: [DONE]\n\n",
    ]
    tap = StreamTap(drop_usage_chunk=True)
    out = [tap.feed(event) for event in events]
    assert out == [events[0], events[1], b"", events[3], events[4]]
    assert tap.flush() == b""
    assert (tap.usage.prompt_tokens, tap.usage.completion_tokens, tap.usage.cached_tokens) == (40, 3, 32)
    assert tap.done and tap.dropped


def test_one_event_per_chunk_sees_anthropic_and_responses_ends_and_ids():
    anthropic = StreamTap(drop_usage_chunk=True)
    for event in (_sse({"type": "message_start", "message": {"usage": {"input_tokens": 7}}}, "message_start"),
                  _sse({"type": "message_delta", "usage": {"output_tokens": 4}}, "message_delta"),
                  _sse({"type": "message_stop"}, "message_stop")):
        assert anthropic.feed(event) == event
    assert anthropic.done and anthropic.usage.completion_tokens == 4

    responses = StreamTap(drop_usage_chunk=True)
    for event in (_sse({"type": "response.created", "response": {"id": "resp_1", "object": "response"}}),
                  _sse({"type": "response.output_text.delta", "delta": "hi"}),
                  _sse({"type": "response.completed",
                        "response": {"id": "resp_1", "usage": {"input_tokens": 5, "output_tokens": 2}}})):
        assert responses.feed(event) == event
    assert responses.done and responses.response_id == "resp_1"
    assert responses.usage.completion_tokens == 2


def test_a_chunk_of_two_events_or_half_an_event_takes_the_general_path():
    first, second = _sse({"choices": [{"delta": {"content": "a"}}]}), _sse({"choices": [], "usage": USAGE})
    tap = StreamTap(drop_usage_chunk=True)
    assert tap.feed(first + second[:5]) == first
    assert tap.feed(second[5:]) == b""
    assert tap.dropped
