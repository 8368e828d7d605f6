"""One corpus of requests, valid, edge and invalid, that a simworker and a real vLLM 0.32
worker must answer alike (tests/e2e/test_simworker_conformance.py), on every route.

Both servers serve the model under MODEL_NAME with a model length of MAX_MODEL_LEN tokens;
vLLM runs with ``--enable-auto-tool-choice --tool-call-parser hermes`` (what an agent
deployment runs), the simworker as its docstring says it stands for that.

Each :class:`Case` is compared on what clients act on: the status code; for an error the
envelope (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error":
{...}}``, or Starlette's ``{"detail": ...}`` for a route that is not there), its keys and its
``type``, and ``param`` unless the case says vLLM's param is
pydantic's internal path through a union (``compare_param=False``); for a success, JSON or
an event stream, and the answer's ``object`` / ``type`` or the stream's first and last
event. :data:`DIFFERENCES` are the requests where the simworker departs from vLLM on
purpose: each holds what each server answers, so the test notices if either changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 1024
# Words the tiny model's tokenizer was trained on (scripts/make_tiny_model.py), a token each
# there and in the simworker's pseudo-tokenizer: past 1,024 tokens in both, and short of
# vLLM's character bound for the tiny tokenizer (13 characters a token), which would refuse
# it before tokenizing with a message of its own.
TOO_LONG = "tool call test file code " * 240


@dataclass(frozen=True)
class Case:
    """One request: ``body`` as JSON, or ``raw`` bytes sent as they are."""

    name: str
    path: str
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    compare_param: bool = True
    why: str = ""

    @property
    def streams(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


@dataclass(frozen=True)
class Difference:
    """A request both servers answer, differently on purpose: the status each gives."""

    case: Case
    vllm_status: int
    simworker_status: int
    why: str = field(default="")


# -- shared pieces ------------------------------------------------------------------------

USER = {"role": "user", "content": "Fix the failing test in parser.py."}
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                                 "parameters": BASH_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA,
                    "cache_control": {"type": "ephemeral"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command.",
                    "parameters": BASH_SCHEMA}]
TOOL_CALL = {"id": "chatcmpl-tool-0123456789abcdef", "type": "function",
             "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}
CLAUDE_CODE_SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=0123;"},
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
]
ASSISTANT_TOOL_USE = {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "The test reads the parser.", "signature": "EqQBCkgIBxABGAIiQL"},
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_01A", "name": "bash", "input": {"command": "ls"}}]}
USER_TOOL_RESULT = {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_01A", "content": [{"type": "text", "text": "parser.py"}],
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Go on."}]}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [USER], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "def parse(text):", "max_tokens": 4, **fields}


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 4, "messages": [USER], **fields}


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "input": "Fix the failing test.", "max_output_tokens": 4, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES = ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                                                 "/v1/messages/count_tokens", "/v1/responses")

# -- the corpus -----------------------------------------------------------------------------

CASES: list[Case] = [
    # Anthropic Messages: what Claude Code 2.1 sends, then what no client should
    Case("messages: mid-conversation system message", MESSAGES, messages(messages=[
        USER, {"role": "assistant", "content": "Looking."},
        {"role": "system", "content": "<system-reminder>Todo list changed.</system-reminder>"},
        {"role": "user", "content": "Go on."}]),
        why="Claude Code 2.1, beta mid-conversation-system-2026-04-07; vLLM 0.32 merges them"),
    Case("messages: system blocks mid-conversation, ?beta=true", MESSAGES + "?beta=true", messages(
        system=CLAUDE_CODE_SYSTEM, messages=[
            USER, {"role": "system", "content": [{"type": "text", "text": "Reminder.",
                                                  "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Next."}])),
    Case("messages: only a system message", MESSAGES, messages(messages=[{"role": "system", "content": "Hi."}])),
    Case("messages: tool_use, tool_result, thinking with signature", MESSAGES, messages(
        tools=ANTHROPIC_TOOLS, messages=[USER, ASSISTANT_TOOL_USE, USER_TOOL_RESULT])),
    Case("messages: redacted thinking and an error tool_result", MESSAGES, messages(messages=[
        USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwKAhgB"},
                                                {"type": "tool_use", "id": "toolu_02", "name": "bash",
                                                 "input": {"command": "pytest"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": "boom",
                                      "is_error": True}]}], tools=ANTHROPIC_TOOLS)),
    Case("messages: cache_control on system, tools and blocks", MESSAGES, messages(
        system=CLAUDE_CODE_SYSTEM, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])),
    Case("messages: ?beta=true", MESSAGES + "?beta=true", messages()),
    Case("messages: unknown top-level fields", MESSAGES, messages(
        context_management={"edits": [{"type": "clear_thinking_20251015"}]}, betas=["x"], speed="fast")),
    Case("messages: metadata, stop_sequences, top_k, top_p, temperature", MESSAGES, messages(
        metadata={"user_id": "u-1"}, stop_sequences=["STOP"], top_k=5, top_p=0.9, temperature=0.7)),
    Case("messages: tool_choice auto without tools", MESSAGES, messages(tool_choice={"type": "auto"})),
    Case("messages: empty tools", MESSAGES, messages(tools=[])),
    Case("messages: tool_choice any", MESSAGES, messages(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})),
    Case("messages: tool_choice tool", MESSAGES, messages(tools=ANTHROPIC_TOOLS,
                                                           tool_choice={"type": "tool", "name": "bash"})),
    Case("messages: thinking adaptive", MESSAGES, messages(thinking={"type": "adaptive"})),
    Case("messages: thinking disabled", MESSAGES, messages(thinking={"type": "disabled"})),
    Case("messages: output_config effort", MESSAGES, messages(output_config={"effort": "high"})),
    Case("messages: priority is not a Messages field", MESSAGES, messages(priority=5)),
    Case("messages: stream", MESSAGES, messages(stream=True)),
    Case("messages: stream 'yes' (lax bool)", MESSAGES, messages(stream="yes")),
    Case("messages: max_tokens '4' (lax int)", MESSAGES, messages(max_tokens="4")),
    Case("messages: final assistant message", MESSAGES, messages(messages=[USER, {"role": "assistant",
                                                                                  "content": "Sure"}])),
    Case("messages: empty text content", MESSAGES, messages(messages=[{"role": "user", "content": ""}])),
    Case("messages: max_tokens 'x'", MESSAGES, messages(max_tokens="x")),
    Case("messages: max_tokens 0", MESSAGES, messages(max_tokens=0)),
    Case("messages: max_tokens past max_model_len", MESSAGES, messages(max_tokens=MAX_MODEL_LEN + 1)),
    Case("messages: messages {}", MESSAGES, messages(messages={})),
    Case("messages: no messages", MESSAGES, without(messages(), "messages")),
    Case("messages: no max_tokens", MESSAGES, without(messages(), "max_tokens")),
    Case("messages: no model", MESSAGES, without(messages(), "model")),
    Case("messages: empty model", MESSAGES, messages(model="")),
    Case("messages: unknown model", MESSAGES, messages(model="claude-opus-4-1")),
    Case("messages: empty messages", MESSAGES, messages(messages=[])),
    Case("messages: only a user message with no blocks", MESSAGES,
         messages(messages=[{"role": "user", "content": []}])),
    Case("messages: role tool", MESSAGES, messages(messages=[{"role": "tool", "content": "x"}])),
    Case("messages: message without content", MESSAGES, messages(messages=[{"role": "user"}])),
    Case("messages: content 5", MESSAGES, messages(messages=[{"role": "user", "content": 5}])),
    Case("messages: block without type", MESSAGES, messages(messages=[{"role": "user",
                                                                       "content": [{"text": "x"}]}])),
    Case("messages: unknown block type", MESSAGES, messages(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])),
    Case("messages: image on a text-only model", MESSAGES, messages(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])),
    Case("messages: system 5", MESSAGES, messages(system=5)),
    Case("messages: tool without input_schema", MESSAGES, messages(tools=[{"name": "bash"}])),
    Case("messages: server tool (no input_schema)", MESSAGES,
         messages(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])),
    Case("messages: tool_choice tool without name", MESSAGES, messages(tools=ANTHROPIC_TOOLS,
                                                                        tool_choice={"type": "tool"})),
    Case("messages: tool_choice names a tool not offered", MESSAGES, messages(
        tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "edit"})),
    Case("messages: tool_choice type unknown", MESSAGES, messages(tools=ANTHROPIC_TOOLS,
                                                                   tool_choice={"type": "sometimes"})),
    Case("messages: thinking budget not below max_tokens", MESSAGES, messages(
        max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024})),
    Case("messages: thinking budget below 1024", MESSAGES, messages(thinking={"type": "enabled",
                                                                             "budget_tokens": 100})),
    Case("messages: output_config effort unknown", MESSAGES, messages(output_config={"effort": "extreme"})),
    Case("messages: temperature 'hot'", MESSAGES, messages(temperature="hot")),
    Case("messages: temperature 3", MESSAGES, messages(temperature=3)),
    Case("messages: cache_salt empty", MESSAGES, messages(cache_salt="")),
    Case("messages: prompt past the context", MESSAGES, messages(messages=[{"role": "user", "content": TOO_LONG}])),
    Case("messages: body not JSON", MESSAGES, raw=b"{not json"),
    Case("messages: body a list", MESSAGES, raw=b"[1, 2]"),
    Case("count_tokens: mid-conversation system, tools", COUNT, without(messages(
        tools=ANTHROPIC_TOOLS, messages=[USER, {"role": "system", "content": "Reminder."}]), "max_tokens")),
    Case("count_tokens: max_tokens is no field of it", COUNT, messages()),
    Case("count_tokens: no model", COUNT, {"messages": [USER]}),
    Case("count_tokens: unknown model", COUNT, {"model": "claude-opus-4-1", "messages": [USER]}),
    Case("count_tokens: empty messages", COUNT, {"model": MODEL_NAME, "messages": []}),
    Case("count_tokens: role tool", COUNT, {"model": MODEL_NAME, "messages": [{"role": "tool", "content": "x"}]}),

    # OpenAI chat completions
    Case("chat: plain", CHAT, chat()),
    Case("chat: stream with usage", CHAT, chat(stream=True, stream_options={"include_usage": True})),
    Case("chat: tools, tool_choice defaulting to auto", CHAT, chat(tools=CHAT_TOOLS)),
    Case("chat: tool_choice auto", CHAT, chat(tools=CHAT_TOOLS, tool_choice="auto")),
    Case("chat: tool_choice none", CHAT, chat(tools=CHAT_TOOLS, tool_choice="none")),
    Case("chat: tool calls and tool results", CHAT, chat(tools=CHAT_TOOLS, messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": TOOL_CALL["id"], "content": "parser.py"}])),
    Case("chat: custom role", CHAT, chat(messages=[{"role": "narrator", "content": "Once."}])),
    Case("chat: tool message without tool_call_id", CHAT, chat(messages=[{"role": "tool", "content": "r"}])),
    Case("chat: user message without content", CHAT, chat(messages=[{"role": "user"}])),
    Case("chat: unknown top-level field", CHAT, chat(reasoning={"effort": "low"}, foo=1)),
    Case("chat: no model", CHAT, without(chat(), "model")),
    Case("chat: max_tokens '4' (lax int)", CHAT, chat(max_tokens="4")),
    Case("chat: stream 'yes' (lax bool)", CHAT, chat(stream="yes")),
    Case("chat: priority under fcfs", CHAT, chat(priority=5)),
    Case("chat: vllm_xargs with a number", CHAT, chat(vllm_xargs={"continuation_id": 5})),
    Case("chat: seed and temperature 0", CHAT, chat(seed=7, temperature=0)),
    Case("chat: continue_final_message without add_generation_prompt", CHAT, chat(
        messages=[USER, {"role": "assistant", "content": "Sure"}], continue_final_message=True,
        add_generation_prompt=False)),
    Case("chat: tools {}", CHAT, chat(tools={"bash": 1})),
    Case("chat: tool without function", CHAT, chat(tools=[{"type": "function"}])),
    Case("chat: tool parameters not an object", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "bash", "parameters": "none"}}])),
    Case("chat: empty tools", CHAT, chat(tools=[])),
    Case("chat: tool_choice without tools", CHAT, chat(tool_choice="auto")),
    Case("chat: tool_choice unknown", CHAT, chat(tools=CHAT_TOOLS, tool_choice="sometimes")),
    Case("chat: tool_choice names a tool not offered", CHAT, chat(
        tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "edit"}})),
    Case("chat: tool_choice without a function", CHAT, chat(tools=CHAT_TOOLS, tool_choice={"type": "function"})),
    Case("chat: tool call without id", CHAT, chat(messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [{"function": TOOL_CALL["function"]}]}]),
        compare_param=False),
    Case("chat: max_tokens 'x'", CHAT, chat(max_tokens="x")),
    Case("chat: max_tokens 3.5", CHAT, chat(max_tokens=3.5)),
    Case("chat: max_tokens 0", CHAT, chat(max_tokens=0)),
    Case("chat: max_completion_tokens 0", CHAT, without(chat(max_completion_tokens=0), "max_tokens")),
    Case("chat: max_tokens past max_model_len", CHAT, chat(max_tokens=MAX_MODEL_LEN + 1)),
    Case("chat: max_completion_tokens past max_model_len", CHAT,
         without(chat(max_completion_tokens=MAX_MODEL_LEN + 1), "max_tokens")),
    Case("chat: messages {}", CHAT, chat(messages={})),
    Case("chat: empty messages", CHAT, chat(messages=[])),
    Case("chat: no messages", CHAT, without(chat(), "messages")),
    Case("chat: message without role", CHAT, chat(messages=[{"content": "x"}]), compare_param=False),
    Case("chat: role 5", CHAT, chat(messages=[{"role": 5, "content": "x"}]), compare_param=False),
    Case("chat: content 5", CHAT, chat(messages=[{"role": "user", "content": 5}]), compare_param=False),
    Case("chat: user content null", CHAT, chat(messages=[{"role": "user", "content": None}]), compare_param=False),
    Case("chat: name 5", CHAT, chat(messages=[{"role": "user", "content": "x", "name": 5}]), compare_param=False),
    Case("chat: message a string", CHAT, chat(messages=["hi"]), compare_param=False),
    Case("chat: image part on a text-only model", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])),
    Case("chat: unknown content part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "bogus"}]}])),
    Case("chat: a content part that is a string", CHAT, chat(messages=[{"role": "user", "content": ["plain"]}])),
    Case("chat: text part without text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    Case("chat: continue_final_message with the default add_generation_prompt", CHAT, chat(
        messages=[USER, {"role": "assistant", "content": "Sure"}], continue_final_message=True)),
    Case("chat: stream_options without stream", CHAT, chat(stream_options={"include_usage": True})),
    Case("chat: temperature 'hot'", CHAT, chat(temperature="hot")),
    Case("chat: temperature -1", CHAT, chat(temperature=-1)),
    Case("chat: temperature 3", CHAT, chat(temperature=3)),
    Case("chat: top_p 0", CHAT, chat(top_p=0)),
    Case("chat: n 0", CHAT, chat(n=0)),
    Case("chat: seed 'x'", CHAT, chat(seed="x")),
    Case("chat: priority 'high'", CHAT, chat(priority="high")),
    Case("chat: session_id 5", CHAT, chat(session_id=5)),
    Case("chat: cache_salt empty", CHAT, chat(cache_salt="")),
    Case("chat: unknown model", CHAT, chat(model="gpt-5")),
    Case("chat: prompt past the context", CHAT, chat(messages=[{"role": "user", "content": TOO_LONG}])),
    Case("chat: body not JSON", CHAT, raw=b"{not json"),
    Case("chat: body a list", CHAT, raw=b"[1, 2]"),
    Case("chat: content type text/plain", CHAT, raw=b'{"messages": []}', content_type="text/plain"),

    # OpenAI completions
    Case("completions: plain", COMPLETIONS, completion()),
    Case("completions: no max_tokens (16)", COMPLETIONS, without(completion(), "max_tokens")),
    Case("completions: stream", COMPLETIONS, completion(stream=True)),
    Case("completions: token ids", COMPLETIONS, completion(prompt=[1, 2, 3])),
    Case("completions: priority under fcfs", COMPLETIONS, completion(priority=-3)),
    Case("completions: empty prompt", COMPLETIONS, completion(prompt="")),
    Case("completions: no prompt", COMPLETIONS, without(completion(), "prompt")),
    Case("completions: prompt {}", COMPLETIONS, completion(prompt={"x": 1})),
    Case("completions: max_tokens past max_model_len", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN + 1)),
    Case("completions: prompt past the context", COMPLETIONS, completion(prompt=TOO_LONG)),
    Case("completions: stream_options without stream", COMPLETIONS,
         completion(stream_options={"include_usage": True})),
    Case("completions: unknown model", COMPLETIONS, completion(model="davinci")),

    # OpenAI Responses
    Case("responses: string input", RESPONSES, responses()),
    Case("responses: message, reasoning, function_call, function_call_output items", RESPONSES, responses(
        tools=RESPONSES_TOOLS, input=[
            {"role": "user", "content": "List the files."},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "I should run ls."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "bash",
             "arguments": "{\"command\": \"ls\"}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "parser.py"}])),
    Case("responses: typed message with input_text", RESPONSES, responses(input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}])),
    Case("responses: assistant output message", RESPONSES, responses(input=[
        {"role": "user", "content": "Hi."},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": "Again."}])),
    Case("responses: stream", RESPONSES, responses(stream=True)),
    Case("responses: tools, tool_choice auto", RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="auto")),
    Case("responses: tool_choice required", RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="required")),
    Case("responses: named tool_choice", RESPONSES, responses(tools=RESPONSES_TOOLS,
                                                              tool_choice={"type": "function", "name": "bash"})),
    Case("responses: tool_choice auto without tools", RESPONSES, responses(tool_choice="auto")),
    Case("responses: empty tools", RESPONSES, responses(tools=[])),
    Case("responses: web_search tool", RESPONSES, responses(tools=[{"type": "web_search"}])),
    Case("responses: priority under fcfs", RESPONSES, responses(priority=5)),
    Case("responses: unknown top-level field", RESPONSES, responses(foo=1, prompt_cache_key="k")),
    Case("responses: store false, seed, temperature", RESPONSES, responses(store=False, seed=3, temperature=0.5)),
    Case("responses: named tool_choice not offered", RESPONSES, responses(
        tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "edit"})),
    Case("responses: tool_choice unknown", RESPONSES, responses(tools=RESPONSES_TOOLS, tool_choice="sometimes"),
         compare_param=False),
    Case("responses: function tool without name", RESPONSES, responses(tools=[{"type": "function"}]),
         compare_param=False),
    Case("responses: empty input", RESPONSES, responses(input=[])),
    Case("responses: input {}", RESPONSES, responses(input={})),
    Case("responses: input 5", RESPONSES, responses(input=5)),
    Case("responses: no input", RESPONSES, without(responses(), "input")),
    Case("responses: unknown role", RESPONSES, responses(input=[{"role": "wizard", "content": "x"}]),
         compare_param=False),
    Case("responses: unknown item type", RESPONSES, responses(input=[{"type": "bogus"}]), compare_param=False),
    Case("responses: function_call without arguments", RESPONSES, responses(input=[
        {"type": "function_call", "call_id": "c", "name": "bash"}]), compare_param=False),
    Case("responses: item type vLLM cannot map", RESPONSES, responses(input=[
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "x"}}])),
    Case("responses: encrypted reasoning", RESPONSES, responses(input=[
        {"role": "user", "content": "Hi."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}])),
    Case("responses: image on a text-only model", RESPONSES, responses(input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}]}])),
    Case("responses: max_output_tokens 'x'", RESPONSES, responses(max_output_tokens="x")),
    Case("responses: max_output_tokens 0", RESPONSES, responses(max_output_tokens=0)),
    Case("responses: max_output_tokens past max_model_len", RESPONSES,
         responses(max_output_tokens=MAX_MODEL_LEN + 1)),
    Case("responses: instructions 5", RESPONSES, responses(instructions=5)),
    Case("responses: temperature 3", RESPONSES, responses(temperature=3)),
    Case("responses: cache_salt empty", RESPONSES, responses(cache_salt="")),
    Case("responses: unknown previous_response_id", RESPONSES, responses(previous_response_id="resp_unknown")),
    Case("responses: unknown model", RESPONSES, responses(model="gpt-5")),
    Case("responses: prompt past the context", RESPONSES, responses(input=TOO_LONG)),

    # routes
    Case("no such route", "/v1/nothing", chat()),
    Case("a route that takes no POST", "/v1/models", chat()),
]

DIFFERENCES: list[Difference] = [
    Difference(Case("chat: n 2", CHAT, chat(n=2)), 200, 400,
               why="the simworker serves one choice per call"),
    Difference(Case("completions: batched prompts", COMPLETIONS, completion(prompt=["a", "b"])), 200, 400,
               why="the simworker serves one prompt per call"),
    Difference(Case("completions: token id past the tiny vocabulary", COMPLETIONS,
                    completion(prompt=[1, 2, 5000])), 400, 200,
               why="the pseudo-tokenizer's vocabulary is a 128k-token model's, not the tiny model's 1,024"),
]
