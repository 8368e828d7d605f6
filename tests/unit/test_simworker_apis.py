"""How the simworker's Anthropic Messages and OpenAI Responses requests become prompts
(simworker/apis.py), as vLLM 0.32 converts them, without a server."""

from __future__ import annotations

import json
from array import array

import pytest

from sim.tokens import PseudoTokenizer
from simworker.anthropic_messages import AnthropicMessages, anthropic_chat_messages
from simworker.calls import BadRequest
from simworker.openai_responses import (
    OpenAIResponses,
    ResponseStore,
    StoredResponse,
    response_chat_messages,
)
from simworker.tool_calls import ToolChoice
from simworker.validation import validate_body
from simworker.worker import SimWorkerConfig

MODEL = "sluice-sim"


def checked(body: dict) -> dict:
    return validate_body("messages", {"model": MODEL, "max_tokens": 16, **body})


def test_anthropic_messages_render_as_the_same_chat_conversation():
    tokenizer = PseudoTokenizer()
    anthropic = checked({"system": [{"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}],
                         "messages": [{"role": "user", "content": "Fix it."},
                                      {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                                      {"role": "user", "content": "Thanks."}]})
    chat = [{"role": "system", "content": "Be careful."}, {"role": "user", "content": "Fix it."},
            {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    plan = AnthropicMessages(MODEL).plan(anthropic)
    assert plan.render(tokenizer) == tokenizer.render_chat(chat)
    assert plan.tools == () and plan.tool_choice == ToolChoice("none") and plan.tool_results == 0


def test_the_billing_header_is_dropped_and_system_blocks_join_without_separator():
    body = checked({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1;"},
                               {"type": "text", "text": "You are Claude Code."},
                               {"type": "text", "text": " Be brief."}],
                    "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic_chat_messages(body)[0] == {"role": "system", "content": "You are Claude Code. Be brief."}


def test_a_mid_conversation_system_message_stays_where_it_is():
    body = checked({"system": "Top.", "messages": [
        {"role": "user", "content": "one"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "two"},
        {"role": "system", "content": "x-anthropic-billing-header: skipped"},
        {"role": "user", "content": "three"}]})
    assert anthropic_chat_messages(body) == [
        {"role": "system", "content": "Top."}, {"role": "user", "content": "one"},
        {"role": "system", "content": "Reminder."}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"}]


def test_tool_use_thinking_and_tool_result_blocks_convert_as_vllm_converts_them():
    body = checked({"messages": [
        {"role": "user", "content": "List."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "ls it", "signature": "sig"},
            {"type": "redacted_thinking", "data": "zz"},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls", "timeout": 5}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.py"},
                                                                          {"type": "text", "text": "b.py"}],
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Now fix a.py."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok"}]}]})
    assert anthropic_chat_messages(body) == [
        {"role": "user", "content": "List."},
        {"role": "assistant", "reasoning": "ls it",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": "ls", "timeout": 5})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
        {"role": "user", "content": "Now fix a.py."},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "ok"}]
    assert AnthropicMessages(MODEL).plan(body).tool_results == 2


def test_cache_control_markers_are_no_tokens():
    tokenizer = PseudoTokenizer()
    tool = {"name": "bash", "input_schema": {"type": "object"}}
    plain = checked({"tools": [tool], "messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}]}]})
    marked = checked({"tools": [{**tool, "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "ok",
                                                                 "cache_control": {"type": "ephemeral"}}]}]})
    shape = AnthropicMessages(MODEL)
    assert shape.plan(plain).render(tokenizer) == shape.plan(marked).render(tokenizer)


def test_a_final_assistant_message_is_closed_as_vllm_closes_it():
    tokenizer = PseudoTokenizer()
    body = checked({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}]})
    prompt = AnthropicMessages(MODEL).plan(body).render(tokenizer)
    assert prompt == tokenizer.render_chat([{"role": "user", "content": "Say hi."},
                                            {"role": "assistant", "content": "Hi"}])


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     f"{MODEL} is not a multimodal model"),
    ({"messages": [{"role": "user", "content": []}]},
     "Cannot apply chat template to an empty conversation. Provide at least one message."),
    ({"tools": [{"name": "bash", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "edit"},
      "messages": [{"role": "user", "content": "x"}]},
     "The tool with name 'edit' is not found in the tools list."),
])
def test_what_vllms_anthropic_handler_refuses(body, message):
    with pytest.raises(BadRequest) as caught:
        AnthropicMessages(MODEL).plan(checked(body))
    assert str(caught.value) == message and caught.value.error_type == "BadRequestError"


def test_anthropic_tool_choice_maps_to_chat_and_tool_changes_apply():
    tools = [{"name": "bash", "input_schema": {"type": "object"}},
             {"name": "grep", "input_schema": {"type": "object"}, "defer_loading": True}]
    shape = AnthropicMessages(MODEL)
    user = [{"role": "user", "content": "x"}]
    assert shape.plan(checked({"tools": tools, "messages": user})).tool_choice == ToolChoice("auto")
    assert shape.plan(checked({"tools": tools, "tool_choice": {"type": "any"}, "messages": user})).tool_choice \
        == ToolChoice("required")
    plan = shape.plan(checked({"tools": tools, "messages": user}))
    assert [tool.name for tool in plan.tools] == ["bash"]  # a deferred tool is not callable yet
    added = checked({"tools": tools, "messages": [
        {"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "grep"}},
                                       {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "bash"}}]},
        *user]})
    assert [tool.name for tool in shape.plan(added).tools] == ["grep"]


def test_responses_items_map_to_chat_messages_as_vllm_maps_them():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List."}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ls"}]},
             {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "One file.", "annotations": []}]}]
    assert response_chat_messages(items) == [
        {"role": "user", "content": [{"type": "text", "text": "List."}]},
        {"role": "assistant", "reasoning": "ls",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "pwd", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "assistant", "content": "One file."},
    ]
    assert response_chat_messages("Hello") == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("item, message", [
    ({"type": "web_search_call", "id": "ws", "status": "completed"},
     "Unsupported input item type: web_search_call (parameter=input)"),
    ({"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "gAAA"},
     "Encrypted content is not supported. (parameter=input)"),
])
def test_responses_items_vllm_cannot_map_are_refused(item, message):
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        response_chat_messages([{"role": "user", "content": "x"}, item])


def test_a_responses_previous_id_that_is_unknown_is_vllms_404():
    shape = OpenAIResponses(MODEL, responses_kept=4)
    body = validate_body("responses", {"input": "x", "previous_response_id": "resp_gone"})
    with pytest.raises(BadRequest) as caught:
        shape.plan(body)
    err = caught.value
    assert (err.status, err.param, err.error_type) == (404, "response_id", "invalid_request_error")


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
