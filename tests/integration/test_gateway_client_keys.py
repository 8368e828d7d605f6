"""Client API keys through the gateway (controller/client_keys.py): with keys, a call needs
one (``Authorization: Bearer`` or ``x-api-key``, either on either route) else 401 in the
route's shape; the key never reaches a worker nor the log; each key has its own bounds (429
with Retry-After); a session belongs to the key that made it, and another key can neither
join nor end it (403). Without keys nothing of this applies. Real gateways and fake vLLM
workers on loopback, real httpx clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.support.gateway_harness import chat, fakes, gateway, serve_config, wait_for

from controller.gateway import create_app
from scheduler.config import ConfigError

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
BATCH = "sk-batch-5555666677778888"
KEYS_YAML = f"""
alice: {ALICE}
bob: {BOB}
batch:
  key: {BATCH}
  max_programs: 2
  max_held_calls: 1
"""
TINY = 1000  # one program per worker fits (as in test_gateway_limits.py)
# The fake worker's test headers go through; so would a client's Authorization and x-api-key
# (forward_client_headers), but for the gateway's client keys, which it keeps.
FORWARDED = ["x-test-*", "authorization", "x-api-key"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def messages_body(content: str = "hi") -> dict:
    return {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}


def _post(url: str, session: str, key: str, timeout: float = 20.0, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout, trust_env=False) as client:
        return client.post("/v1/chat/completions", json=chat(f"task of {session}"),
                           headers={"x-session-id": session, **bearer(key), **headers})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """One roomy worker behind a gateway whose keys come from a file."""
    folder = tmp_path_factory.mktemp("keys")
    (folder / "clients.yaml").write_text(KEYS_YAML)
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 10_000_000}],
                              clients={"keys_file": str(folder / "clients.yaml")},
                              forward_client_headers=FORWARDED)
        with gateway(config) as gw:
            yield gw, fake


# -- authentication --------------------------------------------------------------------------


def test_a_call_without_a_key_gets_401_in_openai_shape_and_never_reaches_a_worker(keyed):
    gw, fake = keyed
    before = len(fake.seen)
    r = gw.client.post("/v1/chat/completions", json=chat("no key"), headers={"x-session-id": "nokey"})
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]
    assert len(fake.seen) == before
    assert "nokey" not in gw.programs()


def test_a_wrong_key_gets_401_in_anthropic_shape_on_the_messages_route(keyed):
    gw, fake = keyed
    r = gw.client.post("/v1/messages", json=messages_body(), headers={"x-api-key": "sk-not-a-key-000000000"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": r.json()["error"]["message"]}}
    assert "sk-not-a-key" not in r.text


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", chat("either")),
                                        ("/v1/messages", messages_body("either"))],
                         ids=["openai", "anthropic"])
@pytest.mark.parametrize("header", ["bearer", "x-api-key"])
def test_either_key_header_is_accepted_on_either_route_and_neither_is_forwarded(keyed, route, body, header):
    gw, fake = keyed
    headers = bearer(ALICE) if header == "bearer" else {"x-api-key": ALICE}
    r = gw.client.post(route, json=body, headers={"x-session-id": f"either-{route}-{header}", **headers})
    assert r.status_code == 200, r.text
    seen = fake.seen[-1]
    assert seen.path == route
    assert "authorization" not in seen.headers and "x-api-key" not in seen.headers


def test_two_different_keys_in_one_call_get_401(keyed):
    gw, _ = keyed
    r = gw.client.post("/v1/chat/completions", json=chat("two keys"),
                       headers={**bearer(ALICE), "x-api-key": BOB, "x-session-id": "two-keys"})
    assert r.status_code == 401 and "two different keys" in r.json()["error"]["message"]


def test_a_malformed_authorization_header_gets_401(keyed):
    gw, _ = keyed
    r = gw.client.post("/v1/chat/completions", json=chat("basic"),
                       headers={"Authorization": f"Basic {ALICE}"})
    assert r.status_code == 401 and "Bearer <key>" in r.json()["error"]["message"]


def test_the_token_count_and_the_model_list_need_a_key_and_health_does_not(keyed):
    gw, fake = keyed
    count_route = "/v1/messages/count_tokens"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "count me"}]}
    refused = gw.client.post(count_route, json=body)
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    counted = gw.client.post(count_route, json=body, headers={"x-api-key": ALICE})
    assert counted.status_code == 200, counted.text
    assert "x-api-key" not in fake.counted[-1].headers
    assert gw.client.get("/v1/models").status_code == 401
    assert gw.client.get("/v1/models", headers=bearer(ALICE)).status_code == 200
    assert gw.client.get("/health").status_code == 200


def test_no_key_appears_in_the_gateway_log(keyed):
    gw, _ = keyed
    gw.client.post("/v1/chat/completions", json=chat("log"), headers={"x-api-key": BOB[:-1] + "X"})
    gw.client.post("/v1/chat/completions", json=chat("log"), headers=bearer(BOB))
    text = gw.log.getvalue()
    assert "client not authenticated" in text  # the refusal is logged ...
    for secret in (ALICE, BOB, BATCH, BOB[:-1] + "X"):
        assert secret not in text  # ... and no key, good or bad


# -- sessions belong to their key -------------------------------------------------------------


def test_another_key_cannot_join_or_end_a_session_and_its_owner_can(keyed):
    gw, fake = keyed
    assert _post(gw.url, "owned-1", ALICE).status_code == 200
    calls = len(fake.seen)
    joined = _post(gw.url, "owned-1", BOB)
    assert joined.status_code == 403
    assert joined.json()["error"]["type"] == "permission_error"
    assert "belongs to another client key" in joined.json()["error"]["message"]
    ended = _post(gw.url, "owned-1", BOB, **{"x-dynamo-session-final": "true"})
    assert ended.status_code == 403
    assert len(fake.seen) == calls  # neither reached the worker
    assert gw.programs()["owned-1"]["steps"] == 1  # the program goes on, untouched
    assert _post(gw.url, "owned-1", ALICE, **{"x-dynamo-session-final": "true"}).status_code == 200
    wait_for(lambda: "owned-1" not in gw.programs(), what="owned-1 ended by its owner")
    keys = gw.parts.admission.clients
    assert [keys.calls_of(key) for key in keys.keys] == [0, 0, 0]  # every call counted out


def test_another_key_cannot_end_a_session_on_the_anthropic_route_either(keyed):
    gw, _ = keyed
    first = gw.client.post("/v1/messages", json=messages_body("mine"),
                           headers={"x-api-key": ALICE, "x-claude-code-session-id": "cc-owned"})
    assert first.status_code == 200, first.text
    r = gw.client.post("/v1/messages", json=messages_body("yours?"),
                       headers={"x-api-key": BOB, "x-claude-code-session-id": "cc-owned",
                                "x-dynamo-session-final": "true"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert "cc-owned" in gw.programs()


def test_another_keys_session_cannot_be_named_as_a_parent(keyed):
    gw, _ = keyed
    assert _post(gw.url, "parent-of-alice", ALICE).status_code == 200
    r = _post(gw.url, "bobs-child", BOB, **{"x-dynamo-parent-session-id": "parent-of-alice"})
    assert r.status_code == 403 and "parent session" in r.json()["error"]["message"]
    assert "bobs-child" not in gw.programs()


def test_an_ended_session_id_is_free_for_another_key(keyed):
    gw, _ = keyed
    assert _post(gw.url, "reused", ALICE, **{"x-dynamo-session-final": "true"}).status_code == 200
    wait_for(lambda: "reused" not in gw.programs(), what="reused ended")
    assert _post(gw.url, "reused", BOB).status_code == 200
    assert _post(gw.url, "reused", ALICE).status_code == 403  # Bob's now


def test_two_keys_sending_the_same_opening_without_identity_get_programs_of_their_own(keyed):
    gw, fake = keyed
    body = chat("an opening both keys send, with no session id")
    a = gw.client.post("/v1/chat/completions", json=body, headers=bearer(ALICE))
    alice_session = fake.seen[-1].body["session_id"]
    b = gw.client.post("/v1/chat/completions", json=body, headers=bearer(BOB))
    bob_session = fake.seen[-1].body["session_id"]
    assert a.status_code == b.status_code == 200
    assert alice_session != bob_session
    assert gw.parts.admission.clients.owner(alice_session).name == "alice"
    assert gw.parts.admission.clients.owner(bob_session).name == "bob"


def test_a_conversation_another_key_continues_starts_a_program_of_its_own(keyed):
    """Bob replays Alice's conversation, answer and all: the gateway would continue Alice's
    program by content; Bob's call gets a new program of his own instead of a 403."""
    gw, fake = keyed
    opening = chat("a conversation Bob replays")
    first = gw.client.post("/v1/chat/completions", json=opening, headers=bearer(ALICE))
    assert first.status_code == 200
    alice_session = fake.seen[-1].body["session_id"]
    answer = first.json()["choices"][0]["message"]
    follow_up = {**opening, "messages": [*opening["messages"], answer,
                                         {"role": "user", "content": "and then?"}]}
    replay = gw.client.post("/v1/chat/completions", json=follow_up, headers=bearer(BOB))
    assert replay.status_code == 200, replay.text
    bob_session = fake.seen[-1].body["session_id"]
    assert bob_session != alice_session
    assert gw.parts.admission.clients.owner(bob_session).name == "bob"
    own = gw.client.post("/v1/chat/completions", json=follow_up, headers=bearer(ALICE))
    assert own.status_code == 200
    assert fake.seen[-1].body["session_id"] == alice_session  # Alice still continues hers


# -- each key's own bounds ----------------------------------------------------------------------


def test_a_key_past_its_own_max_programs_gets_429_in_each_routes_shape_and_others_go_on(keyed):
    gw, _ = keyed
    assert _post(gw.url, "batch-1", BATCH).status_code == 200
    assert _post(gw.url, "batch-2", BATCH).status_code == 200
    refused = _post(gw.url, "batch-3", BATCH)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "max_programs of clients:" in refused.json()["error"]["message"]
    anthropic = gw.client.post("/v1/messages", json=messages_body(),
                               headers={"x-api-key": BATCH, "x-session-id": "batch-4"})
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "5"
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "rate_limit_error"
    assert "batch-3" not in gw.programs() and "batch-4" not in gw.programs()
    assert _post(gw.url, "batch-1", BATCH).status_code == 200  # its programs go on
    assert _post(gw.url, "alice-free", ALICE).status_code == 200  # other keys are not bound by it
    assert gw.parts.admission.refusals["client_max_programs"] == 2
    # a program that ends makes room again
    assert _post(gw.url, "batch-2", BATCH, **{"x-dynamo-session-final": "true"}).status_code == 200
    wait_for(lambda: "batch-2" not in gw.programs(), what="batch-2 ended")
    assert _post(gw.url, "batch-3", BATCH).status_code == 200
    assert gw.parts.admission.disagreements() == []


def test_a_key_past_its_own_max_held_calls_gets_429(tmp_path):
    keys = tmp_path / "clients.yaml"
    keys.write_text(KEYS_YAML)
    with fakes("w0", "w1") as started:
        workers = {f.name: f for f, _ in started}
        config = serve_config([{"name": f.name, "url": s.url, "capacity_tokens": TINY}
                               for f, s in started], clients={"keys_file": str(keys)},
                              forward_client_headers=FORWARDED)
        with gateway(config) as gw, ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(_post, gw.url, s, ALICE, **{"x-test-delay-s": "1.0"})
                    for s in ("a", "b")]
            wait_for(lambda: all(any(s in f.sessions() for f in workers.values()) for s in ("a", "b")),
                     timeout=15, what="a and b upstream")
            held = pool.submit(_post, gw.url, "held-batch", BATCH)
            wait_for(lambda: gw.programs().get("held-batch", {}).get("waiting") == 1,
                     timeout=15, what="held-batch held")
            refused = _post(gw.url, "held-batch-2", BATCH)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert "max_held_calls of clients:" in refused.json()["error"]["message"]
            assert "held-batch-2" not in gw.programs()
            # Alice has no bound of her own: her call is held next to Batch's
            other = pool.submit(_post, gw.url, "held-alice", ALICE)
            wait_for(lambda: gw.programs().get("held-alice", {}).get("waiting") == 1,
                     timeout=15, what="held-alice held")
            assert all(call.result().status_code == 200 for call in (*busy, held, other))
        assert gw.parts.admission.refusals["client_max_held_calls"] == 1
        assert gw.parts.admission._held_by_client == {}  # every held call counted out
        assert gw.parts.admission.disagreements() == []


# -- configuration ----------------------------------------------------------------------------


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_TEST_CLIENT_KEYS", f'{{"ci": "{ALICE}"}}')
    with fakes("w0") as started:
        _, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}],
                              clients={"keys_env": "SLUICE_TEST_CLIENT_KEYS"})
        with gateway(config) as gw:
            assert gw.client.post("/v1/chat/completions", json=chat("env")).status_code == 401
            r = gw.client.post("/v1/chat/completions", json=chat("env"), headers=bearer(ALICE))
            assert r.status_code == 200


def test_a_gateway_told_to_require_keys_does_not_start_without_them(monkeypatch, tmp_path):
    monkeypatch.delenv("SLUICE_TEST_CLIENT_KEYS", raising=False)
    workers = [{"name": "w0", "url": "http://127.0.0.1:9"}]
    with pytest.raises(ConfigError, match="clients.keys_env .SLUICE_TEST_CLIENT_KEYS.: the "
                                          "environment variable is not set"):
        create_app(serve_config(workers, clients={"keys_env": "SLUICE_TEST_CLIENT_KEYS"}))
    with pytest.raises(ConfigError, match="clients.keys_file .*: cannot read the file"):
        create_app(serve_config(workers, clients={"keys_file": str(tmp_path / "missing.yaml")}))


def test_without_keys_any_client_may_use_and_end_any_session():
    """The behaviour before client keys: no key needed, whatever Authorization a client
    sends, and any client may end any session."""
    with fakes("w0") as started:
        _, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}])
        with gateway(config) as gw:
            assert gw.parts.admission.clients is None
            assert _post(gw.url, "open", "anything-goes").status_code == 200
            assert _post(gw.url, "open", "someone-else", **{"x-dynamo-session-final": "true"}).status_code == 200
            wait_for(lambda: "open" not in gw.programs(), what="open ended")
