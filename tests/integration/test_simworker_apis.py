"""The simworker's Anthropic Messages and OpenAI Responses APIs (simworker/apis.py), as
clients see them over real HTTP on loopback, alone and behind the gateway."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq
from tests.support.gateway_harness import ServerThread, gateway, serve_config, wait_for

from scheduler.kv_events import BlockStored, EventBatchDecoder
from simworker.worker import SimWorkerConfig, create_app

BLOCKS, BS = 400, 16
MODEL = "sluice-sim"
SYSTEM = ("You are a careful software engineer. You read the repository, run the tests, and fix "
          "the bug with the smallest change that makes the failing test pass. ") * 6
TOOLS = [{"name": "bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, object]]:
    app = create_app(SimWorkerConfig(name="apis", num_blocks=BLOCKS, block_size=BS,
                                     kv_events="tcp://127.0.0.1:*", time_scale=0.05,
                                     default_max_tokens=24))
    server = ServerThread(app).start()
    try:
        yield server.url, app.state.worker
    finally:
        server.stop()


def post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kwargs)


def sse_events(url: str, path: str, body: dict, **kwargs) -> list[tuple[str, dict]]:
    """(event name, data) of every event, checking each has both lines."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30, **kwargs) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw())
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        out.append((data["type"], data))
    return out


def messages_body(text: str, **extra) -> dict:
    return {"model": MODEL, "max_tokens": 64, "system": SYSTEM,
            "messages": [{"role": "user", "content": text}], **extra}


# -- Anthropic Messages ------------------------------------------------------------------------


def test_messages_answer_is_an_anthropic_message_with_usage(worker):
    url, _ = worker
    r = post(url, "/v1/messages", messages_body("Fix the failing test in parser.py."))
    assert r.status_code == 200, r.text
    body = r.json()
    # vLLM's ids, not Anthropic's msg_ ones
    assert body["id"].startswith("chatcmpl-") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == MODEL and body["stop_reason"] == "end_turn"  # 24 < max_tokens 64
    [block] = body["content"]
    assert block["type"] == "text" and block["text"]
    usage = body["usage"]
    assert usage["output_tokens"] == 24 and usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] > 0
    # The same request again: its full blocks come from the cache, and input_tokens counts
    # only the rest (Anthropic's split, which vLLM's route keeps).
    again = post(url, "/v1/messages", messages_body("Fix the failing test in parser.py.")).json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert again["cache_read_input_tokens"] == prompt // BS * BS
    assert again["input_tokens"] == prompt - again["cache_read_input_tokens"]


def test_messages_max_tokens_below_the_reply_length_cuts_it_with_stop_reason_max_tokens(worker):
    url, _ = worker
    body = post(url, "/v1/messages", messages_body("Short, please.", max_tokens=5)).json()
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 5


def test_messages_max_tokens_past_the_pool_is_a_limit_not_a_length(worker):
    url, _ = worker  # Claude Code asks for 32k on every call; the reply keeps its own length
    body = post(url, "/v1/messages", messages_body("Long limit.", max_tokens=32_000)).json()
    assert body["stop_reason"] == "end_turn" and body["usage"]["output_tokens"] == 24
    # past the model length (131,072 by default) vLLM refuses it, naming the field it read
    refused = post(url, "/v1/messages", messages_body("Too long a limit.", max_tokens=10**6))
    assert refused.status_code == 400 and refused.json() == {"type": "error", "error": {
        "type": "BadRequestError",
        "message": "max_completion_tokens=1000000 cannot be greater than max_model_len=131072. Please request "
                   "fewer output tokens. (parameter=max_completion_tokens, value=1000000)"}}


def test_claude_code_mid_conversation_system_messages_are_served(worker):
    url, _ = worker
    body = messages_body("Fix it.")
    body["messages"] += [{"role": "assistant", "content": "Looking."},
                         {"role": "system", "content": [{"type": "text", "text": "<system-reminder>todo</system-reminder>",
                                                         "cache_control": {"type": "ephemeral"}}]},
                         {"role": "user", "content": "Go on."}]
    r = post(url, "/v1/messages?beta=true", body,
             headers={"anthropic-beta": "mid-conversation-system-2026-04-07"})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"


def test_second_turn_reads_the_first_turn_from_the_cache_and_input_tokens_exclude_it(worker):
    url, _ = worker
    first_body = messages_body("Second-turn check: what is in setup.cfg?")
    first = post(url, "/v1/messages", first_body).json()
    turn2 = dict(first_body, messages=[
        *first_body["messages"],
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "text", "text": "Now run the tests.",
                                      "cache_control": {"type": "ephemeral"}}]}])
    second = post(url, "/v1/messages", turn2).json()
    u1, u2 = first["usage"], second["usage"]
    prompt1 = u1["input_tokens"] + u1["cache_read_input_tokens"]
    # the whole first turn (prompt and reply but its last token) is cached, in whole blocks
    assert u2["cache_read_input_tokens"] >= (prompt1 + u1["output_tokens"] - 1) // BS * BS - BS
    assert u2["cache_read_input_tokens"] > prompt1 // 2
    count = post(url, "/v1/messages/count_tokens", {k: v for k, v in turn2.items() if k != "max_tokens"})
    total = u2["input_tokens"] + u2["cache_read_input_tokens"]
    assert count.json() == {"input_tokens": total, "context_management": {"original_input_tokens": total}}


def test_messages_stream_sends_every_event_type_in_order_with_usage(worker):
    url, _ = worker
    events = sse_events(url, "/v1/messages", messages_body("Stream the plan.", stream=True, temperature=0))
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]  # vLLM sends no ping
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("chatcmpl-") and start["content"] == [] and start["stop_reason"] is None
    assert {"input_tokens", "cache_read_input_tokens", "output_tokens"} <= set(start["usage"])
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert all(data["delta"]["type"] == "text_delta" for name, data in events if name == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn" and delta["usage"]["output_tokens"] == 24
    plain = post(url, "/v1/messages", messages_body("Stream the plan.", temperature=0)).json()
    assert text == plain["content"][0]["text"]  # greedy: the same prompt gives the same reply


def test_messages_with_tools_and_tool_blocks_are_served(worker):
    url, _ = worker
    body = messages_body("List the files.", tools=TOOLS)
    body["system"] = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash",
                                           "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "setup.py\nsrc/"}]}]
    r = post(url, "/v1/messages", body)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"


def test_count_tokens_counts_the_prompt_a_first_call_reports(worker):
    url, _ = worker
    body = messages_body("Count tokens: a brand new task about the lexer.", tools=TOOLS)
    count = post(url, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert count.status_code == 200
    usage = post(url, "/v1/messages", body).json()["usage"]
    assert count.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "body.max_tokens"),
    ({"model": MODEL, "max_tokens": 8}, "body.messages"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "tool", "content": "hi"}]}, "body.messages.0.role"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": 7}]}, "body.messages.0.content"),
    ({"model": MODEL, "max_tokens": 8, "system": 3, "messages": [{"role": "user", "content": "x"}]},
     "body.system"),
])
def test_messages_bodies_that_fail_validation_get_vllms_openai_shaped_400(worker, body, param):
    url, _ = worker  # vLLM's validation handler answers every route in OpenAI's envelope
    r = post(url, "/v1/messages", body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "Bad Request" and error["param"] == param and error["code"] == 400
    assert re.match(r"\d+ validation errors?:\n", error["message"])


def test_messages_refused_by_the_handler_get_the_anthropic_envelope(worker):
    url, _ = worker
    long = post(url, "/v1/messages", {"model": MODEL, "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "word " * BLOCKS * BS}]})
    assert long.status_code == 400 and long.json()["type"] == "error"
    assert long.json()["error"]["type"] == "BadRequestError" and "maximum context length" in long.text
    r = httpx.post(f"{url}/v1/messages", content=b"{nope", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    r = post(url, "/v1/messages/count_tokens", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = post(url, "/v1/messages", messages_body("Which model?", model="claude-sonnet-4-5"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_messages_calls_label_their_kv_events_with_the_session(worker):
    url, simworker = worker
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(simworker.kv_endpoint)
    time.sleep(0.3)  # let the subscription reach the publisher
    try:
        post(url, "/v1/messages", messages_body("Label my blocks."), headers={"x-session-id": "anth-1"})
        r = post(url, "/v1/responses", {"model": MODEL, "input": "Label mine too, " * 20,
                                        "session_id": "resp-1"})
        assert r.status_code == 200
        decoder = EventBatchDecoder()
        sessions: set[str | None] = set()
        deadline = time.monotonic() + 5
        while not {"anth-1", "resp-1"} <= sessions:
            assert time.monotonic() < deadline, f"only {sessions} labelled"
            if sub.poll(200):
                batch = decoder.decode(sub.recv_multipart()[2])
                sessions |= {e.session_id for e in batch.events if isinstance(e, BlockStored)}
    finally:
        sub.close()
        ctx.term()


# -- OpenAI Responses --------------------------------------------------------------------------


def test_responses_answer_is_a_completed_response_with_usage(worker):
    url, _ = worker
    r = post(url, "/v1/responses", {"model": MODEL, "instructions": SYSTEM,
                                    "input": "What does the parser do?"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["incomplete_details"] is None
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    [part] = item["content"]
    assert part["type"] == "output_text" and part["text"]
    usage = body["usage"]
    assert usage["output_tokens"] == 24 and usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + 24
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]


def test_responses_max_output_tokens_cuts_the_reply_and_marks_it_incomplete(worker):
    url, _ = worker
    body = post(url, "/v1/responses", {"model": MODEL, "input": "Be brief.", "max_output_tokens": 6}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 6


def test_previous_response_id_continues_the_stored_context_from_the_cache(worker):
    url, _ = worker
    first = post(url, "/v1/responses", {"model": MODEL, "instructions": SYSTEM,
                                        "input": "Previous-response check: read the README."}).json()
    second = post(url, "/v1/responses", {"model": MODEL, "instructions": SYSTEM,
                                         "previous_response_id": first["id"],
                                         "input": [{"role": "user", "content": [
                                             {"type": "input_text", "text": "Now the tests."}]}]})
    assert second.status_code == 200, second.text
    u1, u2 = first["usage"], second.json()["usage"]
    context = u1["input_tokens"] + u1["output_tokens"]
    assert u2["input_tokens"] > context  # the previous prompt and reply, then the new input
    assert u2["input_tokens_details"]["cached_tokens"] >= (context - 1) // BS * BS - BS
    assert second.json()["previous_response_id"] == first["id"]


def test_function_call_items_are_served(worker):
    url, _ = worker
    items = [{"role": "user", "content": "List files."},
             {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"cmd":"ls"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "setup.py"}]
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {}}}]
    r = post(url, "/v1/responses", {"model": MODEL, "input": items, "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["tools"] == tools


def test_responses_stream_sends_the_sdk_event_sequence_with_sequence_numbers(worker):
    url, _ = worker
    events = sse_events(url, "/v1/responses", {"model": MODEL, "input": "Stream it.", "stream": True})
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 24
    assert final["output"][0]["content"][0]["text"] == text == events[-4][1]["text"]
    assert events[0][1]["response"]["usage"] is None and events[0][1]["response"]["status"] == "in_progress"
    # a streamed answer is stored too
    follow = post(url, "/v1/responses", {"model": MODEL, "input": "And then?",
                                         "previous_response_id": final["id"]})
    assert follow.status_code == 200, follow.text


def test_unknown_previous_response_id_is_vllms_404(worker):
    url, _ = worker
    r = post(url, "/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
                                 "param": "response_id", "code": 404}


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "body.input"),
    ({"model": MODEL, "input": 5}, "body.input"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "body.input"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "input": "x", "instructions": 3}, "body.instructions"),
])
def test_bad_responses_requests_get_400_in_openai_error_shape(worker, body, param):
    url, _ = worker
    r = post(url, "/v1/responses", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_store_false_answers_cannot_be_continued(worker):
    url, _ = worker
    first = post(url, "/v1/responses", {"model": MODEL, "input": "Forget me.", "store": False}).json()
    r = post(url, "/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": first["id"]})
    assert r.status_code == 404


def test_the_response_store_keeps_only_the_newest_answers():
    app = create_app(SimWorkerConfig(name="kept", num_blocks=BLOCKS, block_size=BS, kv_events=None,
                                     time_scale=0.01, default_max_tokens=4, responses_kept=2))
    server = ServerThread(app).start()
    try:
        ids = [post(server.url, "/v1/responses", {"model": MODEL, "input": f"turn {i}"}).json()["id"]
               for i in range(3)]
        statuses = [post(server.url, "/v1/responses", {"model": MODEL, "input": "next",
                                                       "previous_response_id": i, "store": False}).status_code
                    for i in ids]
        assert statuses == [404, 200, 200]
    finally:
        server.stop()


# -- behind the gateway ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fronted(tmp_path_factory) -> Iterator[tuple[object, object]]:
    app = create_app(SimWorkerConfig(name="sim0", num_blocks=BLOCKS, block_size=BS, kv_events=None,
                                     time_scale=0.05, default_max_tokens=24))
    server = ServerThread(app).start()
    log = tmp_path_factory.mktemp("records") / "requests.jsonl"
    try:
        config = serve_config([{"name": "sim0", "url": server.url}], capacity_retry_s=0.05,
                              request_log=str(log))
        with gateway(config) as gw:
            wait_for(lambda: gw.workers()["sim0"]["capacity_tokens"], what="capacity")
            yield gw, log
    finally:
        server.stop()


def _record(log, session: str) -> dict:
    def found():
        for line in log.read_text().splitlines() if log.exists() else []:
            record = json.loads(line)
            if record["agent_context"]["session_id"] == session:
                return record["request"]
        return None
    return wait_for(found, what=f"a request record of {session}")


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_reads_anthropic_usage_with_cache_reads_in_the_prompt(fronted, stream):
    gw, log = fronted
    session = f"anth-gw-{stream}"
    body = messages_body(f"Through the gateway ({stream}).")
    first = gw.client.post("/v1/messages", json=body, headers={"x-session-id": session}).json()
    turn2 = dict(body, stream=stream, messages=[
        *body["messages"], {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "Go on."}])
    session2 = session + "-2"
    if stream:
        with gw.client.stream("POST", "/v1/messages", json=turn2, headers={"x-session-id": session2}) as r:
            raw = b"".join(r.iter_raw())
        start = next(json.loads(line[6:]) for line in raw.decode().splitlines()
                     if line.startswith("data: ") and '"message_start"' in line)
        usage = start["message"]["usage"]
        assert b"event: message_stop" in raw
    else:
        usage = gw.client.post("/v1/messages", json=turn2, headers={"x-session-id": session2}).json()["usage"]
    record = _record(log, session2)
    assert usage["cache_read_input_tokens"] > 0
    assert record["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert record["cached_tokens"] == usage["cache_read_input_tokens"]
    assert record["output_tokens"] == 24


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_reads_responses_usage_and_follows_previous_response_id(fronted, stream):
    gw, log = fronted
    session = f"resp-gw-{stream}"
    first = gw.client.post("/v1/responses", json={"model": MODEL, "input": f"Gateway {stream}."},
                           headers={"x-session-id": session}).json()
    # no session header: the gateway finds the session from the previous response's id
    turn2 = {"model": MODEL, "input": "Next.", "previous_response_id": first["id"], "stream": stream}
    if stream:
        with gw.client.stream("POST", "/v1/responses", json=turn2) as r:
            raw = b"".join(r.iter_raw())
        completed = [json.loads(line[6:]) for line in raw.decode().splitlines()
                     if line.startswith("data: ") and '"response.completed"' in line]
        usage = completed[-1]["response"]["usage"]
    else:
        usage = gw.client.post("/v1/responses", json=turn2).json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0
    records = wait_for(lambda: [json.loads(line)["request"] for line in log.read_text().splitlines()
                                if json.loads(line)["agent_context"]["session_id"] == session][1:] or None,
                       what="the second turn's record")
    assert records[0]["input_tokens"] == usage["input_tokens"]
    assert records[0]["cached_tokens"] == usage["input_tokens_details"]["cached_tokens"]
    assert records[0]["output_tokens"] == usage["output_tokens"]


def test_the_gateway_relays_count_tokens_and_anthropic_errors(fronted):
    gw, _ = fronted
    body = {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": "Count me."}]}
    r = gw.client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    bad = gw.client.post("/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400  # the worker's answer as vLLM gives it: its validation's envelope
    assert msgspec.json.decode(bad.content)["error"]["param"] == "body.max_tokens"


def test_claude_code_turns_with_mid_conversation_system_messages_pass_the_gateway(fronted):
    gw, _ = fronted
    body = messages_body("Through the gateway, Claude Code style.", stream=True)
    body["system"] = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=1;"},
                      {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    body["messages"] += [{"role": "assistant", "content": "On it."},
                         {"role": "system", "content": "<system-reminder>Todo list updated.</system-reminder>"},
                         {"role": "user", "content": "Go on."}]
    headers = {"x-session-id": "claude-code-1", "anthropic-beta": "mid-conversation-system-2026-04-07"}
    with gw.client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as r:
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200, raw
    assert b"event: message_stop" in raw and b'"stop_reason":"end_turn"' in raw
