"""CurveZMQ on vLLM's own KV-event publisher (``ZmqEventPublisher``): its PUB socket and its
replay ROUTER carry every cached block's hash and token ids, so whoever can subscribe reads
the prompts the engine serves, and whoever reaches the ROUTER gets up to ``buffer_steps``
past batches.

With ``SLUICE_ZMQ_SECRET_KEY_FILE`` and ``SLUICE_ZMQ_CLIENT_KEYS_DIR`` set (the same settings
as the directive socket, :mod:`sluice_vllm_plugin.zmq_auth`), the publisher gets a private
ZMQ context with a ZAP handler on it, and every socket it binds is a CURVE server that only
the clients in that directory (the gateway) may use. A PUB that *connects* (the llm-d
layout: the gateway binds one SUB and the engines connect to it) is a CURVE client of the
gateway instead, when ``SLUICE_ZMQ_GATEWAY_KEY_FILE`` names the gateway's public key
(``NAME.key``); the gateway hears it only if the engine's public key is in its
``zmq_keys.publisher_keys_dir``. Without that file such a PUB connects without CURVE, as
vLLM does, and a warning says that a keyed gateway will not hear it.

Without keys, a socket that would listen beyond loopback is refused unless
``SLUICE_ZMQ_ALLOW_INSECURE_BIND=1``, as for the directive socket. vLLM's default endpoint,
``tcp://*:5557``, is such a socket, so an engine started with that default and the plugin
installed stops at start with an error naming both remedies: an open PUB gives the prompts'
token ids to anyone on the network, which is worse than a refused start that says why.
(vLLM binds a tcp endpoint only when it holds ``*``, so tcp means every interface here;
``ipc://`` is the keyless choice, and its file is made private to its owner.) Keys that are
half given or unusable also stop the engine rather than open the sockets unauthenticated.

How: vLLM makes and binds both sockets in ``_socket_setup`` (from ``__init__``) with
``self._ctx.socket(...)`` and nothing in between, so while it runs ``self._ctx`` is a
stand-in (:class:`CurveSocketFactory`) whose sockets come out with their CURVE options
already set. ``shutdown`` then also stops the ZAP handler and ends the private context.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq
from vllm.distributed.kv_events import ZmqEventPublisher

from .patching import MethodPatches
from .zmq_auth import (
    ENV_ALLOW_INSECURE_BIND,
    ENV_CLIENT_KEYS_DIR,
    ENV_SECRET_KEY_FILE,
    ClientKeys,
    ServerAuth,
    ServerKeys,
    ZmqKeyError,
    check_bind,
    load_public_key,
    restrict_ipc,
    server_keys_from_environment,
    set_client_options,
    set_server_options,
)

logger = logging.getLogger("sluice.vllm_plugin.publisher_auth")

ENV_GATEWAY_KEY_FILE = "SLUICE_ZMQ_GATEWAY_KEY_FILE"
_AUTH_ATTR = "_sluice_auth"


def gateway_client_keys(server_keys: ServerKeys | None,
                        environ: Any = os.environ) -> ClientKeys | None:
    """The CURVE client keys of a PUB that connects to the gateway: the engine's own pair and
    the gateway's public key (``SLUICE_ZMQ_GATEWAY_KEY_FILE``); None when that is not set.
    A ZmqKeyError when it is set without the engine's keys, or is not a public key file."""
    path = environ.get(ENV_GATEWAY_KEY_FILE, "").strip()
    if not path:
        return None
    if server_keys is None:
        raise ZmqKeyError(f"{ENV_GATEWAY_KEY_FILE} needs the engine's own keys too "
                          f"({ENV_SECRET_KEY_FILE} and {ENV_CLIENT_KEYS_DIR})")
    try:
        gateway_public = load_public_key(path)
    except ZmqKeyError as err:
        raise ZmqKeyError(f"{ENV_GATEWAY_KEY_FILE}: {err}") from None
    return ClientKeys(server_keys.public, server_keys.secret, gateway_public)


class CurveSocketFactory:
    """Stands in for the publisher's context while vLLM makes its sockets: each comes out
    with ``configure[socket_type]`` applied, before vLLM binds or connects it."""

    def __init__(self, context: zmq.Context,
                 configure: dict[int, Callable[[zmq.Socket], None]]) -> None:
        self._context = context
        self._configure = configure

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> zmq.Socket:
        socket = self._context.socket(socket_type, *args, **kwargs)
        configure = self._configure.get(socket_type)
        if configure is None:
            socket.close(linger=0)
            raise TypeError(f"the KV-event publisher made a socket of type {socket_type}, which "
                            "the plugin has no CURVE role for (a vLLM change?)")
        configure(socket)
        return socket


def _check_binds(publisher: ZmqEventPublisher, keyed: bool, allow_insecure: bool) -> bool:
    """Refuse a keyless bind beyond loopback; whether the PUB binds (else it connects)."""
    pub_binds = publisher._is_bind_endpoint(publisher._endpoint)
    endpoints = [("endpoint", publisher._endpoint)] if pub_binds else []
    if publisher._replay_endpoint is not None:  # vLLM always binds the replay socket
        endpoints.append(("replay_endpoint", publisher._replay_endpoint))
    for setting, endpoint in endpoints:
        check_bind(endpoint, keyed=keyed, allow_insecure=allow_insecure,
                   setting=f"vLLM --kv-events-config {setting}",
                   keys_hint=f"{ENV_SECRET_KEY_FILE} and {ENV_CLIENT_KEYS_DIR}",
                   allow_hint=f"{ENV_ALLOW_INSECURE_BIND}=1")
    return pub_binds


def _wrap_socket_setup(orig: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(orig)
    def _socket_setup(self: ZmqEventPublisher) -> None:
        server_keys, allow_insecure = server_keys_from_environment()
        gateway_keys = gateway_client_keys(server_keys)
        pub_binds = _check_binds(self, server_keys is not None, allow_insecure)
        if server_keys is None:
            orig(self)
        else:
            if not pub_binds and gateway_keys is None:
                logger.warning("sluice: the KV-event PUB connects to %s without CURVE: a gateway "
                               "whose kv_events_bind has keys will not hear it; set %s to the "
                               "gateway's public key", self._endpoint, ENV_GATEWAY_KEY_FILE)
            self._ctx = _keyed_socket_setup(self, orig, server_keys, gateway_keys, pub_binds)
        if pub_binds:
            restrict_ipc(self._endpoint)
        if self._replay_endpoint is not None:
            restrict_ipc(self._replay_endpoint)
    return _socket_setup


def _keyed_socket_setup(publisher: ZmqEventPublisher, orig: Callable[[Any], None],
                        server_keys: ServerKeys, gateway_keys: ClientKeys | None,
                        pub_binds: bool) -> zmq.Context:
    """Run vLLM's setup with CURVE sockets on a private context; that context."""
    def as_server(socket: zmq.Socket) -> None:
        set_server_options(socket, server_keys)

    def as_pub(socket: zmq.Socket) -> None:
        if pub_binds:
            as_server(socket)
        elif gateway_keys is not None:
            set_client_options(socket, gateway_keys)

    # Private, not vLLM's shared Context.instance(): the ZAP handler answers for the whole
    # context, and it must end with this publisher.
    context = zmq.Context()
    auth = ServerAuth(context, server_keys)
    publisher._ctx = CurveSocketFactory(context, {zmq.PUB: as_pub, zmq.ROUTER: as_server})
    try:
        orig(publisher)
    except BaseException:
        auth.stop()
        context.destroy(linger=0)
        raise
    setattr(publisher, _AUTH_ATTR, auth)
    return context


def _wrap_shutdown(orig: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(orig)
    def shutdown(self: ZmqEventPublisher) -> None:
        try:
            orig(self)
        finally:
            auth = getattr(self, _AUTH_ATTR, None)
            if auth is not None:  # only keyed publishers have a private context to end
                setattr(self, _AUTH_ATTR, None)
                auth.stop()
                self._ctx.destroy(linger=0)
    return shutdown


PATCHES = MethodPatches([(ZmqEventPublisher, "_socket_setup", _wrap_socket_setup),
                         (ZmqEventPublisher, "shutdown", _wrap_shutdown)])


def apply() -> None:
    """Patch ``ZmqEventPublisher`` (idempotent)."""
    PATCHES.apply()


def remove() -> None:
    """Undo :func:`apply` (tests)."""
    PATCHES.remove()
