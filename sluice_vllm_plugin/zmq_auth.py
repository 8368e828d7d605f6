"""CurveZMQ authentication of Sluice's ZMQ sockets, shared by the gateway, the simworker and
the engine plugin (pyzmq only: this runs in vLLM's environment too).

Who holds which key:

* the side that receives directives or publishes KV events (the simworker, the engine plugin)
  is the CURVE *server*: it holds a key pair (``NAME.key`` public, ``NAME.key_secret``
  secret, ZeroMQ's certificate format) and a directory of the public keys of the clients it
  accepts; a ZAP handler (:class:`ServerAuth`) turns away every other client, so a process
  without an accepted key can neither push a directive nor read events or replays;
* the gateway is the CURVE *client*: its own key pair, and each worker's public key.

``sluice keys`` makes the pairs (:func:`write_key_pair`). A secret key file that others may
read is refused (:func:`load_key_pair`), as ssh refuses such a private key.

Without keys a socket is open to whoever reaches it, so :func:`check_bind` refuses to bind
one on a network interface (anything but loopback, ``ipc://`` or ``inproc://``) unless the
setting that allows it is on, and :func:`restrict_ipc` makes the ``ipc://`` files we create
readable and writable by their owner only.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
# The ZAP domain our servers announce: the authenticator answers for it.
ZAP_DOMAIN = "sluice"


class ZmqKeyError(ValueError):
    """A key file that is missing, unreadable, malformed or too open."""


def write_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600) into
    ``directory``; refuses to overwrite either. The pair is made in a private (0700)
    directory and moved into place, so the secret is never readable by others, even for
    a moment."""
    import zmq.auth

    if not name or "/" in name or name.startswith("."):
        raise ZmqKeyError(f"a key name is a plain file name, got {name!r}")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    public = target / f"{name}{PUBLIC_SUFFIX}"
    secret = target / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists():
            raise ZmqKeyError(f"{path} exists already; remove it or choose another name")
    with tempfile.TemporaryDirectory(dir=target, prefix=".sluice-keys-") as private:
        made_public, made_secret = zmq.auth.create_certificates(private, name)
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    return public, secret


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except OSError as err:
        raise ZmqKeyError(f"{path}: cannot read ({err.strerror or err})") from None
    except ValueError as err:
        raise ZmqKeyError(f"{path}: not a ZeroMQ key file ({err})") from None
    if not public:
        raise ZmqKeyError(f"{path}: holds no public key")
    return public, secret


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file, Z85-encoded."""
    return _load(path)[0]


def load_key_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The (public, secret) keys of a ``.key_secret`` file. Refused when the file is
    readable or writable by its group or others: a secret anyone may read is no secret."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ZmqKeyError(f"{path}: cannot read ({err.strerror or err})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ZmqKeyError(f"{path}: a secret key file must be private to its owner, but its "
                          f"mode is {stat.S_IMODE(mode):04o}; run chmod 600 {path}")
    public, secret = _load(path)
    if not secret:
        raise ZmqKeyError(f"{path}: holds no secret key (give the {SECRET_SUFFIX} file, "
                          f"not the {PUBLIC_SUFFIX} one)")
    return public, secret


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """A CURVE server's key pair and the directory of the client public keys it accepts."""

    public: bytes
    secret: bytes
    clients_dir: Path

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike[str],
                   client_keys_dir: str | os.PathLike[str]) -> ServerKeys:
        public, secret = load_key_pair(secret_key_file)
        clients = Path(client_keys_dir)
        if not clients.is_dir():
            raise ZmqKeyError(f"{clients}: not a directory of client public keys")
        if not any(clients.glob(f"*{PUBLIC_SUFFIX}")):
            # an empty directory would turn every client away, which is surely a mistake
            raise ZmqKeyError(f"{clients}: holds no client public key (*{PUBLIC_SUFFIX})")
        return cls(public, secret, clients)


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A CURVE client's key pair and the public key of the server it talks to."""

    public: bytes
    secret: bytes
    server_public: bytes


def server_options(keys: ServerKeys) -> list[tuple[int, int | bytes]]:
    """The options that make a socket a CURVE server (set before it binds or connects); a
    :class:`ServerAuth` must run on its context, or libzmq accepts any client that knows the
    (public) server key."""
    import zmq

    return [(zmq.CURVE_SERVER, 1), (zmq.CURVE_PUBLICKEY, keys.public),
            (zmq.CURVE_SECRETKEY, keys.secret), (zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())]


def set_server_options(socket: Any, keys: ServerKeys) -> None:
    """Make ``socket`` a CURVE server (see :func:`server_options`)."""
    for option, value in server_options(keys):
        socket.setsockopt(option, value)


def set_client_options(socket: Any, keys: ClientKeys) -> None:
    """Make ``socket`` a CURVE client of the server whose public key ``keys`` holds."""
    import zmq

    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class ServerAuth:
    """The ZAP handler of one ZMQ context: accepts CURVE clients whose public key is in
    ``keys.clients_dir`` (read when it starts), nothing else. Start it before a server
    socket of that context binds; stop it before the context is terminated."""

    def __init__(self, context: Any, keys: ServerKeys) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        # The handler runs on a thread with plain sockets, also for an asyncio context: a
        # shadow shares the libzmq context, which is what ZAP is bound to.
        self._context = zmq.Context.shadow(context.underlying)
        self._auth = ThreadAuthenticator(self._context, log=_auth_logger())
        self._auth.start()
        self._auth.configure_curve(domain=ZAP_DOMAIN, location=str(keys.clients_dir))
        self._lock = threading.Lock()

    def stop(self) -> None:
        with self._lock:
            if self._auth is not None:
                self._auth.stop()
                self._auth = None  # type: ignore[assignment]


def _auth_logger() -> Any:
    import logging
    return logging.getLogger("sluice.zmq_auth")


# -- where a socket without keys may listen ------------------------------------------------

LOOPBACK_NAMES = ("localhost",)


def listens_beyond_loopback(endpoint: str) -> bool:
    """Whether binding ``endpoint`` listens on a network interface other than loopback:
    a ``tcp://`` endpoint whose host is ``*``, an unspecified address (``0.0.0.0``, ``::``),
    an interface name or any non-loopback address. ``ipc://`` and ``inproc://`` do not."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    host = host.rpartition(";")[2]  # tcp://source;host:port names the local address last
    if host.lower() in LOOPBACK_NAMES:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # "*", an interface name, a host name: not provably loopback


class InsecureBindRefused(ValueError):
    """A socket without keys would listen on a network interface."""


def check_bind(endpoint: str, *, keyed: bool, allow_insecure: bool, setting: str,
               keys_hint: str, allow_hint: str) -> None:
    """Refuse to bind ``endpoint`` without keys on a network interface, unless allowed.
    ``setting`` names the endpoint's setting, ``keys_hint`` how to give keys and
    ``allow_hint`` the setting that accepts the risk."""
    if keyed or allow_insecure or not listens_beyond_loopback(endpoint):
        return
    raise InsecureBindRefused(
        f"{setting}: {endpoint} would listen beyond loopback without CURVE keys, so any host "
        f"that reaches it could use it; give keys ({keys_hint}), bind loopback "
        f"(tcp://127.0.0.1:*) or ipc://, or set {allow_hint} to accept the risk")


def restrict_ipc(endpoint: str) -> None:
    """Make the file of a bound ``ipc://`` endpoint private to its owner (0600): whoever
    can open it can talk to the socket. Abstract names (``ipc://@name``) have no file."""
    scheme, _, path = endpoint.partition("://")
    if scheme == "ipc" and path and not path.startswith("@"):
        os.chmod(path, 0o600)


# -- the engine plugin's settings ----------------------------------------------------------

ENV_SECRET_KEY_FILE = "SLUICE_ZMQ_SECRET_KEY_FILE"
ENV_CLIENT_KEYS_DIR = "SLUICE_ZMQ_CLIENT_KEYS_DIR"
ENV_ALLOW_INSECURE_BIND = "SLUICE_ZMQ_ALLOW_INSECURE_BIND"


def server_keys_from_environment(environ: Any = os.environ) -> tuple[ServerKeys | None, bool]:
    """The plugin's CURVE server keys (``SLUICE_ZMQ_SECRET_KEY_FILE`` and
    ``SLUICE_ZMQ_CLIENT_KEYS_DIR``, both or neither) and whether a socket without them may
    listen beyond loopback (``SLUICE_ZMQ_ALLOW_INSECURE_BIND=1``). A ZmqKeyError when the
    keys are half given or unusable: the caller then opens no socket rather than an open one."""
    secret = environ.get(ENV_SECRET_KEY_FILE, "").strip()
    clients = environ.get(ENV_CLIENT_KEYS_DIR, "").strip()
    allow = environ.get(ENV_ALLOW_INSECURE_BIND, "").strip().lower() in ("1", "true", "yes")
    if bool(secret) != bool(clients):
        raise ZmqKeyError(f"{ENV_SECRET_KEY_FILE} and {ENV_CLIENT_KEYS_DIR} go together")
    if not secret:
        return None, allow
    try:
        return ServerKeys.from_files(secret, clients), allow
    except ZmqKeyError as err:
        raise ZmqKeyError(f"{ENV_SECRET_KEY_FILE} / {ENV_CLIENT_KEYS_DIR}: {err}") from None
