"""CurveZMQ on the gateway's ``kv_events_bind`` socket (the llm-d layout: the gateway binds one
SUB, the engines' publishers connect to it): with ``zmq_keys.publisher_keys_dir`` only a
publisher whose public key is there is heard; one without CURVE, or with a key the gateway
does not hold, is turned away at the handshake and its batches never reach the index.

Real ZMQ sockets on 127.0.0.1 and the real gateway (its subscriber binds the socket). A
publisher turned away is seen by its handshake failing (a socket monitor event), never by
waiting a while.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from entry.ports import free_port
from scheduler.config import ConfigError
from scheduler.kv_events import EventBatch, EventBatchEncoder
from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    load_key_pair,
    load_public_key,
    set_client_options,
    write_key_pair,
)
from controller.serve_config import parse_serve_config
from controller.zmq_keys import GatewayZmqKeys
from tests.support.gateway_harness import gateway, serve_config, wait_for
from tests.support.zmq_handshake import HANDSHAKE_FAILED

WAIT_S = 60.0  # generous: the machine may be loaded
DEAD_URL = f"http://127.0.0.1:{free_port()}"  # nothing listens: workers fed only by events


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """The gateway's pair, an engine's pair (accepted: its public key is in the gateway's
    publisher keys directory) and a stranger's pair (not accepted)."""
    for name in ("gateway", "engine", "stranger"):
        write_key_pair(tmp_path, name)
    publishers = tmp_path / "publishers"
    publishers.mkdir()
    (publishers / "engine.key").write_bytes((tmp_path / "engine.key").read_bytes())
    return {"gateway_secret": tmp_path / "gateway.key_secret",
            "gateway_public": tmp_path / "gateway.key",
            "engine_secret": tmp_path / "engine.key_secret",
            "stranger_secret": tmp_path / "stranger.key_secret",
            "publishers": publishers}


def worker(name: str) -> dict[str, Any]:
    return {"name": name, "url": DEAD_URL, "capacity_tokens": 100_000}


class Publisher:
    """A PUB that connects to the gateway's bound socket and sends vLLM's frames
    ``[topic, seq, msgpack batch]``, as a CURVE client with ``who``'s key (or none)."""

    def __init__(self, ctx: zmq.Context, topic: str, keys: dict[str, Path], who: str | None):
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        if who is not None:
            public, secret = load_key_pair(keys[f"{who}_secret"])
            set_client_options(self.socket,
                               ClientKeys(public, secret, load_public_key(keys["gateway_public"])))
        self.topic = topic.encode()
        self.next_seq = 0
        self._encoder = EventBatchEncoder()

    def connect(self, endpoint: str) -> int:
        """Connect; the first handshake event (succeeded or one of the failures)."""
        monitor = self.socket.get_monitor_socket(HANDSHAKE_FAILED
                                                 | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self.socket.connect(endpoint)
            assert monitor.poll(int(WAIT_S * 1000)), "no handshake event"
            return recv_monitor_message(monitor)["event"]
        finally:
            self.socket.disable_monitor()
            monitor.close(linger=0)

    def publish(self) -> None:
        payload = self._encoder.encode(EventBatch(ts=time.time(), events=[]))
        self.socket.send_multipart((self.topic, self.next_seq.to_bytes(8, "big"), payload))
        self.next_seq += 1


def test_only_an_accepted_publisher_is_heard_on_the_bound_socket(keys: dict[str, Path]) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = serve_config([worker("engine"), worker("nokey"), worker("stranger")],
                          kv_events_bind=bind,
                          zmq_keys={"secret_key_file": str(keys["gateway_secret"]),
                                    "publisher_keys_dir": str(keys["publishers"])})
    ctx = zmq.Context()
    try:
        with gateway(config) as gw:
            kv_events = gw.parts.kv_events
            endpoint = wait_for(lambda: kv_events.bound_endpoint, timeout=WAIT_S,
                                what="the bound socket")
            turned_away = []
            for who in ("nokey", "stranger"):
                publisher = Publisher(ctx, f"kv@{who}@m", keys, None if who == "nokey" else who)
                event = publisher.connect(endpoint)
                assert event & HANDSHAKE_FAILED, (who, event)
                for _ in range(5):
                    publisher.publish()  # no connection to send on: dropped by the PUB
                turned_away.append(publisher)
            accepted = Publisher(ctx, "kv@engine@m", keys, "engine")
            assert accepted.connect(endpoint) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            deadline = time.monotonic() + WAIT_S
            while not kv_events.stats["engine"].received:  # a SUB hears only once joined
                assert time.monotonic() < deadline, "the accepted publisher was not heard"
                accepted.publish()
                time.sleep(0.02)
            # sent before the accepted publisher's batches, and never heard
            assert kv_events.stats["nokey"].received == 0
            assert kv_events.stats["stranger"].received == 0
            assert kv_events.ignored["unknown_topic"] == 0
            for publisher in (*turned_away, accepted):
                publisher.socket.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_keyed_bound_socket_may_listen_on_every_interface(keys: dict[str, Path]) -> None:
    workers = [worker("engine")]
    with pytest.raises(ConfigError, match="kv_events_bind.*zmq_keys.publisher_keys_dir"):
        parse_serve_config({"workers": workers, "kv_events_bind": "tcp://*:5557",
                            "zmq_keys": {"secret_key_file": str(keys["gateway_secret"])}})
    config = parse_serve_config({"workers": workers, "kv_events_bind": "tcp://*:5557",
                                 "zmq_keys": {"secret_key_file": str(keys["gateway_secret"]),
                                              "publisher_keys_dir": str(keys["publishers"])}})
    served = GatewayZmqKeys(config).publishers()
    assert served is not None and served.clients_dir == keys["publishers"]
    assert served.public == load_public_key(keys["gateway_public"])


def test_a_publisher_keys_dir_without_keys_is_refused_naming_the_key(
        keys: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for directory in (empty, tmp_path / "missing"):
        with pytest.raises(ConfigError, match="zmq_keys.publisher_keys_dir.*not a directory "
                                              "holding publisher public keys"):
            parse_serve_config({"workers": [worker("engine")],
                                "kv_events_bind": "tcp://127.0.0.1:5557",
                                "zmq_keys": {"secret_key_file": str(keys["gateway_secret"]),
                                             "publisher_keys_dir": str(directory)}})
