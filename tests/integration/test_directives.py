"""The policy's retention actions reach each worker's engine plugin as KvHint envelopes over
a real ZMQ socket, in the shape the plugin's envelope module decodes."""

from __future__ import annotations

import json
from typing import get_args

import msgspec
import pytest
import zmq

from controller.directives import kv_action
from entry.ports import free_port
from scheduler.actions import Demote, Directive, Offload, Prefetch, Release, Retain
from simworker.directive_socket import DirectiveSocket
from sluice_vllm_plugin.directive_envelope import (VERBS, Envelope, KvRetain, RetainPayload, decode,
                                                  encode_json, verb_of)
from tests.support.gateway_harness import chat, fakes, gateway, serve_config


def _envelopes_for_call(headers: dict[str, str]) -> tuple[list[dict], str]:
    """Send one call through a gateway whose worker has a directive endpoint (a PULL socket
    bound here, standing in for the plugin); return every envelope that arrived, and the
    gateway's /metrics text after they did."""
    port = free_port()
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    messages = []
    try:
        with fakes("w0") as started:
            _, server = started[0]
            config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000,
                                    "directives": f"tcp://127.0.0.1:{port}"}])
            with gateway(config) as gw:
                r = gw.client.post("/v1/chat/completions", json=chat(), headers=headers)
                assert r.status_code == 200
                timeout_ms = 5000
                while pull.poll(timeout_ms):
                    messages.append(json.loads(pull.recv()))
                    timeout_ms = 300
                metrics = gw.client.get("/metrics").text
    finally:
        pull.close(linger=0)
        context.term()
    return messages, metrics


def test_a_placed_program_is_retained_on_its_worker_through_the_plugin_socket():
    messages, _ = _envelopes_for_call({"x-session-id": "keep-me"})
    retains = [m for m in messages if m["actions"][0]["action_type"] == "kv.retain"]
    assert retains, messages
    envelope = retains[0]
    assert envelope["protocol_version"] == 1 and envelope["message_id"]
    action = envelope["actions"][0]
    assert action["payload"]["session_id"] == "keep-me"
    assert action["payload"]["priority"] == 90 and action["payload"]["ttl_s"] == 300.0
    decoded = decode(json.dumps(envelope).encode())
    assert decoded.actions == [KvRetain(RetainPayload("keep-me", 90, 300.0, action["payload"].get(
        "continuation_id")), action["action_id"])]


def test_released_program_sends_a_release_directive():
    messages, metrics = _envelopes_for_call({"x-session-id": "done-1", "x-dynamo-session-final": "true"})
    kinds = [(m["actions"][0]["action_type"], m["actions"][0]["payload"]["session_id"]) for m in messages]
    assert ("kv.release", "done-1") in kinds
    sent = {kind: sum(1 for k, _ in kinds if k == f"kv.{kind}") for kind in ("retain", "demote", "release")}
    for kind, n in sent.items():
        assert f'sluice_directives_sent_total{{kind="{kind}"}} {float(n)}' in metrics, metrics


# One table of verbs: the core's directives and the envelope's actions name the same verbs,
# each action's payload is read off its directive's fields, and both engines apply each verb.
DIRECTIVES = {Retain: Retain("s", "w0", 70, 12.5, "c1"), Demote: Demote("s", "w0"),
              Release: Release("s", "w0", "final"), Offload: Offload("s", "w0", "c1"),
              Prefetch: Prefetch("s", "w0", 60, "c1", 5.0)}


def test_the_core_and_the_envelope_name_the_same_verbs():
    assert set(DIRECTIVES) == set(get_args(Directive))
    assert sorted(cls.verb for cls in DIRECTIVES) == sorted(VERBS)


@pytest.mark.parametrize("directive", DIRECTIVES.values(), ids=lambda d: d.verb)
def test_a_directive_travels_as_its_verbs_action_with_its_own_values(directive):
    action = kv_action(directive, "m.0")
    assert verb_of(action) == directive.verb and action.action_id == "m.0"
    payload = msgspec.structs.asdict(action.payload)
    assert payload == {key: getattr(directive, key) for key in payload}
    wire = encode_json(Envelope(1, "m", [action]))
    assert decode(wire).actions == [action]
    assert json.loads(wire)["actions"][0]["action_type"] == f"kv.{directive.verb}"


def test_the_simworker_applies_every_verb():
    # the plugin's block pool is checked alike where vLLM is (tests/fidelity/test_vllm_plugin.py)
    for verb in VERBS:
        assert callable(getattr(DirectiveSocket, verb, None)), verb
