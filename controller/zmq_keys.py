"""The gateway's CurveZMQ keys: with ``zmq_keys`` (its own key pair) and a worker's
``zmq_server_key`` (that worker's public key), every socket the gateway opens to the worker
(the directive PUSH, the KV-event SUB, the replay DEALER) is a CURVE client that the worker
(a CURVE server with a ZAP handler, sluice_vllm_plugin/zmq_auth.py) accepts only if the
gateway's public key is in its client keys directory, and that accepts only that worker:
events from an impostor bound at the worker's endpoint never arrive. A worker without
``zmq_server_key`` is reached without CURVE.

With ``zmq_keys.publisher_keys_dir`` too, the gateway is the CURVE *server* of the one
socket it binds for KV events (``kv_events_bind``, the llm-d layout): the engines' publishers
connect to it as clients, and one whose public key is not in that directory is not heard.
"""

from __future__ import annotations

from pathlib import Path

from scheduler.config import ConfigError

from controller.serve_config import ServeConfig, WorkerConfig
# write_key_pair is here for `sluice keys` too: entry reaches the plugin's code through us.
from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    ServerKeys,
    ZmqKeyError,
    load_key_pair,
    load_public_key,
    write_key_pair,
)

__all__ = ["GatewayZmqKeys", "ZmqKeyError", "write_key_pair"]


class GatewayZmqKeys:
    """The client keys for each worker's sockets, its key files read once."""

    def __init__(self, config: ServeConfig) -> None:
        self._pair: tuple[bytes, bytes] | None = None
        if config.zmq_keys is not None:
            try:
                self._pair = load_key_pair(config.zmq_keys.secret_key_file)
            except ZmqKeyError as err:
                raise ConfigError(f"zmq_keys.secret_key_file: {err}") from None
        self._server_keys: dict[Path, bytes] = {}
        self._publishers: ServerKeys | None = None
        if config.zmq_keys is not None and config.zmq_keys.publisher_keys_dir is not None:
            try:
                self._publishers = ServerKeys.from_files(config.zmq_keys.secret_key_file,
                                                         config.zmq_keys.publisher_keys_dir)
            except ZmqKeyError as err:
                raise ConfigError(f"zmq_keys.publisher_keys_dir: {err}") from None

    def publishers(self) -> ServerKeys | None:
        """The CURVE server keys of the ``kv_events_bind`` socket (the gateway's pair and the
        publishers it hears); None without ``zmq_keys.publisher_keys_dir``."""
        return self._publishers

    def client(self, worker: WorkerConfig | None) -> ClientKeys | None:
        """The CURVE client keys to reach ``worker``; None when it has no ``zmq_server_key``.
        A ConfigError naming the key when the gateway has no key pair or the file is bad."""
        if worker is None or worker.zmq_server_key is None:
            return None
        if self._pair is None:
            raise ConfigError(f"workers: {worker.name}: zmq_server_key needs the gateway's own "
                              "key pair (zmq_keys.secret_key_file)")
        path = worker.zmq_server_key
        server_public = self._server_keys.get(path)
        if server_public is None:
            try:
                server_public = self._server_keys[path] = load_public_key(path)
            except ZmqKeyError as err:
                raise ConfigError(f"workers: {worker.name}: zmq_server_key: {err}") from None
        return ClientKeys(self._pair[0], self._pair[1], server_public)
