"""The plugin's ``kv.offload`` / ``kv.prefetch`` on vLLM's own host-tier manager
(``CPUOffloadingManager``) next to its ``BlockPool``, driven by ``host_tier_driver.py`` in vLLM's
venv (the GPU→CPU copy needs CUDA/XPU, so stores are the connector scheduler's
``prepare_store`` + ``complete_store``); and the envelope's two new actions."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sluice_vllm_plugin.directive_envelope import (Envelope, KvOffload, KvPrefetch,
                                                   OffloadPayload, PrefetchPayload, decode,
                                                   encode_json)
from tests.support.vllm_venv import ROOT, vllm_env, vllm_python

DRIVER = Path(__file__).resolve().parent / "host_tier_driver.py"


@pytest.fixture(scope="module")
def out() -> dict:
    proc = subprocess.run([str(vllm_python()), str(DRIVER)], cwd=ROOT, env=vllm_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _owners(result: dict, hexes: list[str]) -> list[str]:
    owner = {h: s for s, keys in result["keys"].items() for h in keys}
    return [owner.get(h, "new") for h in hexes]


def test_without_directives_the_manager_evicts_as_vllm(out):
    plain, patched = out["plain_equal"]["plain"], out["plain_equal"]["patched"]
    assert patched["installed"]
    assert sum(len(e) for e in plain["evicted"]) > 50      # the sequence does evict
    assert patched["evicted"] == plain["evicted"]
    assert patched["contents"] == plain["contents"]


def test_offload_parks_in_the_tier_and_demotes_on_the_gpu(out):
    r = out["offload"]
    # the manager holds every one of A's blocks (parked in the order A freed them: reversed)
    assert r["parked"] == r["keys"]["A"][::-1]
    assert r["not_held"] == 0
    assert r["a_class"] == 0
    hashed = r["free_order"][-9:]               # after the never-hashed free blocks
    assert hashed[:3] == r["a_blocks"]          # A's GPU blocks are evicted first
    # A was the tier's least recent; parking touched it, so B (now the least recent) goes
    assert _owners(r, r["evicted"]) == ["B"] * 3
    assert _owners(r, r["contents"]).count("A") == 3


def test_prefetch_protects_ahead_of_others_but_does_not_pin(out):
    r = out["prefetch"]
    assert _owners(r, r["first"]) == ["C"] * 3  # A is the least recent, yet C goes
    # seven to evict and six unfavoured: all six first, then one of A's
    assert _owners(r, r["second"]) == ["B"] * 3 + ["new"] * 3 + ["A"]
    assert r["a_class"] == 50                   # the offload's GPU demotion is undone


def test_prefetch_ends_at_its_deadline_and_when_loaded(out):
    r = out["prefetch_expiry_and_load"]
    assert r["favoured"] == ["A"]
    assert _owners(r, r["expired_evicts"]) == ["B"] * 3
    assert r["favoured_before_load"] == ["C"]
    assert r["favoured_after_load"] == []


def test_offload_without_a_host_tier_is_a_demote(out):
    r = out["offload_without_tier"]
    assert (r["after_offload"], r["after_prefetch"], r["dropped"]) == (0, 50, 0)


# -- envelope -------------------------------------------------------------------------------------


def test_envelope_offload_and_prefetch_round_trip():
    env = Envelope(1, "m1", [KvOffload(OffloadPayload("s1", "c1"), "a1"),
                             KvPrefetch(PrefetchPayload("s1", priority=70, deadline_s=2.5), "a2"),
                             KvPrefetch(PrefetchPayload("s2"))])
    wire = json.loads(encode_json(env))
    assert [a["action_type"] for a in wire["actions"]] == ["kv.offload", "kv.prefetch",
                                                           "kv.prefetch"]
    assert wire["actions"][2]["payload"] == {"session_id": "s2"}
    back = decode(encode_json(env))
    assert back == env
    assert back.actions[2].payload.priority == 50 and back.actions[2].payload.deadline_s is None


@pytest.mark.parametrize("payload", [
    {"action_type": "kv.offload", "payload": {"session_id": ""}},
    {"action_type": "kv.prefetch", "payload": {"session_id": "s", "priority": 101}},
    {"action_type": "kv.prefetch", "payload": {"session_id": "s", "deadline_s": -1}},
    {"action_type": "kv.prefetch", "payload": {"session_id": "s", "deadline_s": "soon"}},
    {"action_type": "kv.offload", "payload": {}},
])
def test_envelope_rejects_malformed_offload_and_prefetch(payload):
    with pytest.raises(ValueError):
        decode(json.dumps({"protocol_version": 1, "message_id": "m",
                           "actions": [payload]}).encode())


def test_directive_server_posts_offload_and_prefetch():
    from sluice_vllm_plugin.directives import DirectiveServer
    posted = []
    server = DirectiveServer.__new__(DirectiveServer)    # handle() only: no socket
    server._post, server.received, server.applied, server.dropped = posted.append, 0, 0, 0
    actions = [KvOffload(OffloadPayload("s1")),
               KvPrefetch(PrefetchPayload("s1", priority=70, deadline_s=3.0)),
               KvPrefetch(PrefetchPayload("s2"))]
    server.handle(encode_json(Envelope(1, "m", actions)))
    assert posted == actions and server.applied == 3
