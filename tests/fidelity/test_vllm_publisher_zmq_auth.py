"""CurveZMQ on vLLM 0.32's own ``ZmqEventPublisher`` with the plugin's patch applied
(:mod:`sluice_vllm_plugin.publisher_auth`).

The publisher runs in vLLM's virtualenv (:data:`DRIVER`, built as vLLM builds it, with the
keys in its environment); the gateway's side runs here, with the gateway's own reading code
(:func:`controller.kv_wire.prepare_socket`, :func:`replay_from`, :func:`prepare_bound_socket`)
on real sockets at 127.0.0.1. A client turned away is seen by its handshake failing (a socket
monitor event), never by waiting a while.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from controller.kv_wire import prepare_bound_socket, prepare_socket, replay_from
from controller.serve_config import parse_serve_config
from controller.zmq_keys import GatewayZmqKeys
from entry.ports import free_port
from scheduler.kv_events import EventBatchDecoder
from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    ServerKeys,
    load_key_pair,
    load_public_key,
    write_key_pair,
)
from tests.support.vllm_venv import ROOT, run_check, vllm_env, vllm_python
from tests.support.zmq_handshake import HANDSHAKE_FAILED

WAIT_S = 60.0  # generous: the machine may be loaded

# Builds vLLM's publisher with the plugin's patch, prints its endpoints, then publishes one
# batch per "publish" line on stdin until "quit" (or end of input), and shuts it down.
DRIVER = """
import json, sys, time
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher
from sluice_vllm_plugin import publisher_auth
publisher_auth.apply()
endpoint, replay = sys.argv[1], (sys.argv[2] if sys.argv[2] != "-" else None)
publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay,
                              topic="kv@w0")
print("READY", flush=True)
try:
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
finally:
    publisher.shutdown()
print("DONE", flush=True)
"""

# Builds the publisher under each environment in argv[1] (a JSON list of
# [endpoint, {variable: value}]) and reports what happened: built, or the error.
CHECKS = """
import json, os, stat, sys
from vllm.distributed.kv_events import ZmqEventPublisher
from sluice_vllm_plugin import publisher_auth
publisher_auth.apply()
NAMES = ("SLUICE_ZMQ_SECRET_KEY_FILE", "SLUICE_ZMQ_CLIENT_KEYS_DIR",
         "SLUICE_ZMQ_ALLOW_INSECURE_BIND", "SLUICE_ZMQ_GATEWAY_KEY_FILE")
out = []
for endpoint, environment in json.loads(sys.argv[1]):
    for name in NAMES:
        os.environ.pop(name, None)
    os.environ.update(environment)
    try:
        publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv@w0")
    except Exception as err:
        out.append({"error": type(err).__name__, "message": str(err)})
        continue
    mode = None
    if endpoint.startswith("ipc://"):
        mode = stat.S_IMODE(os.stat(endpoint[len("ipc://"):]).st_mode)
    publisher.shutdown()
    out.append({"built": True, "ipc_mode": mode})
print("RESULT" + json.dumps(out))
"""


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """The engine's pair, the gateway's pair (accepted: its public key is in the engine's
    client keys directory, and the engine's in the gateway's publisher keys directory) and
    a stranger's pair (accepted nowhere)."""
    for name in ("engine", "gateway", "stranger"):
        write_key_pair(tmp_path, name)
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "gateway.key").write_bytes((tmp_path / "gateway.key").read_bytes())
    publishers = tmp_path / "publishers"
    publishers.mkdir()
    (publishers / "engine.key").write_bytes((tmp_path / "engine.key").read_bytes())
    return {"engine_secret": tmp_path / "engine.key_secret",
            "engine_public": tmp_path / "engine.key",
            "gateway_secret": tmp_path / "gateway.key_secret",
            "gateway_public": tmp_path / "gateway.key",
            "stranger_secret": tmp_path / "stranger.key_secret",
            "clients": clients, "publishers": publishers}


def engine_environment(keys: dict[str, Path]) -> dict[str, str]:
    return {"SLUICE_ZMQ_SECRET_KEY_FILE": str(keys["engine_secret"]),
            "SLUICE_ZMQ_CLIENT_KEYS_DIR": str(keys["clients"])}


@contextmanager
def vllm_publisher(endpoint: str, replay: str | None,
                   environment: dict[str, str]) -> Iterator[Callable[[], None]]:
    """vLLM's publisher in its own virtualenv; yields a function that has it publish a batch."""
    proc = subprocess.Popen([str(vllm_python()), "-c", DRIVER, endpoint, replay or "-"],
                            cwd=ROOT, env=vllm_env(**environment), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        if ready.strip() != "READY":
            proc.kill()
            pytest.fail(f"vLLM's publisher did not start: {proc.stderr.read()[-4000:]}")

        def publish() -> None:
            proc.stdin.write("publish\n")
            proc.stdin.flush()

        yield publish
        proc.stdin.write("quit\n")
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "DONE", proc.stderr.read()[-4000:]
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)


async def handshake(socket: zmq.asyncio.Socket, endpoint: str) -> int:
    """Connect ``socket`` to ``endpoint``; the first handshake event (succeeded or failed)."""
    monitor = socket.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        socket.connect(endpoint)
        frames = await asyncio.wait_for(monitor.recv_multipart(), WAIT_S)
        return parse_monitor_message(frames)["event"]
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def stranger_keys(keys: dict[str, Path]) -> ClientKeys:
    public, secret = load_key_pair(keys["stranger_secret"])
    return ClientKeys(public, secret, load_public_key(keys["engine_public"]))


async def receive_while_publishing(socket: zmq.asyncio.Socket,
                                   publish: Callable[[], None]) -> list[bytes]:
    """Have the publisher publish until ``socket`` hears a batch (a SUB hears only what is
    sent once it has joined), and return it."""
    for _ in range(int(WAIT_S / 0.05)):
        publish()
        if await socket.poll(50):
            return await socket.recv_multipart()
    pytest.fail(f"nothing arrived in {WAIT_S} s")


def test_only_the_gateways_key_reads_vllms_kv_events_and_replays(keys: dict[str, Path]) -> None:
    port, replay_port = free_port(), free_port()
    # vLLM binds a tcp endpoint only when it holds "*"; the gateway reaches it on loopback
    with vllm_publisher(f"tcp://*:{port}", f"tcp://*:{replay_port}",
                        engine_environment(keys)) as publish:
        endpoint = f"tcp://127.0.0.1:{port}"
        replay = f"tcp://127.0.0.1:{replay_port}"

        async def main() -> None:
            ctx = zmq.asyncio.Context()
            try:
                turned_away = []
                for client in (None, stranger_keys(keys)):
                    sub = ctx.socket(zmq.SUB)
                    prepare_socket(sub, client)
                    sub.setsockopt(zmq.SUBSCRIBE, b"")
                    assert await handshake(sub, endpoint) & HANDSHAKE_FAILED, client
                    dealer = ctx.socket(zmq.DEALER)
                    prepare_socket(dealer, client)
                    assert await handshake(dealer, replay) & HANDSHAKE_FAILED, client
                    turned_away += [sub, dealer]
                # the gateway's reading socket, as its subscriber sets it up
                config = parse_serve_config({
                    "zmq_keys": {"secret_key_file": str(keys["gateway_secret"])},
                    "workers": [{"name": "w0", "url": "http://127.0.0.1:1", "kv_events": endpoint,
                                 "replay": replay,
                                 "zmq_server_key": str(keys["engine_public"])}]})
                gateway_keys = GatewayZmqKeys(config).client(config.workers[0])
                sub = ctx.socket(zmq.SUB)
                prepare_socket(sub, gateway_keys)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                frames = await receive_while_publishing(sub, publish)
                assert frames[0] == b"kv@w0"
                EventBatchDecoder().decode(frames[2])  # vLLM's batch, as Sluice reads it
                for socket in turned_away:
                    assert not await socket.poll(0)
                    socket.close(linger=0)
                sub.close(linger=0)
                async with replay_from(ctx, replay, 0, WAIT_S, gateway_keys) as next_batch:
                    first = await next_batch()
                assert first is not None and first[0] == 0
            finally:
                ctx.destroy(linger=0)
        asyncio.run(main())


def test_a_connecting_publisher_is_heard_by_the_gateways_keyed_bound_socket(
        keys: dict[str, Path]) -> None:
    """The llm-d layout: the gateway binds, vLLM's PUB connects as a CURVE client of it."""
    gateway_public, gateway_secret = load_key_pair(keys["gateway_secret"])

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        auth = prepare_bound_socket(sub, ServerKeys(gateway_public, gateway_secret,
                                                    keys["publishers"]))
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind("tcp://127.0.0.1:*")
            bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            environment = {**engine_environment(keys),
                           "SLUICE_ZMQ_GATEWAY_KEY_FILE": str(keys["gateway_public"])}
            with vllm_publisher(bound, None, environment) as publish:
                frames = await receive_while_publishing(sub, publish)
            assert frames[0] == b"kv@w0"
        finally:
            sub.close(linger=0)
            assert auth is not None
            auth.stop()
            ctx.destroy(linger=0)
    asyncio.run(main())


def test_keyless_binds_beyond_loopback_and_broken_keys_stop_the_publisher(
        keys: dict[str, Path], tmp_path: Path) -> None:
    open_tcp = f"tcp://*:{free_port()}"
    empty = tmp_path / "empty"
    empty.mkdir()
    scenarios = [
        (open_tcp, {}),                                               # refused
        (open_tcp, {"SLUICE_ZMQ_ALLOW_INSECURE_BIND": "1"}),          # allowed
        (f"ipc://{tmp_path / 'kv.ipc'}", {}),                          # loopback-only: fine
        (open_tcp, {"SLUICE_ZMQ_SECRET_KEY_FILE": str(keys["engine_secret"])}),  # half given
        (open_tcp, {**engine_environment(keys), "SLUICE_ZMQ_CLIENT_KEYS_DIR": str(empty)}),
        (open_tcp, {"SLUICE_ZMQ_GATEWAY_KEY_FILE": str(keys["gateway_public"]),
                    "SLUICE_ZMQ_ALLOW_INSECURE_BIND": "1"}),          # client keys, no pair
    ]
    refused, allowed, ipc, half, empty_dir, gateway_only = run_check(CHECKS, json.dumps(scenarios))
    assert refused["error"] == "InsecureBindRefused"
    assert "SLUICE_ZMQ_ALLOW_INSECURE_BIND=1" in refused["message"]
    assert "SLUICE_ZMQ_SECRET_KEY_FILE" in refused["message"]
    assert allowed == {"built": True, "ipc_mode": None}
    assert ipc == {"built": True, "ipc_mode": 0o600}
    assert half["error"] == "ZmqKeyError" and "go together" in half["message"]
    assert empty_dir["error"] == "ZmqKeyError" and "no client public key" in empty_dir["message"]
    assert gateway_only["error"] == "ZmqKeyError"
    assert "SLUICE_ZMQ_GATEWAY_KEY_FILE" in gateway_only["message"]
