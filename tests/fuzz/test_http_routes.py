"""Fuzz target: the gateway's HTTP routes, bodies and headers.

The proxied routes (chat completions, completions, responses, messages) and the token
count get bodies from plausible to hostile (fields of the wrong type, huge numbers, any
unicode, nesting deeper than the parser's limit, bytes that are not JSON) with hostile
session, parent, final, priority and content headers. The admin API gets its requests with
and without the admin token, bodies for ``POST /sluice/workers`` included.

Property, for every input: the answer is the worker's success or a well-formed JSON error
with a 4xx status (never a 5xx: the worker is healthy, so a 5xx is the gateway's fault or a
worker's crash); the gateway still serves; and once the answer is in, no call is left held or
in flight, in the admission shell or in the policy, and every program the admin API lists
can be released.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from tests.support.gateway_harness import ADMIN, ADMIN_TOKEN

from controller.errors import is_anthropic_route
from tests.fuzz.gateway_fixture import WORKER, FuzzGateway, fuzz_gateway, path_segment, simworker
from tests.fuzz.profiles import fuzz_settings
from tests.fuzz.strategies import (
    HEADER_VALUES,
    JSON_VALUES,
    NOT_JSON,
    SHORT_ASCII,
    TEXT,
    encode_json,
    request_bodies,
    request_headers,
    weighted,
)

PROXIED = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
COUNT_TOKENS = "/v1/messages/count_tokens"


@pytest.fixture(scope="module")
def worker():
    with simworker() as (server, sim):
        yield server, sim


@pytest.fixture(scope="module")
def gw(worker) -> FuzzGateway:
    server, sim = worker
    with fuzz_gateway(server, sim) as gateway:
        yield gateway


def assert_json_error(response, route: str) -> None:
    """A 4xx whose body is a JSON error in OpenAI's shape or Anthropic's (the gateway's
    errors on /v1/messages are Anthropic's; a vLLM worker's validation errors are always
    OpenAI's, and the gateway relays those as they came)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    error = body["error"]
    assert isinstance(error.get("message"), str), body
    if body.get("type") == "error":  # Anthropic's shape
        assert is_anthropic_route(route) and isinstance(error.get("type"), str), body


def assert_worker_success(response) -> None:
    """A 2xx relayed from the simworker: a JSON answer, or a stream of server-sent events."""
    assert 200 <= response.status_code < 300, response.status_code
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.content.startswith((b"data: ", b"event: ")), response.content[:200]
    else:
        assert isinstance(response.json(), dict), response.text[:200]


def assert_settled(gw: FuzzGateway) -> None:
    """Nothing held or in flight, every program idle and releasable, and still serving."""
    left = gw.nothing_held()
    assert not left, left
    programs = gw.programs()
    for program in programs:
        assert program["in_flight"] == 0 and program["waiting"] == 0, program
    gw.release_all(programs)
    assert gw.client.get("/health").status_code == 200


@st.composite
def proxied_requests(draw: st.DrawFn) -> tuple[str, bytes, list[tuple[bytes, bytes]]]:
    route = draw(st.sampled_from(PROXIED + [COUNT_TOKENS]))
    return route, draw(request_bodies(route)), draw(request_headers())


@fuzz_settings(short_examples=120)
@given(request=proxied_requests())
def test_proxied_routes_answer_the_workers_success_or_a_json_4xx(gw, request):
    route, body, headers = request
    response = gw.client.post(route, content=body, headers=headers)
    event(f"{route} answered {response.status_code}")  # what the inputs reach (--hypothesis-show-statistics)
    if response.status_code < 300:
        assert_worker_success(response)
    else:
        assert_json_error(response, route)
    assert_settled(gw)


# -- the admin API -------------------------------------------------------------------------

# mostly the token, so that most inputs reach the admin routes' own checks
AUTHORIZATIONS = weighted(
    (6, st.just(ADMIN["Authorization"].encode())),
    (1, st.just(None)),
    (2, st.sampled_from([b"Bearer", b"Bearer ", b"bearer " + ADMIN_TOKEN.encode(),
                     b"Bearer  " + ADMIN_TOKEN.encode() + b"  ", b"Basic " + ADMIN_TOKEN.encode(),
                     ADMIN_TOKEN.encode(), b"Bearer " + ADMIN_TOKEN.encode() + b"x",
                     b"Bearer " + ADMIN_TOKEN[:-1].encode()])),
    (1, HEADER_VALUES),
)

WORKER_URLS = st.one_of(
    st.sampled_from(["http://127.0.0.1:1", "http://169.254.169.254", "http://[::1]:1",
                     "http://127.0.0.1:1/path", "ftp://127.0.0.1", "http://user@127.0.0.1:1",
                     "http://10.0.0.1:8000?x=1", "", "http://"]),
    TEXT,
    JSON_VALUES,
)


@st.composite
def worker_entries(draw: st.DrawFn) -> dict:
    """``POST /sluice/workers`` bodies: a worker entry with fields swapped or added."""
    entry = {"name": draw(st.one_of(st.just(WORKER), SHORT_ASCII, TEXT, JSON_VALUES)),
             "url": draw(WORKER_URLS)}
    optional = {
        "capacity_tokens": st.one_of(st.integers(-1, 10**6), JSON_VALUES),
        "kv_events": st.one_of(st.none(), st.just("tcp://127.0.0.1:1"), JSON_VALUES),
        "directives": st.one_of(st.none(), st.just("tcp://127.0.0.1:1"), JSON_VALUES),
        "scheduling_policy": st.one_of(st.sampled_from(["fcfs", "priority"]), JSON_VALUES),
        "api_key_env": JSON_VALUES,
        "api_key_file": JSON_VALUES,
        "unknown_field": JSON_VALUES,
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        entry[key] = draw(optional[key])
    return entry


NAMES = st.one_of(st.just(WORKER), SHORT_ASCII, st.just("no-such-worker"))
ACTIONS = st.one_of(st.sampled_from(["drain", "sleep", "wake"]), SHORT_ASCII)


@st.composite
def admin_requests(draw: st.DrawFn) -> tuple[str, str, bytes | None]:
    """One admin request: method, path (quoted) and body."""
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return "GET", draw(st.sampled_from(["/sluice/programs", "/sluice/workers",
                                            "/sluice/config"])), None
    if kind == 1:
        body = draw(st.one_of(st.builds(encode_json, worker_entries()),
                              st.builds(encode_json, JSON_VALUES), NOT_JSON))
        return "POST", "/sluice/workers", body
    if kind == 2:
        return "POST", f"/sluice/workers/{quote(draw(NAMES), safe='')}/" \
                       f"{quote(draw(ACTIONS), safe='')}", draw(st.one_of(st.none(), NOT_JSON))
    if kind == 3:
        return "DELETE", f"/sluice/workers/{quote(draw(NAMES), safe='')}", None
    if kind == 4:
        session = draw(st.one_of(SHORT_ASCII, TEXT))
        return "POST", f"/sluice/programs/{quote(session, safe='')}/release", None
    if kind == 5:
        return "POST", "/sluice/reload", draw(st.one_of(st.none(), NOT_JSON))
    if kind == 6:
        # a method a route does not take
        return draw(st.sampled_from(["PUT", "PATCH", "DELETE", "GET"])), \
            draw(st.sampled_from(["/sluice/reload", "/sluice/config", "/sluice/programs/x/release"])), None
    tail = quote(draw(TEXT), safe="/")
    return draw(st.sampled_from(["GET", "POST"])), f"/sluice/{tail}", None


def restore_fleet(gw: FuzzGateway) -> None:
    """Put the fleet back as it was: the one simworker serving, nothing else in it."""
    workers = gw.workers()
    for name in workers:
        if name == WORKER:
            continue
        path = f"/sluice/workers/{path_segment(name)}"
        drained = gw.client.post(path + "/drain", headers=ADMIN)
        assert drained.status_code == 200, (drained.text, gw.log.tail())
        removed = gw.client.delete(path, headers=ADMIN)
        assert removed.status_code == 200, (removed.text, gw.log.tail())
    if WORKER not in workers:
        added = gw.client.post("/sluice/workers", json=gw.worker_entry, headers=ADMIN)
        if added.status_code != 201:
            print(gw.log.tail())  # what led to it, shown with the failure
        assert added.status_code == 201, added.text
    if WORKER not in workers or workers[WORKER]["mode"] != "serving":
        woken = gw.client.post(f"/sluice/workers/{WORKER}/wake", headers=ADMIN)
        assert woken.status_code == 200, woken.text


@fuzz_settings(short_examples=60)
@given(requests=st.lists(admin_requests(), min_size=1, max_size=3), authorization=AUTHORIZATIONS)
def test_admin_api_answers_json_and_only_to_its_token(gw, requests, authorization):
    headers = [] if authorization is None else [(b"authorization", authorization)]
    authorized = authorization is not None and _is_the_token(authorization)
    for method, path, body in requests:
        response = gw.client.request(method, path, content=body, headers=headers)
        event(f"{method} answered {response.status_code}")
        assert response.status_code < 500, (method, path, response.status_code, response.text[:500])
        payload = response.json()
        assert isinstance(payload, dict), payload
        if response.status_code >= 400:
            assert isinstance(payload.get("error", {}).get("message"), str), payload
        elif not authorized:
            raise AssertionError(f"{method} {path} answered {response.status_code} "
                                 f"without the admin token: {payload}")
    restore_fleet(gw)
    assert_settled(gw)
    # and a call still goes through to the worker
    ok = gw.client.post("/v1/chat/completions", json={
        "model": "sluice-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    assert_settled(gw)


def _is_the_token(header: bytes) -> bool:
    """Whether the admin API should take ``header`` (as controller/admin_api.py reads it:
    the scheme case-insensitive, the token with its surrounding spaces stripped)."""
    scheme, _, given = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and given.strip() == ADMIN_TOKEN


def test_the_error_shapes_are_what_the_property_reads(gw):
    """The checks above are not vacuous: a bad body is a JSON 400, the admin API without its
    token a JSON 401, a good call the worker's 200."""
    bad = gw.client.post("/v1/messages", content=b"{", headers={})
    assert_json_error(bad, "/v1/messages")
    assert json.loads(bad.content)["type"] == "error"
    denied = gw.client.get("/sluice/programs")
    assert denied.status_code == 401 and "message" in denied.json()["error"]
    ok = gw.client.post("/v1/messages", json={"model": "sluice-sim", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]},
                        headers={"x-session-id": "shape-check"})
    assert_worker_success(ok)
    assert [p["session_id"] for p in gw.programs()] == ["shape-check"]
    assert_settled(gw)
    assert gw.programs() == []


def test_the_last_worker_removed_can_join_again(gw):
    """Found by the admin target: with its only worker put to sleep and removed, the fleet's
    task group was left without tasks and ended, and every later ``POST /sluice/workers``
    was a 503 ("the gateway is not running") until a restart."""
    assert gw.client.post(f"/sluice/workers/{WORKER}/sleep", headers=ADMIN).status_code == 200
    assert gw.client.delete(f"/sluice/workers/{WORKER}", headers=ADMIN).status_code == 200
    assert gw.workers() == {}
    added = gw.client.post("/sluice/workers", json=gw.worker_entry, headers=ADMIN)
    assert added.status_code == 201, added.text
    ok = gw.client.post("/v1/chat/completions", headers={"x-session-id": "after-rejoin"}, json={
        "model": "sluice-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    assert_settled(gw)


@pytest.mark.parametrize("session", ["2,%bd", ".", ".."])
def test_a_program_whose_id_is_awkward_in_a_path_is_released(gw, session):
    """Found by the proxied-routes target: ``2,%bd`` could not be released through the
    TestClient, which decodes a path twice, nor ``.``, a dot segment every client drops
    from a path (gateway_fixture.path_segment)."""
    ok = gw.client.post("/v1/chat/completions", headers={"x-session-id": session}, json={
        "model": "sluice-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
    assert [p["session_id"] for p in gw.programs()] == [session]
    assert_settled(gw)
    assert gw.programs() == []
