"""A worker's ZMQ endpoints, end to end: real gateways and real ZMQ sockets on 127.0.0.1.

- The ``ipc://`` file of a socket the gateway binds (``kv_events_bind``, a worker's
  ``kv_events`` holding ``*``) is made 0600.
- A worker whose ``kv_events``, ``replay`` or ``directives`` reaches a host outside
  ``worker_urls``, or whose ``kv_events`` the gateway would bind beyond loopback without keys,
  is refused by the admin API (400 naming the key), at start and on a reload, before any
  socket is opened to it.
- A ``kv_events`` bound with the worker's ``zmq_server_key`` hears that worker alone: the
  bound SUB is a CURVE client, and only a publisher holding the worker's secret key answers
  its handshake.

Nothing here binds beyond loopback, nor connects off it (refused addresses are refused from
their form or from numeric names the resolver reads without DNS; 192.0.2.1 is TEST-NET-1).
"""

from __future__ import annotations

import asyncio
import stat
import time
from pathlib import Path

import pytest
import yaml
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from controller.kv_wire import attach, prepare_socket
from controller.serve_config import ConfigError, load_serve_config, parse_serve_config
from controller.zmq_keys import GatewayZmqKeys
from scheduler.kv_events import AllBlocksCleared
from simworker.kv_publisher import KvEventPublisher
from sluice_vllm_plugin.zmq_auth import ServerKeys, set_server_options, write_key_pair
from tests.support.gateway_harness import (ADMIN, ADMIN_TOKEN, fakes, gateway, serve_config,
                                           startup_error, wait_for)
from tests.support.zmq_handshake import HANDSHAKE_FAILED

WAIT_S = 30.0  # generous: the machine may be loaded


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None


# -- bound ipc:// files --------------------------------------------------------------------


def test_the_kv_events_bind_ipc_file_is_private(tmp_path: Path):
    path = tmp_path / "kv.sock"
    with fakes("w0") as [(_, server)]:
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1000}],
                              kv_events_bind=f"ipc://{path}")
        with gateway(config) as gw:
            wait_for(lambda: gw.parts.kv_events.bound_endpoint is not None, WAIT_S,
                     "the bound socket")
            wait_for(lambda: _mode(path) == 0o600, WAIT_S, f"{path} made 0600")


def test_a_kv_events_the_gateway_binds_has_a_private_ipc_file():
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        bound = attach(socket, "ipc://*")  # libzmq picks the file
        assert bound.startswith("ipc://") and "*" not in bound
        assert _mode(Path(bound.removeprefix("ipc://"))) == 0o600
    finally:
        socket.close(linger=0)
        context.term()


# -- refused when a worker joins -----------------------------------------------------------


@pytest.mark.parametrize("key,endpoint,why", [
    ("replay", "tcp://169.254.169.254:5558", "169.254.169.254, which is in none of worker_urls"),
    ("directives", "tcp://0xa9fea9fe:5559", "'0xa9fea9fe' resolves to 169.254.169.254"),
    ("kv_events", "tcp://[::ffff:169.254.169.254]:5557", "169.254.169.254, which is in none"),
    ("replay", "tcp://*:5558", "must name the worker's host"),
    ("kv_events", "tcp://192.0.2.1:*", "would listen beyond loopback without CURVE keys"),
])
def test_admin_api_refuses_a_zmq_endpoint_naming_its_key(key, endpoint, why):
    with fakes("w0", "late") as [(_, server), (_, late)]:
        with gateway(serve_config([{"name": "w0", "url": server.url,
                                    "capacity_tokens": 1000}])) as gw:
            r = gw.client.post("/sluice/workers", headers=ADMIN,
                               json={"name": "late", "url": late.url, "capacity_tokens": 1000,
                                     key: endpoint})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert message.startswith(f"worker.{key}: ") and why in message, message
            assert "late" not in gw.workers()
            # a local endpoint (a name resolved to loopback, an ipc file) is let in
            r = gw.client.post("/sluice/workers", headers=ADMIN,
                               json={"name": "late", "url": late.url, "capacity_tokens": 1000,
                                     "replay": "tcp://localhost:5558",
                                     "directives": "ipc:///tmp/sluice-test-none.sock"})
            assert r.status_code == 201, r.text


def test_gateway_does_not_start_with_an_endpoint_whose_name_resolves_outside():
    config = serve_config(
        [{"name": "w0", "url": "http://10.0.0.1:9", "capacity_tokens": 1000,
          "kv_events": "tcp://localhost:5557", "replay": "tcp://10.0.0.1:5558"}],
        worker_urls={"networks": ["10.0.0.0/8"]})
    message = startup_error(config)
    assert "workers.0.kv_events: 'tcp://localhost:5557': 'localhost' resolves to 127.0.0.1" \
        in message, message


def test_a_reload_naming_a_refused_endpoint_is_rejected(tmp_path: Path):
    path = tmp_path / "sluice.yaml"
    document = {"admin_token": ADMIN_TOKEN, "admin_token_env": None, "reload_poll_s": 0,
                "health_interval_s": 30,
                "workers": [{"name": "w0", "url": "http://127.0.0.1:9", "capacity_tokens": 1000}]}
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with gateway(load_serve_config(path)) as gw:
        for key, endpoint in (("replay", "tcp://169.254.169.254:5558"),
                              ("kv_events", "tcp://*:5557")):
            document["workers"][0][key] = endpoint
            path.write_text(yaml.safe_dump(document), encoding="utf-8")
            r = gw.client.post("/sluice/reload", headers=ADMIN)
            assert r.status_code == 422, r.text
            assert f"workers.0.{key}: " in r.json()["error"], r.text
            del document["workers"][0][key]


# -- a bound kv_events with the worker's key -----------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    gateway_public, gateway_secret = write_key_pair(tmp_path / "gateway", "gateway")
    worker_public, worker_secret = write_key_pair(tmp_path / "worker", "worker")
    _, stranger_secret = write_key_pair(tmp_path / "stranger", "stranger")
    clients = tmp_path / "clients"  # the worker accepts the gateway's key
    clients.mkdir()
    (clients / "gateway.key").write_bytes(gateway_public.read_bytes())
    return {"gateway_secret": gateway_secret, "worker_public": worker_public,
            "worker_secret": worker_secret, "stranger_secret": stranger_secret,
            "clients": clients}


async def _handshake_failed(socket: zmq.asyncio.Socket, endpoint: str) -> bool:
    monitor = socket.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        socket.connect(endpoint)
        frames = await asyncio.wait_for(monitor.recv_multipart(), WAIT_S)
        return bool(parse_monitor_message(frames)["event"] & HANDSHAKE_FAILED)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def test_a_kv_events_bound_with_the_workers_key_hears_that_worker_alone(keys):
    worker = {"name": "w0", "url": "http://127.0.0.1:1", "kv_events": "tcp://*:5557"}
    with pytest.raises(ConfigError, match=r"workers\.0\.kv_events: .*allow_insecure_bind"):
        parse_serve_config({"workers": [worker]})  # no keys: refused
    config = parse_serve_config({"zmq_keys": {"secret_key_file": str(keys["gateway_secret"])},
                                 "workers": [{**worker,
                                              "zmq_server_key": str(keys["worker_public"])}]})

    async def main() -> None:
        context = zmq.asyncio.Context()
        publisher = None
        try:
            # the subscriber's socket as it sets it up, bound on loopback for the test
            sub = context.socket(zmq.SUB)
            prepare_socket(sub, GatewayZmqKeys(config).client(config.workers[0]))
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            bound = attach(sub, "tcp://127.0.0.1:*")
            # strangers connecting: without CURVE, and as a CURVE server with another key
            plain = context.socket(zmq.PUB)
            impostor = context.socket(zmq.PUB)
            set_server_options(impostor, ServerKeys.from_files(keys["stranger_secret"],
                                                               keys["clients"]))
            for stranger in (plain, impostor):
                stranger.setsockopt(zmq.LINGER, 0)
                assert await _handshake_failed(stranger, bound)
            # the worker's publisher connects as the CURVE server it is with its keys
            publisher = KvEventPublisher(bound, topic="kv@w0",
                                         server_keys=ServerKeys.from_files(keys["worker_secret"],
                                                                           keys["clients"]))
            publisher.open()
            deadline = time.monotonic() + WAIT_S
            while not await sub.poll(50):
                assert time.monotonic() < deadline, "the worker's batch never arrived"
                for stranger in (plain, impostor):
                    stranger.send_multipart((b"kv@w0", bytes(8), b"forged"))
                publisher.publish([AllBlocksCleared()])
            while await sub.poll(200):
                frames = await sub.recv_multipart()
                assert frames[0] == b"kv@w0" and frames[2] != b"forged", frames
            for socket in (plain, impostor, sub):
                socket.close(linger=0)
        finally:
            if publisher is not None:
                publisher.close()
            context.destroy(linger=0)

    asyncio.run(main())
