"""Client keys (controller/client_keys.py): their file format and errors, the ``clients:``
config section, authentication, and which key owns which session."""

from __future__ import annotations

import pytest

from controller.client_keys import (
    SWEEP_MIN_ENTRIES,
    ClientKeys,
    load_client_keys,
    parse_client_keys,
    without_credentials,
)
from controller.errors import GatewayError
from controller.identity import resolve_identity
from controller.serve_config import ClientsConfig, load_serve_config, parse_serve_config
from scheduler.config import ConfigError

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
WORKERS = [{"name": "w0", "url": "http://127.0.0.1:8000"}]


def _keys(**defaults) -> ClientKeys:
    text = f"alice: {ALICE}\nbob:\n  key: {BOB}\n  max_programs: 3\n  max_held_calls: null\n"
    return ClientKeys(parse_client_keys(text, "test", ClientsConfig(**defaults)))


# -- the format ----------------------------------------------------------------------------


def test_short_and_long_entries_and_the_clients_defaults():
    keys = _keys(max_programs=10, max_held_calls=4)
    alice, bob = keys.keys
    assert (alice.name, alice.max_programs, alice.max_held_calls) == ("alice", 10, 4)
    # Bob's own max_programs wins; his explicit null means no bound of his own
    assert (bob.name, bob.max_programs, bob.max_held_calls) == ("bob", 3, None)
    assert ALICE not in repr(alice) and "digest" not in repr(alice)


def test_json_is_read_as_well():
    keys = parse_client_keys(f'{{"ci": {{"key": "{ALICE}", "max_programs": 2}}}}', "env",
                             ClientsConfig())
    assert [(k.name, k.max_programs) for k in keys] == [("ci", 2)]


@pytest.mark.parametrize("text,expected", [
    ("alice: short-key", "test: alice.key: String should have at least 16 characters"),
    (f"alice: {{key: {ALICE}, max_programs: 0}}", "test: alice.max_programs: Input should be greater than or equal to 1"),
    (f"alice: {{key: {ALICE}, colour: red}}", "test: alice.colour: Extra inputs are not permitted"),
    ('alice: "sk-with a space-0123456"', "test: alice.key: must be printable ASCII without spaces"),
    (f'"two words": {ALICE}', "key name 'two words' must be 1 to 64 printable ASCII"),
    ("[]", "test: must be a mapping of key names to keys"),
    ("", "test: must be a mapping of key names to keys"),
])
def test_a_bad_key_file_names_the_key_and_field_and_never_repeats_the_key(text, expected):
    with pytest.raises(ConfigError) as raised:
        parse_client_keys(text, "test", ClientsConfig())
    assert expected in str(raised.value)
    assert "sk-" not in str(raised.value)


def test_a_yaml_syntax_error_gives_its_position_but_not_the_line():
    with pytest.raises(ConfigError) as raised:
        parse_client_keys(f"alice: {ALICE}\nbob: [{BOB}\n", "test", ClientsConfig())
    assert "test: not valid YAML at line" in str(raised.value)
    assert BOB not in str(raised.value) and ALICE not in str(raised.value)


def test_a_key_given_twice_is_refused_naming_both_names(monkeypatch):
    monkeypatch.setenv("SLUICE_UNIT_KEYS", f"one: {ALICE}\ntwo: {ALICE}\n")
    config = parse_serve_config({"workers": WORKERS, "clients": {"keys_env": "SLUICE_UNIT_KEYS"}})
    with pytest.raises(ConfigError, match="the keys named 'one' and 'two' are the same key"):
        load_client_keys(config)


def test_a_name_in_both_the_file_and_the_environment_is_refused(tmp_path):
    (tmp_path / "keys.yaml").write_text(f"alice: {ALICE}\n")
    config = parse_serve_config({"workers": WORKERS, "clients": {
        "keys_file": str(tmp_path / "keys.yaml"), "keys_env": "SLUICE_UNIT_KEYS"}})
    with pytest.raises(ConfigError, match="the key name 'alice' is given twice"):
        load_client_keys(config, {"SLUICE_UNIT_KEYS": f"alice: {BOB}"})


def test_a_relative_keys_file_is_read_from_the_config_files_folder(tmp_path):
    (tmp_path / "clients.yaml").write_text(f"alice: {ALICE}\n")
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("workers: [{name: w0, url: 'http://127.0.0.1:8000'}]\n"
                           "clients: {keys_file: clients.yaml, max_held_calls: 7}\n")
    keys = load_client_keys(load_serve_config(config_file), {})
    assert keys is not None and [(k.name, k.max_held_calls) for k in keys.keys] == [("alice", 7)]


def test_no_source_means_no_keys_and_bad_section_values_name_the_key():
    assert load_client_keys(parse_serve_config({"workers": WORKERS}), {}) is None
    with pytest.raises(ConfigError, match="clients.max_programs: Input should be greater"):
        parse_serve_config({"workers": WORKERS, "clients": {"max_programs": 0}})
    with pytest.raises(ConfigError, match="clients.keys: Extra inputs are not permitted"):
        parse_serve_config({"workers": WORKERS, "clients": {"keys": [ALICE]}})


# -- authentication --------------------------------------------------------------------------


@pytest.mark.parametrize("headers,name", [
    ({"authorization": f"Bearer {ALICE}"}, "alice"),
    ({"authorization": f"bearer   {BOB} "}, "bob"),
    ({"x-api-key": BOB}, "bob"),
    ({"x-api-key": ALICE, "authorization": f"Bearer {ALICE}"}, "alice"),
])
def test_a_key_is_taken_from_either_header(headers, name):
    assert _keys().authenticate(headers).name == name


@pytest.mark.parametrize("headers,problem", [
    ({}, "this gateway needs a client key"),
    ({"authorization": ALICE}, "must be `Bearer <key>`"),
    ({"authorization": "Bearer "}, "must be `Bearer <key>`"),
    ({"x-api-key": ALICE[:-1]}, "the key in the x-api-key header is not a client key"),
    ({"x-api-key": ALICE + "x"}, "is not a client key"),
    ({"x-api-key": "sk-alicé-0123456789abcdef"}, "is not a client key"),
    ({"x-api-key": ALICE, "authorization": f"Bearer {BOB}"}, "two different keys"),
    ({"x-api-key": ALICE, "authorization": "Bearer sk-unknown-000000000000"},
     "the key in the authorization header is not a client key"),
])
def test_a_missing_wrong_or_ambiguous_key_is_a_401(headers, problem):
    with pytest.raises(GatewayError) as raised:
        _keys().authenticate(headers)
    assert raised.value.status == 401 and raised.value.code == "invalid_api_key"
    assert problem in raised.value.message
    assert ALICE not in raised.value.message and BOB not in raised.value.message


def test_the_key_headers_are_taken_out_of_what_is_forwarded():
    raw = [(b"Authorization", b"Bearer x"), (b"x-api-key", b"y"), (b"X-API-Key", b"z"),
           (b"x-session-id", b"s"), (b"content-type", b"application/json")]
    assert without_credentials(raw) == [(b"x-session-id", b"s"),
                                        (b"content-type", b"application/json")]


# -- ownership -------------------------------------------------------------------------------


class Programs(set):
    """The policy's live programs, as ``has_program`` answers."""

    def __call__(self, session_id: str) -> bool:
        return session_id in self


def test_a_session_is_its_first_keys_until_it_ends_and_no_call_is_on_the_way():
    keys, programs = _keys(), Programs()
    alice, bob = keys.keys
    keys.claim(alice, "s1", None, programs)
    # a call on the way, no program yet: already Alice's
    with pytest.raises(GatewayError) as raised:
        keys.claim(bob, "s1", None, programs)
    assert raised.value.status == 403 and "belongs to another client key" in raised.value.message
    programs.add("s1")
    keys.call_ended(alice, "s1")
    with pytest.raises(GatewayError):  # the program lives on between calls
        keys.check(bob, "s1", None, programs)
    with pytest.raises(GatewayError, match="parent session s1"):
        keys.claim(bob, "s2", "s1", programs)
    assert keys.owner("s2") is None  # a refused claim takes nothing
    keys.claim(alice, "s1", None, programs)  # its owner goes on
    keys.call_ended(alice, "s1")
    programs.discard("s1")  # the program ended (final call, release, idle)
    keys.claim(bob, "s1", None, programs)
    assert keys.owner("s1") is bob
    assert keys.programs_of(alice, programs) == 0


def test_programs_are_counted_per_key_and_unused_ownerships_are_swept():
    keys, programs = _keys(), Programs()
    alice, bob = keys.keys
    for i in range(SWEEP_MIN_ENTRIES + 10):
        keys.claim(alice, f"a{i}", None, programs)
        keys.call_ended(alice, f"a{i}")
        if i < 5:
            programs.add(f"a{i}")
    keys.claim(bob, "b0", None, programs)
    programs.add("b0")
    assert keys.programs_of(alice, programs) == 5
    assert keys.programs_of(bob, programs) == 1
    # the sweep at SWEEP_MIN_ENTRIES kept only the live ones and those claimed since
    assert len(keys._owners) < SWEEP_MIN_ENTRIES
    assert keys.owner("a0") is alice and keys.owner("a6") is None


# -- content sessions per key ----------------------------------------------------------------


def test_a_content_session_is_named_per_key_and_unchanged_without_one():
    body = {"model": "m", "messages": [{"role": "user", "content": "same opening"}]}
    plain, _ = resolve_identity("/v1/chat/completions", {}, body)
    again, _ = resolve_identity("/v1/chat/completions", {}, body, tenant=None)
    alice, _ = resolve_identity("/v1/chat/completions", {}, body, tenant="alice")
    bob, _ = resolve_identity("/v1/chat/completions", {}, body, tenant="bob")
    assert plain.session_id == again.session_id
    assert len({plain.session_id, alice.session_id, bob.session_id}) == 3
    assert alice.session_id.startswith("c-")
    named, _ = resolve_identity("/v1/chat/completions", {"x-session-id": "s"}, body, tenant="bob")
    assert named.session_id == "s"  # a session the client names is not renamed
