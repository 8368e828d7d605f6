"""Every identity source architecture.md §5.2 lists reaches the policy through the gateway: the
program appears under that session id in /sluice/programs, and the worker sees it as
``session_id`` and ``X-Session-ID`` with a gateway-minted continuation id."""

from __future__ import annotations

import pytest
from tests.support.gateway_harness import chat, fakes, gateway, serve_config


@pytest.fixture(scope="module")
def single():
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 10_000_000}])
        with gateway(config) as gw:
            yield gw, fake


def _last_seen(fake):
    return fake.seen[-1]


SOURCES = [
    # (name, headers, body extras, expected session, expected parent)
    ("x-dynamo-session-id", {"x-dynamo-session-id": "dyn-1", "x-session-id": "loses"}, {}, "dyn-1", None),
    ("x-claude-code-session-id", {"x-claude-code-session-id": "cc-1"}, {}, "cc-1", None),
    ("x-claude-code-agent-id", {"x-claude-code-session-id": "cc-2", "x-claude-code-agent-id": "cc-2-agent"},
     {}, "cc-2-agent", "cc-2"),
    ("thread-id", {"thread-id": "codex-1"}, {}, "codex-1", None),
    ("x-session-id", {"x-session-id": "plain-1"}, {"session_id": "loses"}, "plain-1", None),
    ("body.session_id", {}, {"session_id": "body-1", "program_id": "loses"}, "body-1", None),
    ("body.program_id", {}, {"program_id": "ta-1"}, "ta-1", None),
    ("body.prompt_cache_key", {}, {"prompt_cache_key": "pck-1"}, "pck-1", None),
    ("body.conversation", {}, {"conversation": "conv-1"}, "conv-1", None),
    ("body.conversation.id", {}, {"conversation": {"id": "conv-2"}}, "conv-2", None),
    ("x-dynamo-parent-session-id", {"x-session-id": "kid-1", "x-dynamo-parent-session-id": "mom-1"},
     {}, "kid-1", "mom-1"),
    ("x-claude-code-parent-agent-id", {"x-session-id": "kid-2", "x-claude-code-parent-agent-id": "mom-2"},
     {}, "kid-2", "mom-2"),
    ("x-codex-parent-thread-id", {"thread-id": "kid-3", "x-codex-parent-thread-id": "mom-3"},
     {}, "kid-3", "mom-3"),
    ("x-parent-session-id", {"x-session-id": "kid-4", "x-parent-session-id": "mom-4"}, {}, "kid-4", "mom-4"),
]


@pytest.mark.parametrize("name,headers,extra,session,parent", SOURCES, ids=[s[0] for s in SOURCES])
def test_identity_source_reaches_the_policy_and_the_worker(single, name, headers, extra, session, parent):
    gw, fake = single
    r = gw.client.post("/v1/chat/completions", json=chat(f"via {name}", **extra), headers=headers)
    assert r.status_code == 200, r.text
    program = gw.programs()[session]
    assert program["parent_session_id"] == parent
    assert program["steps"] == 1
    seen = _last_seen(fake)
    assert seen.body["session_id"] == session
    assert seen.headers["x-session-id"] == session
    assert len(seen.body["vllm_xargs"]["continuation_id"]) == 32
    assert "program_id" not in seen.body  # ThunderAgent's field is consumed by the gateway


def test_previous_response_id_continues_the_session_that_produced_it(single):
    gw, fake = single
    first = gw.client.post("/v1/responses", json={"model": "fake-model", "input": "start"},
                           headers={"x-session-id": "resp-session"})
    assert first.status_code == 200
    response_id = first.json()["id"]
    follow = gw.client.post("/v1/responses", json={"model": "fake-model", "input": "go on",
                                                   "previous_response_id": response_id})
    assert follow.status_code == 200
    assert _last_seen(fake).body["session_id"] == "resp-session"
    assert gw.programs()["resp-session"]["steps"] == 2
    # Streamed responses are remembered too.
    with gw.client.stream("POST", "/v1/responses", json={"model": "fake-model", "input": "s", "stream": True},
                          headers={"x-session-id": "resp-stream"}) as r:
        raw = b"".join(r.iter_raw())
    stream_id = "resp_" + r.headers["x-fake-request-id"]
    assert stream_id.encode() in raw
    gw.client.post("/v1/responses", json={"model": "fake-model", "input": "more",
                                          "previous_response_id": stream_id})
    assert _last_seen(fake).body["session_id"] == "resp-stream"


def test_unknown_previous_response_id_falls_through_to_content(single):
    gw, fake = single
    r = gw.client.post("/v1/responses", json={"model": "fake-model", "input": "orphan",
                                              "previous_response_id": "resp_never_seen"})
    assert r.status_code == 200
    assert _last_seen(fake).body["session_id"].startswith("c-")


def test_a_call_without_identity_continues_the_program_whose_answer_it_carries(single):
    gw, fake = single
    system = {"role": "system", "content": "You fix bugs."}
    opening = {"role": "user", "content": "test_utils fails"}
    turn1 = {"model": "fake-model", "messages": [system, opening]}
    r1 = gw.client.post("/v1/chat/completions", json=turn1)
    assert r1.status_code == 200
    first = _last_seen(fake)
    answer = r1.json()["choices"][0]["message"]
    turn2 = {"model": "fake-model", "messages": [system, opening, answer,
                                                 {"role": "user", "content": "now run it"}]}
    assert gw.client.post("/v1/chat/completions", json=turn2).status_code == 200
    second = _last_seen(fake)
    session = first.body["session_id"]
    assert session.startswith("c-") and second.body["session_id"] == session
    assert gw.programs()[session]["steps"] == 2
    assert gw.programs()[session]["group_id"] == session.rsplit("-", 1)[0]  # its opening
    # The chain grew: a later turn's continuation id differs from the first's.
    assert first.body["vllm_xargs"]["continuation_id"] != second.body["vllm_xargs"]["continuation_id"]
    # The same opening again is another run of the task: a program of its own
    assert gw.client.post("/v1/chat/completions", json=turn1).status_code == 200
    rerun = _last_seen(fake).body["session_id"]
    assert rerun != session and rerun.rsplit("-", 1)[0] == session.rsplit("-", 1)[0]
    # ... and an answer nobody gave starts one too
    made_up = {**turn2, "messages": [system, opening, {"role": "assistant", "content": "no"},
                                     {"role": "user", "content": "go"}]}
    assert gw.client.post("/v1/chat/completions", json=made_up).status_code == 200
    assert _last_seen(fake).body["session_id"] not in (session, rerun)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"model": "fake-model", "prompt": "def f():"}),
    ("/v1/messages", {"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "fake-model", "input": [{"role": "user", "content": "hi"}]}),
])
def test_every_route_resolves_identity(single, route, body):
    gw, fake = single
    session = "route" + route.replace("/", "-")
    r = gw.client.post(route, json=body, headers={"x-claude-code-session-id": session})
    assert r.status_code == 200, r.text
    assert _last_seen(fake).body["session_id"] == session
    assert session in gw.programs()
