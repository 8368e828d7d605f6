"""How the simworker's Anthropic Messages and OpenAI Responses requests become prompts
(simworker/apis.py), without a server."""

from __future__ import annotations

from array import array

import pytest

from simworker.worker import SimWorkerConfig
from simworker.apis import (
    AnthropicMessages,
    ResponseStore,
    StoredResponse,
    anthropic_chat_messages,
    response_chat_messages,
)
from sim.tokens import PromptError, PseudoTokenizer


def test_anthropic_messages_render_as_the_same_chat_conversation():
    tokenizer = PseudoTokenizer()
    anthropic = {"system": [{"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}],
                 "messages": [{"role": "user", "content": "Fix it."},
                              {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                              {"role": "user", "content": "Thanks."}]}
    chat = [{"role": "system", "content": "Be careful."}, {"role": "user", "content": "Fix it."},
            {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    render = AnthropicMessages().renderer(anthropic)
    assert render(tokenizer) == tokenizer.render_chat(chat)


def test_cache_control_markers_are_no_tokens():
    plain = {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                         "content": "ok"}]}]}
    marked = {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                          "content": "ok",
                                                          "cache_control": {"type": "ephemeral"}}]}]}
    assert anthropic_chat_messages(plain) == anthropic_chat_messages(marked)


def test_a_final_assistant_message_is_continued_not_closed():
    tokenizer = PseudoTokenizer()
    body = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}]}
    prompt = AnthropicMessages().renderer(body)(tokenizer)
    assert prompt[-len(tokenizer.encode("Hi")):] == tokenizer.encode("Hi")


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0"),
    ({"system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
])
def test_malformed_anthropic_requests_name_the_field(body, param):
    with pytest.raises(PromptError) as caught:
        anthropic_chat_messages(body)
    assert caught.value.param == param


def test_responses_items_map_to_chat_messages():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List."}]},
             {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "One file.", "annotations": []}]}]
    assert response_chat_messages(items) == [
        {"role": "user", "content": [{"type": "text", "text": "List."}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "assistant", "content": [{"type": "text", "text": "One file."}]},
    ]
    assert response_chat_messages("Hello") == [{"role": "user", "content": "Hello"}]


def test_the_response_store_forgets_the_oldest_first_and_keeps_none_at_zero():
    store = ResponseStore(2)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse(array("I", [1, 2]), None))
    assert (store.get("a"), len(store)) == (None, 2) and store.get("c") is not None
    empty = ResponseStore(0)
    empty.put("a", StoredResponse(array("I", [1]), None))
    assert len(empty) == 0


def test_a_negative_responses_kept_is_refused():
    with pytest.raises(ValueError, match="responses_kept"):
        SimWorkerConfig(responses_kept=-1)
