"""Fuzz target: the gateway's parsers at its client edge, as pure functions, so they get many
more inputs than the HTTP targets can: the body reader's JSON parsing and ``stream`` check
(controller/request_body.py), the identity resolver and the prompt readers behind it for each
API (controller/identity.py, controller/prompt.py) with the body preparation the relay does
next (controller/upstream.py), and the client-key check of request headers
(controller/client_keys.py).

Properties: each gives its value or refuses with its own error, which the gateway answers as
a 400 or 401 (``GatewayError``, ``IdentityError``; a ``RecursionError`` of a body nested too
deep, which the endpoints turn into a 400); never another exception. What they give holds
together: an identity's ids are valid session ids, its token counts are non-negative and
cumulative, the body to forward carries none of the fields Sluice consumes and encodes as
JSON, the client's parsed body is left as it was, and a client key is one of the gateway's.
"""

from __future__ import annotations

import copy
import math

import msgspec
from hypothesis import event, given
from hypothesis import strategies as st

from controller.client_keys import ClientKeys, parse_client_keys
from controller.errors import GatewayError
from controller.identity import resolve_identity
from controller.prompt import ROUTES, IdentityError
from controller.request_body import check_stream_flag, parse_json_object
from controller.serve_config import ClientsConfig
from controller.upstream import (
    prepare_body,
    sends_engine_priority,
    strip_client_engine_keys,
    with_engine_priority,
)
from scheduler.coordinates import validate_session_id
from tests.fuzz.profiles import fuzz_settings
from tests.fuzz.strategies import (
    HEADER_VALUES,
    JSON_VALUES,
    SESSION_HEADER_NAMES,
    mutated_body,
    request_bodies,
    weighted,
)

ROUTE_LIST = sorted(ROUTES)


@fuzz_settings(short_examples=300)
@given(data=st.data())
def test_the_body_parser_gives_an_object_or_a_400(data):
    route = data.draw(st.sampled_from(ROUTE_LIST))
    raw = data.draw(request_bodies(route))
    try:
        body = parse_json_object(raw)
        check_stream_flag(body)
    except GatewayError as err:
        event("refused")
        assert err.status == 400 and err.message
        return
    event("parsed")
    assert isinstance(body, dict)
    assert body.get("stream") is None or isinstance(body["stream"], bool)


@st.composite
def header_maps(draw: st.DrawFn) -> dict[str, str]:
    """Request headers as the relay hands them on: lower-case names, Latin-1 values."""
    names = draw(st.lists(st.sampled_from(SESSION_HEADER_NAMES + ["authorization", "x-api-key"]),
                          max_size=4, unique=True))
    return {name: draw(HEADER_VALUES).decode("latin-1") for name in names}


IDENTITY_KEYS = ("program_id", "agent_hint", "continuation_id")
ALLOWED_KEYS = st.sampled_from([frozenset(), frozenset({"priority"}), frozenset({"vllm_xargs"}),
                                frozenset({"vllm_xargs.x", "priority", "kv_transfer_params"})])


@fuzz_settings(short_examples=400)
@given(data=st.data())
def test_identity_and_the_forwarded_body_hold_together_or_are_refused(data):
    route = data.draw(st.sampled_from(ROUTE_LIST))
    body = data.draw(weighted((4, mutated_body(route)),
                              (1, st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5))))
    headers = data.draw(header_maps())
    responses = data.draw(st.dictionaries(st.text(max_size=8), st.text(min_size=1, max_size=8),
                                          max_size=2))
    original = copy.deepcopy(body)
    try:
        identity, forward = resolve_identity(route, headers, body, responses.get,
                                             data.draw(st.one_of(st.none(), st.just("tenant-a"))))
    except IdentityError as err:
        event("refused")
        assert str(err)
        return
    except RecursionError:
        event("too deep")  # the relay turns it into a 400
        return
    event(f"identity from {identity.source}")
    assert body == original, "resolve_identity changed the client's body"
    validate_session_id(identity.session_id)
    for other in (identity.parent_session_id, identity.group_id):
        if other is not None:
            validate_session_id(other)
    assert identity.parent_session_id != identity.session_id
    assert identity.chain_tokens and all(t >= 0 for t in identity.chain_tokens)
    assert list(identity.chain_tokens) == sorted(identity.chain_tokens)
    assert identity.prompt_tokens == identity.chain_tokens[-1]
    if identity.hints is not None:
        for value in (identity.hints.deadline_s, identity.hints.retention_ttl_s):
            assert value is None or (math.isfinite(value) and value >= 0)
    assert not any(key in forward for key in IDENTITY_KEYS)
    # what the relay does next, up to the bytes it sends
    strip_client_engine_keys(forward, data.draw(ALLOWED_KEYS))
    prepare_body(route, forward, identity.session_id, identity.chain.head)
    content = msgspec.json.encode(forward)
    if sends_engine_priority(route, forward):
        sent = msgspec.json.decode(with_engine_priority(content, 7))
        assert sent.pop("priority") == 7 and sent == msgspec.json.decode(content)
    assert body == original, "preparing the forwarded body changed the client's body"


SECRETS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-fedcba9876543210"}
KEYS = ClientKeys(parse_client_keys("".join(f"{n}: {s}\n" for n, s in SECRETS.items()), "fuzz",
                                    ClientsConfig()))
CREDENTIALS = weighted(
    (2, st.sampled_from(sorted(SECRETS.values()))),
    (1, HEADER_VALUES.map(lambda b: b.decode("latin-1"))),
    (1, st.sampled_from(sorted(SECRETS.values())).map(lambda s: s[:-1])),
)


@st.composite
def credential_headers(draw: st.DrawFn) -> dict[str, str]:
    headers = {}
    if draw(st.booleans()):
        headers["x-api-key"] = draw(st.one_of(CREDENTIALS, CREDENTIALS.map(lambda s: f"  {s} ")))
    if draw(st.booleans()):
        scheme = draw(st.sampled_from(["Bearer ", "bearer  ", "Basic ", "", "Bearer"]))
        headers["authorization"] = scheme + draw(CREDENTIALS)
    return headers


@fuzz_settings(short_examples=300)
@given(headers=credential_headers())
def test_a_client_key_is_one_of_the_gateways_or_a_401(headers):
    try:
        key = KEYS.authenticate(headers)
    except GatewayError as err:
        event("refused")
        assert err.status == 401
        return
    event(f"key {key.name}")
    assert key in KEYS.keys
    presented = [headers.get("x-api-key", ""), headers.get("authorization", "").partition(" ")[2]]
    assert SECRETS[key.name] in {p.strip() for p in presented}
