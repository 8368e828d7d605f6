"""Tool-call replies (``tool_call_turns``) as real clients see them: the openai SDK (chat and
Responses) and the anthropic SDK over several tool turns, streamed and not, on a simworker on
loopback; then litellm, the openai-agents SDK and mini-swe-agent running their own loops.

Each conversation goes the way an agent's does: the reply calls a tool, the client runs it
and sends the call back with its result, until the worker's K tool results are in the
conversation and the reply is text. A call sent back as the client received it hits the
prefix cache through the call, as a text reply does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from simworker.worker import SimWorkerConfig, create_app
from tests.support.gateway_harness import ServerThread

MODEL = "sluice-sim"
BS = 16
TURNS = 3  # tool results before the reply is text
SYSTEM = "You are a careful engineer. Read the code, run the tests, fix the bug. " * 4
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
          "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a command.", "parameters": SCHEMA}]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a command.", "input_schema": SCHEMA,
                    "cache_control": {"type": "ephemeral"}}]
TOOL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = create_app(SimWorkerConfig(name="tools", num_blocks=1200, block_size=BS, kv_events=None,
                                     time_scale=0.02, default_max_tokens=16, tool_call_turns=TURNS))
    server = ServerThread(app).start()
    try:
        yield server.url
    finally:
        server.stop()


def hit_through(previous_prompt: int, previous_output: int, cached: int) -> bool:
    """The cache served the previous prompt and its reply (but the reply's last token, never
    computed), in whole blocks."""
    return cached >= (previous_prompt + previous_output - 1) // BS * BS


def check_arguments(arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    assert set(parsed) == {"command"} and isinstance(parsed["command"], str) and parsed["command"]
    return parsed


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_tool_turns(url, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Fix parser.py (chat, stream={stream})."}]
    seen_ids, last = set(), None
    for turn in range(TURNS + 1):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                                         stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            deltas = [c.choices[0] for c in chunks if c.choices]
            finish = deltas[-1].finish_reason
            content = "".join(d.delta.content or "" for d in deltas)
            calls: dict[int, dict[str, Any]] = {}
            for delta in deltas:
                for part in delta.delta.tool_calls or []:
                    call = calls.setdefault(part.index, {"id": None, "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    call["id"] = part.id or call["id"]
                    call["function"]["name"] += part.function.name or ""
                    call["function"]["arguments"] += part.function.arguments or ""
            tool_calls = list(calls.values())
            # vLLM's shape: the id, type and name first, then argument pieces, then the finish
            if tool_calls:
                opening = next(d for d in deltas if d.delta.tool_calls).delta.tool_calls[0]
                assert opening.id and opening.type == "function" and opening.function.name == "bash"
                assert sum(1 for d in deltas if d.delta.tool_calls and d.delta.tool_calls[0].function.arguments) > 1
        else:
            answer = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
            usage, finish = answer.usage, answer.choices[0].finish_reason
            message = answer.choices[0].message
            content = message.content or ""
            tool_calls = [call.model_dump() for call in message.tool_calls or []]
        if last is not None:
            assert hit_through(*last, usage.prompt_tokens_details.cached_tokens), (turn, last, usage)
        last = (usage.prompt_tokens, usage.completion_tokens)
        if turn < TURNS:
            [call] = tool_calls
            assert finish == "tool_calls" and not content
            assert TOOL_ID.fullmatch(call["id"]) and call["id"] not in seen_ids
            seen_ids.add(call["id"])
            assert call["function"]["name"] == "bash"
            check_arguments(call["function"]["arguments"])
            messages += [{"role": "assistant", "content": None, "tool_calls": tool_calls},
                         {"role": "tool", "tool_call_id": call["id"], "content": "FAILED test_parse"}]
        else:
            assert finish == "stop" and content and not tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_tool_turns(url, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    items: list[Any] = [{"role": "user", "content": f"Fix parser.py (responses, stream={stream})."}]
    last = None
    for turn in range(TURNS + 1):
        if stream:
            with client.responses.stream(model=MODEL, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS) as events:
                kinds = [event.type for event in events]
                answer = events.get_final_response()
        else:
            answer = client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS)
        usage = answer.usage
        if last is not None:
            assert hit_through(*last, usage.input_tokens_details.cached_tokens), (turn, last, usage)
        last = (usage.input_tokens, usage.output_tokens)
        [output] = answer.output
        if turn < TURNS:
            assert output.type == "function_call" and output.status == "completed" and output.name == "bash"
            assert TOOL_ID.fullmatch(output.call_id) and re.fullmatch(r"fc_[0-9a-f]{16}", output.id)
            check_arguments(output.arguments)
            if stream:
                assert kinds[2] == "response.output_item.added" and kinds[-3:] == [
                    "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
                assert kinds.count("response.function_call_arguments.delta") > 1
            items += [output.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": output.call_id, "output": "FAILED test_parse"}]
        else:
            assert output.type == "message" and output.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_turns(url, stream):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Fix parser.py (anthropic, stream={stream})."}]
    last = None
    for turn in range(TURNS + 1):
        if stream:
            with client.messages.stream(model=MODEL, max_tokens=4096, system=system, messages=messages,
                                        tools=ANTHROPIC_TOOLS) as events:
                kinds = [event.type for event in events]
                answer = events.get_final_message()
        else:
            answer = client.messages.create(model=MODEL, max_tokens=4096, system=system, messages=messages,
                                            tools=ANTHROPIC_TOOLS)
        usage = answer.usage
        if last is not None:
            assert hit_through(*last, usage.cache_read_input_tokens), (turn, last, usage)
        last = (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens)
        [block] = answer.content
        if turn < TURNS:
            assert answer.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "bash"
            assert TOOL_ID.fullmatch(block.id)
            check_arguments(json.dumps(block.input))
            if stream:
                assert "input_json" in kinds and kinds[-1] == "message_stop"
            messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                       "content": "FAILED test_parse"}]}]
        else:
            assert answer.stop_reason == "end_turn" and block.type == "text" and block.text


def test_tool_choice_steers_the_reply(url):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Choose."}], "tools": CHAT_TOOLS + [
        {"type": "function", "function": {"name": "edit", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1}},
            "required": ["path", "line"]}}}]}
    named = httpx.post(f"{url}/v1/chat/completions", json={
        **base, "tool_choice": {"type": "function", "function": {"name": "edit"}}}, timeout=30).json()
    choice = named["choices"][0]
    # vLLM: a forced call finishes with "stop" and content ""
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "edit"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments["path"], str) and isinstance(arguments["line"], int) and arguments["line"] >= 1
    none = httpx.post(f"{url}/v1/chat/completions", json={**base, "tool_choice": "none"}, timeout=30).json()
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["finish_reason"] == "stop"
    # a limit too short for the whole call: text, as a cut-off call would not parse
    short = httpx.post(f"{url}/v1/chat/completions", json={**base, "max_tokens": 3}, timeout=30).json()
    assert "tool_calls" not in short["choices"][0]["message"] and short["choices"][0]["finish_reason"] == "length"


def _missing(*modules: str) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def test_litellm_runs_tool_turns(url):
    if missing := _missing("litellm"):
        pytest.skip(f"cannot import {missing}: install the clients extra")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    for stream in (False, True):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Fix it (litellm, stream={stream})."}]
        finishes = []
        for _ in range(TURNS + 1):
            answer = litellm.completion(model=f"hosted_vllm/{MODEL}", api_base=f"{url}/v1", api_key="none",
                                        messages=messages, tools=CHAT_TOOLS, stream=stream)
            if stream:
                answer = litellm.stream_chunk_builder(list(answer), messages=messages)
            message = answer.choices[0].message
            finishes.append(answer.choices[0].finish_reason)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                check_arguments(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
        assert finishes == ["tool_calls"] * TURNS + ["stop"]


def test_openai_agents_runs_its_loop_to_a_text_answer(url):
    if missing := _missing("agents"):
        pytest.skip(f"cannot import {missing}: pip install openai-agents")
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    commands: list[str] = []

    @function_tool
    def run_shell(command: str, timeout: int = 10) -> str:
        """Run a shell command."""
        commands.append(command)
        return "exit 0"

    async def run_all() -> list[tuple[int, str]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        results = []
        for model in (OpenAIChatCompletionsModel(MODEL, client), OpenAIResponsesModel(MODEL, client)):
            agent = Agent(name="fixer", instructions=SYSTEM, tools=[run_shell], model=model)
            before = len(commands)
            done = await Runner.run(agent, "Fix the failing test.", max_turns=TURNS + 2)
            results.append((len(commands) - before, done.final_output))
            before = len(commands)
            streamed = Runner.run_streamed(agent, "Fix it again, streamed.", max_turns=TURNS + 2)
            async for _event in streamed.stream_events():
                pass
            results.append((len(commands) - before, streamed.final_output))
        return results

    for calls, final in asyncio.run(run_all()):
        assert calls == TURNS and isinstance(final, str) and final


def test_mini_swe_agent_runs_the_bash_tool_then_stops_on_text(url, tmp_path):
    if missing := _missing("minisweagent", "litellm"):
        pytest.skip(f"cannot import {missing}: pip install mini-swe-agent")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    model = LitellmModel(model_name=f"hosted_vllm/{MODEL}", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": f"{url}/v1", "api_key": "none"})
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), system_template=SYSTEM,
                         instance_template="{{task}}", step_limit=TURNS + 4)
    result = agent.run("Fix the failing test.")
    runs = [m for m in agent.messages if m["role"] == "tool"]
    assert len(runs) == TURNS  # each call ran in the shell: filler words, no program by that name
    assert all("<returncode>127</returncode>" in m["content"] for m in runs)
    # then text: mini-swe-agent asks for a tool call until it gives up, its own way to stop
    assert result["exit_status"] == "RepeatedFormatError"
