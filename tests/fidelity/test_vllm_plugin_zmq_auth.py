"""The engine plugin's directive socket with CurveZMQ keys from its environment: a PUSH
without the key, or with a key the engine does not accept, never gets a directive posted;
the gateway's key does. Half-given keys open no socket rather than an open one.

The directive server imports vLLM only to post to the block pools: given ``post`` it runs in
the project's own environment, on real ZMQ sockets at 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from sluice_vllm_plugin import directives
from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    InsecureBindRefused,
    ZmqKeyError,
    load_key_pair,
    load_public_key,
    set_client_options,
    write_key_pair,
)

WAIT_S = 60.0
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
RELEASE = (b'{"protocol_version": 1, "message_id": "m", "actions": [{"action_id": "a", '
           b'"action_type": "kv.release", "action_version": 1, "payload": {"session_id": "s"}}]}')


def keys_environment(tmp_path: Path) -> dict[str, str]:
    write_key_pair(tmp_path, "engine")
    write_key_pair(tmp_path, "gateway")
    write_key_pair(tmp_path, "stranger")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "gateway.key").write_bytes((tmp_path / "gateway.key").read_bytes())
    return {"SLUICE_ZMQ_SECRET_KEY_FILE": str(tmp_path / "engine.key_secret"),
            "SLUICE_ZMQ_CLIENT_KEYS_DIR": str(clients)}


def client(tmp_path: Path, who: str) -> ClientKeys:
    public, secret = load_key_pair(tmp_path / f"{who}.key_secret")
    return ClientKeys(public, secret, load_public_key(tmp_path / "engine.key"))


def test_only_the_gateways_key_gets_a_directive_posted(tmp_path: Path, monkeypatch) -> None:
    for name, value in keys_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    posted = []
    server = directives.DirectiveServer("tcp://127.0.0.1:*", post=posted.append)
    endpoint = server._sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context()
    try:
        for who in (None, "stranger"):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            if who is not None:
                set_client_options(push, client(tmp_path, who))
            monitor = push.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            push.connect(endpoint)
            assert monitor.poll(int(WAIT_S * 1000)), who
            assert recv_monitor_message(monitor)["event"] & HANDSHAKE_FAILED, who
            with contextlib.suppress(zmq.Again):  # the refused peer may leave no pipe to queue on
                push.send(RELEASE, zmq.NOBLOCK)  # queued or refused: it never arrives
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        set_client_options(push, client(tmp_path, "gateway"))
        push.connect(endpoint)
        push.send(RELEASE)
        deadline = time.monotonic() + WAIT_S
        while not posted:
            assert time.monotonic() < deadline, "the gateway's directive was not posted"
            time.sleep(0.02)
        assert server.received == 1 and len(posted) == 1
    finally:
        ctx.destroy(linger=0)
        server.close()


def test_half_given_keys_or_an_open_bind_open_no_socket(tmp_path: Path, monkeypatch) -> None:
    environment = keys_environment(tmp_path)
    monkeypatch.setenv("SLUICE_ZMQ_SECRET_KEY_FILE", environment["SLUICE_ZMQ_SECRET_KEY_FILE"])
    with pytest.raises(ZmqKeyError, match="go together"):
        directives.DirectiveServer("tcp://127.0.0.1:*", post=lambda action: None)
    monkeypatch.delenv("SLUICE_ZMQ_SECRET_KEY_FILE")
    with pytest.raises(InsecureBindRefused, match="SLUICE_ZMQ_ALLOW_INSECURE_BIND"):
        directives.DirectiveServer("tcp://*:0", post=lambda action: None)
    monkeypatch.setenv("SLUICE_ZMQ_ALLOW_INSECURE_BIND", "1")
    directives.DirectiveServer("tcp://*:0", post=lambda action: None).close()
