"""Which program a call without identity carries on (controller/conversations.py): the rules
of its docstring, one by one, and the answer readers for request turns, bodies and streams."""

from __future__ import annotations

import json

import pytest

from controller.conversations import (
    Answer,
    AnswerKey,
    AnswerTap,
    Conversations,
    answer_fingerprint,
    answer_from_body,
)
from controller.worker_answers import StreamTap
from scheduler.coordinates import ContinuationId, SessionId

GROUP = SessionId("c-opening")
OPENING = ContinuationId("head-0")


def key(prefix: str, answer: Answer) -> AnswerKey:
    return AnswerKey(ContinuationId(prefix), answer_fingerprint(answer))


def test_every_opening_call_is_a_new_program_of_its_group():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    b = conv.assign(GROUP, None, OPENING)
    assert a != b and a.startswith("c-opening-") and b.startswith("c-opening-")


def test_a_call_carrying_a_programs_last_answer_continues_it():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("hello",)))
    assert conv.assign(GROUP, key("head-0", Answer((" hel lo\n",))), ContinuationId("head-1")) == a


def test_samples_of_one_prompt_are_told_apart_by_their_answers():
    conv = Conversations()
    samples = [conv.assign(GROUP, None, OPENING) for _ in range(8)]
    for i, session in enumerate(samples):
        conv.answered(session, OPENING, Answer((), (f"call_{i}",)))
    for i in reversed(range(8)):
        assert conv.assign(GROUP, key("head-0", Answer((), (f"call_{i}",))), ContinuationId(f"h{i}")) == samples[i]


def test_of_two_programs_that_answered_alike_one_continues_and_the_other_is_new_while_busy():
    conv = Conversations()
    a, b = conv.assign(GROUP, None, OPENING), conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("same",)))
    conv.answered(b, OPENING, Answer(("same",)))
    same = key("head-0", Answer(("same",)))
    first, second = conv.assign(GROUP, same, ContinuationId("h1")), conv.assign(GROUP, same, ContinuationId("h1"))
    assert {first, second} == {a, b}
    third = conv.assign(GROUP, same, ContinuationId("h1"))  # both busy now
    assert third not in (a, b)


def test_a_call_that_would_join_a_program_with_a_call_in_flight_starts_a_new_one():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("x",)))
    assert conv.assign(GROUP, key("head-0", Answer(("x",))), ContinuationId("h1")) == a
    other = conv.assign(GROUP, key("head-0", Answer(("x",))), ContinuationId("h1"))
    assert other != a
    assert (conv.in_flight(a), conv.in_flight(other)) == (1, 1)


def test_a_call_matching_only_an_earlier_answer_of_a_program_starts_a_new_one():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("one",)))
    assert conv.assign(GROUP, key("head-0", Answer(("one",))), ContinuationId("h1")) == a
    conv.answered(a, ContinuationId("h1"), Answer(("two",)))
    fork = conv.assign(GROUP, key("head-0", Answer(("one",))), ContinuationId("h1"))
    assert fork != a


def test_a_retry_of_a_failed_call_continues_the_same_program():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("one",)))
    carried = key("head-0", Answer(("one",)))
    assert conv.assign(GROUP, carried, ContinuationId("h1")) == a
    conv.failed(a, ContinuationId("h1"))
    assert conv.assign(GROUP, carried, ContinuationId("h1")) == a


def test_a_retry_of_a_failed_first_call_continues_the_same_program_once():
    conv = Conversations()
    a, b = conv.assign(GROUP, None, OPENING), conv.assign(GROUP, None, OPENING)
    conv.failed(a, OPENING)
    assert conv.find(None, OPENING) == a  # a token count finds it without counting it
    assert conv.assign(GROUP, None, OPENING) == a
    conv.answered(b, OPENING, Answer(("b",)))
    assert conv.assign(GROUP, None, OPENING) not in (a, b)  # nothing failed is left to retry


def test_an_unreadable_answer_leaves_the_program_nothing_to_continue():
    conv = Conversations()
    a = conv.assign(GROUP, None, OPENING)
    conv.answered(a, OPENING, Answer(("x",)))
    conv.assign(GROUP, key("head-0", Answer(("x",))), ContinuationId("h1"))
    conv.answered(a, ContinuationId("h1"), None)
    assert conv.find(key("head-0", Answer(("x",))), ContinuationId("h2")) is None
    assert len(conv) == 0


def test_memory_is_bounded_and_the_oldest_answers_go_first():
    conv = Conversations(limit=3)
    sessions = []
    for i in range(5):
        s = conv.assign(GROUP, None, ContinuationId(f"o{i}"))
        conv.answered(s, ContinuationId(f"o{i}"), Answer((f"a{i}",)))
        sessions.append(s)
    assert len(conv) == 3
    assert conv.find(key("o0", Answer(("a0",))), ContinuationId("x")) is None
    assert conv.find(key("o4", Answer(("a4",))), ContinuationId("x")) == sessions[4]
    for i in range(5):
        conv.failed(conv.assign(GROUP, None, ContinuationId(f"f{i}")), ContinuationId(f"f{i}"))
    assert conv.find(None, ContinuationId("f0")) is None and conv.find(None, ContinuationId("f4"))


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit"):
        Conversations(limit=0)


# -- answers as workers give them --------------------------------------------------------------


def test_answers_are_read_from_each_apis_body():
    chat = {"choices": [{"message": {"role": "assistant", "content": "hi",
                                     "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}}]}
    assert answer_from_body("chat", chat) == Answer(("hi",), ("chatcmpl-tool-1",))
    messages = {"type": "message", "role": "assistant",
                "content": [{"type": "thinking", "thinking": "t"}, {"type": "text", "text": "a"},
                            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    assert answer_from_body("messages", messages) == Answer(("a",), ("toolu_1",))
    responses = {"object": "response", "output": [
        {"type": "reasoning", "id": "rs"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}]}
    assert answer_from_body("responses", responses) == Answer(("b",), ("call_1",))
    assert answer_from_body("chat", {"error": {"message": "no"}}) is None
    assert answer_from_body("messages", {"type": "error"}) is None
    assert answer_from_body("chat", None) is None


def sse(*events: dict, done: bool = False) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def tapped(kind: str, stream: bytes, drop_usage: bool, pieces: int = 7) -> Answer | None:
    tap = StreamTap(drop_usage, AnswerTap(kind))
    for i in range(0, len(stream), pieces):
        tap.feed(stream[i:i + pieces])
    tap.flush()
    assert tap.answer is not None
    return tap.answer.answer()


@pytest.mark.parametrize("drop_usage", [False, True])
def test_a_chat_streams_answer_is_its_deltas_and_tool_call_ids(drop_usage):
    stream = sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                 {"choices": [{"delta": {"content": "Hel"}}]},
                 {"choices": [{"delta": {"content": "lo"}}]},
                 {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                         "function": {"name": "f", "arguments": ""}}]}}]},
                 {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
                 {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, done=True)
    answer = tapped("chat", stream, drop_usage)
    assert answer_fingerprint(answer) == answer_fingerprint(Answer(("Hello",), ("call_a",)))
    assert answer.tool_ids == ("call_a",)


def test_an_anthropic_streams_answer_is_its_text_blocks_and_tool_use_ids():
    events = [{"type": "message_start", "message": {"usage": {"input_tokens": 3}}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi "}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "there"}},
              {"type": "content_block_start", "index": 1,
               "content_block": {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}},
              {"type": "content_block_delta", "index": 1,
               "delta": {"type": "input_json_delta", "partial_json": "{}"}},
              {"type": "message_stop"}]
    stream = b"".join(b"event: " + e["type"].encode() + b"\n" + sse(e) for e in events)
    answer = tapped("messages", stream, drop_usage=False)
    assert answer_fingerprint(answer) == answer_fingerprint(Answer(("Hi there",), ("toolu_9",)))


def test_a_responses_streams_answer_is_the_completed_responses_output():
    final = {"object": "response", "output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]}
    stream = sse({"type": "response.created", "response": {"output": []}},
                 {"type": "response.output_text.delta", "delta": "ok"},
                 {"type": "response.completed", "response": final})
    assert tapped("responses", stream, drop_usage=False) == Answer(("ok",), ())
    assert tapped("responses", sse({"type": "response.created", "response": {}}), False) is None


def test_without_an_answer_tap_only_the_usage_events_are_decoded(monkeypatch):
    decoded = []
    import controller.worker_answers as worker_answers
    real = worker_answers.decode_json
    monkeypatch.setattr(worker_answers, "decode_json", lambda data: decoded.append(data) or real(data))
    stream = sse({"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                 {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, done=True)
    tap = StreamTap(False)
    tap.feed(stream)
    assert len(decoded) == 1 and tap.usage.completion_tokens == 2
