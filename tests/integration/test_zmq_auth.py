"""CurveZMQ on every socket: a forged directive, subscription or replay request without the
key is turned away, and with the key it goes through.

Real ZMQ sockets on 127.0.0.1: the simworker's directive socket (on a real engine) and KV-event
publisher (PUB and replay ROUTER) as CURVE servers, the gateway's own sending and reading code
(its directive sink, :func:`controller.kv_wire.prepare_socket`, :func:`replay_from`) as the
client. A client turned away is seen by its handshake failing (a socket monitor event), not by
waiting a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from typer.testing import CliRunner
from zmq.utils.monitor import parse_monitor_message

from controller.directives import ZmqDirectiveSink
from controller.kv_wire import ReplayError, prepare_socket, replay_from
from controller.serve_config import parse_serve_config
from controller.zmq_keys import GatewayZmqKeys
from entry.cli import app as cli
from scheduler.actions import Release
from scheduler.config import ConfigError
from scheduler.kv_events import AllBlocksCleared
from sim.engine import Engine
from sim.step_time import DEFAULT_PRESET, preset
from simworker.config import SimWorkerConfig
from simworker.directive_socket import DirectiveSocket
from simworker.kv_publisher import KvEventPublisher
from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    InsecureBindRefused,
    ServerKeys,
    ZmqKeyError,
    load_key_pair,
    load_public_key,
    set_client_options,
    write_key_pair,
)
from tests.support.zmq_handshake import HANDSHAKE_FAILED

WAIT_S = 60.0   # generous: the machine may be loaded
HANDSHAKE_DONE = zmq.EVENT_HANDSHAKE_SUCCEEDED


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A worker's pair, the gateway's pair (accepted: its public key is in the worker's
    clients directory) and a stranger's pair (not accepted)."""
    write_key_pair(tmp_path / "worker", "worker")
    write_key_pair(tmp_path / "gateway", "gateway")
    write_key_pair(tmp_path / "stranger", "stranger")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "gateway.key").write_bytes((tmp_path / "gateway" / "gateway.key").read_bytes())
    return {"worker_secret": tmp_path / "worker" / "worker.key_secret",
            "worker_public": tmp_path / "worker" / "worker.key",
            "gateway_secret": tmp_path / "gateway" / "gateway.key_secret",
            "stranger_secret": tmp_path / "stranger" / "stranger.key_secret",
            "clients": clients}


def server_keys(keys: dict[str, Path]) -> ServerKeys:
    return ServerKeys.from_files(keys["worker_secret"], keys["clients"])


def client_keys(keys: dict[str, Path], who: str) -> ClientKeys:
    public, secret = load_key_pair(keys[f"{who}_secret"])
    return ClientKeys(public, secret, load_public_key(keys["worker_public"]))


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not met in {WAIT_S} s"
        await asyncio.sleep(0.02)


async def handshake(socket: zmq.asyncio.Socket, connect: Callable[[], None]) -> int:
    """Connect ``socket`` and return the first handshake event: succeeded or failed."""
    monitor = socket.get_monitor_socket(HANDSHAKE_FAILED | HANDSHAKE_DONE)
    try:
        connect()
        frames = await asyncio.wait_for(monitor.recv_multipart(), WAIT_S)
        return parse_monitor_message(frames)["event"]
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


# -- sluice keys ---------------------------------------------------------------------------

def test_sluice_keys_writes_a_usable_pair_with_a_private_secret(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["keys", str(tmp_path / "k"), "--name", "gw"])
    assert result.exit_code == 0, result.output
    public, secret = tmp_path / "k" / "gw.key", tmp_path / "k" / "gw.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = load_key_pair(secret)
    assert load_public_key(public) == pair[0] and len(pair[1]) == 40
    again = CliRunner().invoke(cli, ["keys", str(tmp_path / "k"), "--name", "gw"])
    assert again.exit_code != 0 and "exists already" in again.output
    assert load_key_pair(secret) == pair  # not overwritten


def test_a_secret_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    _, secret = write_key_pair(tmp_path, "w")
    os.chmod(secret, 0o644)
    with pytest.raises(ZmqKeyError, match="chmod 600"):
        load_key_pair(secret)


# -- directives ----------------------------------------------------------------------------

def test_only_the_gateways_key_gets_a_directive_applied(keys: dict[str, Path]) -> None:
    async def main() -> None:
        engine = Engine("d0", preset(DEFAULT_PRESET), num_blocks=64, block_size=4)
        receiver = DirectiveSocket("tcp://127.0.0.1:*", engine, lambda: 0.0,
                                   server_keys=server_keys(keys))
        receiver.open()
        serving = asyncio.create_task(receiver.serve())
        ctx = zmq.asyncio.Context()
        forged = (b'{"protocol_version": 1, "message_id": "f", "actions": [{"action_id": "a", '
                  b'"action_type": "kv.release", "action_version": 1, '
                  b'"payload": {"session_id": "victim"}}]}')
        try:
            for who in (None, "stranger"):  # no key at all; a key the worker does not know
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                if who is not None:
                    set_client_options(push, client_keys(keys, who))
                event = await handshake(push, lambda: push.connect(receiver.bound_endpoint))
                assert event & HANDSHAKE_FAILED, (who, event)
                with contextlib.suppress(zmq.Again):  # the refused peer may leave no pipe
                    await push.send(forged, zmq.NOBLOCK)  # queued or refused: never arrives
            # the gateway's own sender, with its keys from the serve config
            config = parse_serve_config({
                "zmq_keys": {"secret_key_file": str(keys["gateway_secret"])},
                "workers": [{"name": "d0", "url": "http://127.0.0.1:1",
                             "directives": receiver.bound_endpoint,
                             "zmq_server_key": str(keys["worker_public"])}]})
            sink = ZmqDirectiveSink(None, GatewayZmqKeys(config))
            sink.add(config.workers[0])
            sink.send(Release("s1", "d0", "final"))
            await wait_until(lambda: receiver.applied == 1, "the gateway's directive is applied")
            assert receiver.received == 1  # the forged ones never arrived
            await sink.aclose()
        finally:
            serving.cancel()
            ctx.destroy(linger=0)
            receiver.close()
    run(main)


# -- KV events and replay ------------------------------------------------------------------

def test_only_the_gateways_key_reads_kv_events_and_replays(keys: dict[str, Path]) -> None:
    async def main() -> None:
        publisher = KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                     topic="kv@w0", server_keys=server_keys(keys))
        publisher.open()
        serving = asyncio.create_task(publisher.serve_replay())
        ctx = zmq.asyncio.Context()
        try:
            strangers = []
            for who in (None, "stranger"):
                sub = ctx.socket(zmq.SUB)
                prepare_socket(sub, client_keys(keys, who) if who else None)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                event = await handshake(sub, lambda: sub.connect(publisher.bound_endpoint))
                assert event & HANDSHAKE_FAILED, (who, event)
                strangers.append(sub)
            # the gateway's reading socket, as the subscriber sets it up
            config = parse_serve_config({
                "zmq_keys": {"secret_key_file": str(keys["gateway_secret"])},
                "workers": [{"name": "w0", "url": "http://127.0.0.1:1",
                             "kv_events": publisher.bound_endpoint,
                             "replay": publisher.bound_replay_endpoint,
                             "zmq_server_key": str(keys["worker_public"])}]})
            gateway_keys = GatewayZmqKeys(config).client(config.workers[0])
            sub = ctx.socket(zmq.SUB)
            prepare_socket(sub, gateway_keys)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(publisher.bound_endpoint)
            while not await sub.poll(50):  # a SUB hears only what is sent once it has joined
                publisher.publish([AllBlocksCleared()])
            frames = await sub.recv_multipart()
            assert frames[0] == b"kv@w0"
            for stranger in strangers:
                assert not await stranger.poll(0)
                stranger.close(linger=0)
            sub.close(linger=0)

            async with replay_from(ctx, publisher.bound_replay_endpoint, 0, WAIT_S,
                                   gateway_keys) as next_batch:
                first = await next_batch()
            assert first is not None and first[0] == 0
            for who in (None, "stranger"):
                with pytest.raises(ReplayError, match="did not answer"):
                    async with replay_from(ctx, publisher.bound_replay_endpoint, 0, 1.0,
                                           client_keys(keys, who) if who else None) as next_batch:
                        await next_batch()
        finally:
            serving.cancel()
            ctx.destroy(linger=0)
            publisher.close()
    run(main)


# -- where a socket without keys may listen ------------------------------------------------

@pytest.mark.parametrize("endpoint", ["tcp://*:0", "tcp://0.0.0.0:*"])
def test_a_socket_without_keys_binds_every_interface_only_when_allowed(endpoint: str) -> None:
    engine = Engine("d0", preset(DEFAULT_PRESET), num_blocks=16, block_size=4)
    with pytest.raises(InsecureBindRefused, match="allow_insecure_bind"):
        DirectiveSocket(endpoint, engine, lambda: 0.0).open()
    with pytest.raises(InsecureBindRefused, match="allow_insecure_bind"):
        KvEventPublisher(endpoint).open()
    allowed = DirectiveSocket(endpoint, engine, lambda: 0.0, allow_insecure_bind=True)
    allowed.open()
    allowed.close()
    publisher = KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint=endpoint,
                                 allow_insecure_bind=True)
    publisher.open()
    publisher.close()


def test_a_keyed_socket_may_bind_every_interface(keys: dict[str, Path]) -> None:
    publisher = KvEventPublisher("tcp://*:0", server_keys=server_keys(keys))
    publisher.open()
    publisher.close()


def test_kv_events_bind_beyond_loopback_is_refused_unless_allowed() -> None:
    worker = {"name": "w0", "url": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError, match="kv_events_bind.*allow_insecure_bind: true"):
        parse_serve_config({"workers": [worker], "kv_events_bind": "tcp://*:5557"})
    parse_serve_config({"workers": [worker], "kv_events_bind": "tcp://*:5557",
                        "allow_insecure_bind": True})
    parse_serve_config({"workers": [worker], "kv_events_bind": "tcp://127.0.0.1:5557"})


def test_bound_ipc_files_are_private(tmp_path: Path) -> None:
    engine = Engine("d0", preset(DEFAULT_PRESET), num_blocks=16, block_size=4)
    receiver = DirectiveSocket(f"ipc://{tmp_path}/d.sock", engine, lambda: 0.0)
    publisher = KvEventPublisher(f"ipc://{tmp_path}/e.sock", replay_endpoint=f"ipc://{tmp_path}/r.sock")
    receiver.open()
    publisher.open()
    try:
        for name in ("d.sock", "e.sock", "r.sock"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    finally:
        receiver.close()
        publisher.close()


# -- configuration errors name the key -----------------------------------------------------

def test_key_settings_errors_name_the_key(keys: dict[str, Path], tmp_path: Path) -> None:
    worker = {"name": "w0", "url": "http://127.0.0.1:1", "zmq_server_key": str(keys["worker_public"])}
    with pytest.raises(ConfigError, match=r"workers\.0\.zmq_server_key: needs the gateway"):
        parse_serve_config({"workers": [worker]})
    with pytest.raises(ConfigError, match=r"zmq_keys\.secret_key_file"):
        parse_serve_config({"workers": [worker],
                            "zmq_keys": {"secret_key_file": str(keys["worker_public"])}})
    with pytest.raises(ConfigError, match=r"workers\.0\.zmq_server_key"):
        parse_serve_config({"workers": [{**worker, "zmq_server_key": str(tmp_path / "none.key")}],
                            "zmq_keys": {"secret_key_file": str(keys["gateway_secret"])}})
    with pytest.raises(ValueError, match="go together"):
        SimWorkerConfig(zmq_secret_key_file=str(keys["worker_secret"]))
    with pytest.raises(ValueError, match="zmq_secret_key_file"):
        SimWorkerConfig(zmq_secret_key_file=str(keys["worker_public"]),
                        zmq_client_keys_dir=str(keys["clients"]))
    config = SimWorkerConfig(zmq_secret_key_file=str(keys["worker_secret"]),
                             zmq_client_keys_dir=str(keys["clients"]))
    assert config.zmq_server_keys is not None
