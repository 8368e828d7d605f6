"""Fuzz target: the directive envelope decoder (sluice_vllm_plugin/directive_envelope.py),
shared by the engine plugin and the simworker, and the receivers built on it: the
simworker's directive socket handler (simworker/directive_socket.py) on a real simulated
engine, and the plugin's (sluice_vllm_plugin/directives.py), with the directive limits
(sluice_vllm_plugin/directive_limits.py) in between.

Inputs: arbitrary bytes, arbitrary msgpack and JSON structures, nesting deeper than any
decoder's limit, and envelopes close to valid with fields of the wrong type or out of range.

Properties: :func:`decode` returns an :class:`Envelope` or raises ``ValueError`` (or
``RecursionError`` for nesting too deep, which both handlers catch); a handler never raises,
and every message it takes is accounted for: dropped and counted by reason, or its actions
applied, refused by the limits or dropped as failed, one count each.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
from hypothesis import event, given
from hypothesis import strategies as st

from simworker.config import SimWorkerConfig
from simworker.worker import SimWorker
from sluice_vllm_plugin.directive_envelope import SESSION_ID_MAX_LEN, Envelope, decode
from sluice_vllm_plugin.directive_limits import DirectiveLimits
from sluice_vllm_plugin.directives import DirectiveServer
from tests.fuzz.profiles import fuzz_settings
from tests.fuzz.strategies import DEEP_JSON, JSON_VALUES, TEXT, weighted

VERBS = ["kv.retain", "kv.demote", "kv.release", "kv.offload", "kv.prefetch"]
# msgpack carries what JSON cannot: bytes, NaN and infinities, ints to 2**64 - 1.
MSGPACK_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                           st.floats(), TEXT, st.binary(max_size=20))
MSGPACK_VALUES = st.recursive(
    MSGPACK_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(TEXT, st.integers(-5, 5)), inner, max_size=4)),
    max_leaves=20,
)
# integers within what msgpack can carry (a JSON message may hold larger ones: JSON_VALUES)
NUMBERS = st.one_of(st.floats(), st.integers(-5, 300), st.integers(-(2**63), 2**64 - 1),
                    st.sampled_from([math.inf, -0.0, 1e308, 5e-324]))


@st.composite
def near_valid_envelopes(draw: st.DrawFn) -> dict:
    """An envelope of one to three actions with some values hostile: what a sender that
    almost speaks the protocol, or one probing its bounds, would send."""
    def value(good: Any, hostile: st.SearchStrategy) -> Any:
        return draw(hostile) if draw(st.integers(0, 4)) == 0 else good

    actions = []
    for _ in range(draw(st.integers(0, 3))):
        payload = {
            "session_id": value(draw(st.text(min_size=1, max_size=12)),
                                st.one_of(st.just(""), st.just("s" * (SESSION_ID_MAX_LEN + 1)),
                                          MSGPACK_VALUES)),
            "priority": value(draw(st.integers(0, 100)), st.one_of(NUMBERS, MSGPACK_VALUES)),
            "ttl_s": value(draw(st.floats(0, 1e6)), st.one_of(NUMBERS, MSGPACK_VALUES)),
            "deadline_s": value(draw(st.one_of(st.none(), st.floats(0, 1e6))), NUMBERS),
            "continuation_id": value(draw(st.one_of(st.none(), TEXT)), MSGPACK_VALUES),
        }
        for name in draw(st.lists(st.sampled_from(sorted(payload)), max_size=2)):
            payload.pop(name, None)
        actions.append({"action_type": value(draw(st.sampled_from(VERBS)), MSGPACK_VALUES),
                        "action_id": value("a1", MSGPACK_VALUES),
                        "action_version": value(1, MSGPACK_VALUES),
                        "payload": value(payload, MSGPACK_VALUES)})
    return {"protocol_version": value(1, MSGPACK_VALUES),
            "message_id": value("m1", MSGPACK_VALUES),
            "actions": value(actions, MSGPACK_VALUES)}


def _as_json(value: Any) -> bytes | None:
    try:
        return json.dumps(value).encode()  # NaN and Infinity as JavaScript writes them
    except (TypeError, ValueError):
        return None  # bytes, or keys JSON cannot name: msgpack only


def _as_msgpack(value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # an integer of JSON_VALUES beyond msgpack's: send it as JSON
        return json.dumps(value).encode()


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """One directive message, as the socket would hand it over."""
    structure = draw(weighted((3, near_valid_envelopes()), (1, MSGPACK_VALUES),
                              (1, JSON_VALUES)))
    kind = draw(st.sampled_from(["json", "msgpack", "msgpack"]))
    if kind == "json" and (text := _as_json(structure)) is not None:
        return text
    return _as_msgpack(structure)


def _deep_msgpack(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of one, nested, around a nil


DIRECTIVE_MESSAGES = weighted(
    (6, messages()),
    (1, st.binary(max_size=300)),
    (1, DEEP_JSON),
    (1, st.sampled_from([50, 999, 1_001, 5_000, 100_000]).map(_deep_msgpack)),
    # a valid envelope cut short, or with bytes after it
    (1, st.tuples(messages(), st.integers(0, 400), st.binary(max_size=8)).map(
        lambda t: t[0][:t[1]] + t[2])),
)


@fuzz_settings(short_examples=200)
@given(message=DIRECTIVE_MESSAGES)
def test_the_envelope_decoder_returns_an_envelope_or_raises_value_error(message):
    try:
        envelope = decode(message)
    except ValueError:
        event("rejected")
        return
    except RecursionError:
        event("too deep")  # both handlers catch it; msgspec gives up at the interpreter's limit
        return
    event("decoded")
    assert isinstance(envelope, Envelope)
    for action in envelope.actions:
        assert 1 <= len(action.payload.session_id) <= SESSION_ID_MAX_LEN


# a small session budget, so that the limits' refusals are reached too
LIMITS = DirectiveLimits(max_sessions=8, max_ttl_s=60.0, forget_after_s=120.0,
                         max_session_retained_blocks=4, max_retained_blocks=16)


def _simworker_socket():
    worker = SimWorker(SimWorkerConfig(name="fuzz", num_blocks=64, block_size=16, kv_events=None,
                                       directives="tcp://127.0.0.1:*", **{
                                           f"directive_{field}": getattr(LIMITS, field) for field in (
                                               "max_sessions", "max_ttl_s", "forget_after_s",
                                               "max_session_retained_blocks", "max_retained_blocks")}))
    return worker.directives  # never opened: handle() is what the socket's loop calls


SIMWORKER_SOCKET = _simworker_socket()


@fuzz_settings(short_examples=200)
@given(batch=st.lists(DIRECTIVE_MESSAGES, min_size=1, max_size=4))
def test_the_simworker_directive_handler_survives_and_counts_every_message(batch):
    sock = SIMWORKER_SOCKET
    for message in batch:
        received, applied = sock.received, sock.applied
        dropped, refused = sock.dropped, sock.refused
        sock.handle(message)  # must not raise
        assert sock.received == received + 1
        counted = (sock.applied - applied) + (sock.dropped - dropped) + (sock.refused - refused)
        try:
            actions = len(decode(message).actions)
        except (ValueError, RecursionError):
            assert sock.dropped == dropped + 1 and sock.applied == applied
            event("dropped")
            continue
        event("decoded")
        assert counted == actions, (counted, actions)
    assert sock.governor.sessions <= LIMITS.max_sessions
    assert sock.governor.retained_blocks <= LIMITS.max_retained_blocks


class _CountingInbox:
    """Stands in for the plugin's inbox (sluice_vllm_plugin/retention.py, which needs vLLM):
    it counts what the handler posts. What is under test is the handler's reading of
    untrusted bytes, not the retention behind it (the fidelity tier runs that in vLLM)."""

    def __init__(self) -> None:
        self.posted = 0

    def __call__(self, action: Any) -> None:
        self.posted += 1


@fuzz_settings(short_examples=150)
@given(batch=st.lists(DIRECTIVE_MESSAGES, min_size=1, max_size=4))
def test_the_plugin_directive_handler_survives_and_counts_every_message(batch):
    # made without __init__, which binds a socket and starts a thread: handle() alone is the
    # part that reads untrusted bytes (the class says so)
    server = DirectiveServer.__new__(DirectiveServer)
    receiver = _CountingInbox()
    server._post = receiver
    server.received = server.applied = server.dropped = 0
    for message in batch:
        dropped, applied = server.dropped, server.applied
        server.handle(message)
        try:
            actions = len(decode(message).actions)
        except (ValueError, RecursionError):
            assert server.dropped == dropped + 1 and server.applied == applied
            continue
        assert server.applied == applied + actions and server.dropped == dropped
    assert server.received == len(batch)
    assert receiver.posted == server.applied
