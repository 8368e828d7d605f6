"""Which worker URLs the gateway will talk to: the ``worker_urls`` allow-list of the config.

A worker URL is where the gateway sends clients' calls and from where it relays the answer
back, so a URL that points anywhere (a cloud metadata service at 169.254.169.254, another
local service, a path of some other server) turns the gateway into a relay to it. Every
worker URL, from the YAML ``workers:`` and from ``POST /sluice/workers``, is checked here
before the gateway opens a connection to it.

Two steps, because the first must not wait on the network (it runs inside config
validation, which also runs on a hot reload inside the event loop):

- :meth:`UrlAllowList.check_form`: the scheme is allowed; the URL is ``scheme://HOST[:PORT]``
  and nothing else (no user info, path, query or fragment: a path would reach some other
  application on an allowed host); a host written as an IP address lies in an allowed
  network.
- :meth:`UrlAllowList.check_addresses`: a host written as a name and not listed in
  ``hosts`` is resolved, and every address it resolves to must lie in an allowed network
  (one address outside is enough to refuse: the OS may connect to any of them).

A worker's ZMQ endpoints that the gateway connects to (``kv_events``, ``replay``,
``directives``) reach its host as surely as its URL does, so a ``tcp://`` one is held to the
same hosts and networks (:meth:`UrlAllowList.check_endpoint_form`,
:meth:`UrlAllowList.check_endpoint_addresses`); ``schemes`` is the URL's alone. ``ipc://`` and
``inproc://`` endpoints reach no other host and pass; a ``kv_events`` the gateway binds
(holding ``*``) names a local interface, and is checked as a bind instead
(controller/serve_config.py).

How DNS is treated. A name is resolved when its worker joins (the gateway starting, or the
admin API adding it), and the check holds for those answers only: the connections made later
resolve the name again, so a name whose records change afterwards is not checked again.
Name in ``hosts`` only names whose DNS you control (a name listed there is trusted as is,
and is not resolved), or give workers by IP address. A name that cannot be resolved is
refused (it cannot be checked); list it in ``hosts`` to accept it anyway.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import anyio

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Loopback and private networks (RFC 1918, IPv6 unique local addresses): where engines run
# next to a gateway. Link-local (169.254.0.0/16, fe80::/10, where cloud metadata services
# answer) and public addresses are not in it.
DEFAULT_NETWORKS = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12",
                    "192.168.0.0/16", "fc00::/7")
DEFAULT_SCHEMES = ("http", "https")


class WorkerUrlRefused(ValueError):
    """A worker URL outside the allow-list; the message names the URL (any password in it
    masked) and why."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"{shown(url)!r}: {why}")


@dataclass(frozen=True)
class UrlAllowList:
    """The allowed schemes, host names (trusted as named) and networks (every address a
    worker's host stands for must lie in one)."""

    schemes: frozenset[str]
    hosts: frozenset[str]  # lower case
    networks: tuple[IpNetwork, ...]

    @classmethod
    def of(cls, schemes: Iterable[str], hosts: Iterable[str],
           networks: Iterable[IpNetwork]) -> UrlAllowList:
        return cls(frozenset(s.lower() for s in schemes), frozenset(h.lower() for h in hosts),
                   tuple(networks))

    def check_form(self, url: str) -> None:
        """Refuse (:class:`WorkerUrlRefused`) a URL whose form or IP address is not allowed;
        a host name is left to :meth:`check_addresses`."""
        parts = _split(url)
        if parts.scheme.lower() not in self.schemes:
            raise WorkerUrlRefused(
                url, f"scheme {parts.scheme!r} is not one of worker_urls.schemes "
                f"({', '.join(sorted(self.schemes))})")
        if "@" in parts.netloc:
            raise WorkerUrlRefused(url, "user info (user:password@) is not allowed in a "
                                   "worker URL; give an API key with api_key_env or api_key_file")
        if parts.path not in ("", "/") or parts.query or parts.fragment or url.endswith(("?", "#")):
            raise WorkerUrlRefused(url, "a worker URL is scheme://HOST[:PORT] only "
                                   "(no path, query or fragment)")
        host = parts.hostname
        if not host:
            raise WorkerUrlRefused(url, "no host")
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when it is read
        except ValueError as err:
            raise WorkerUrlRefused(url, f"not a port: {err}") from None
        address = _literal_address(host)
        if address is not None:
            self._check_address(url, address)

    async def check_addresses(self, url: str, timeout_s: float) -> None:
        """Refuse a URL whose host name resolves to an address outside every allowed network
        (or cannot be resolved within ``timeout_s``). A literal address was checked by
        :meth:`check_form`; a name in ``hosts`` is trusted as is (module docstring)."""
        self.check_form(url)
        parts = _split(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        await self._check_host(url, parts.hostname or "", port, timeout_s)

    def check_endpoint_form(self, endpoint: str) -> None:
        """Refuse (:class:`WorkerUrlRefused`) a ``tcp://`` ZMQ endpoint the gateway connects
        to whose host is an IP address outside every allowed network; a host name is left
        to :meth:`check_endpoint_addresses`, and other transports pass (module docstring)."""
        target = _zmq_tcp_target(endpoint)
        if target is None:
            return
        address = _literal_address(target[0])
        if address is not None:
            self._check_address(endpoint, address)

    async def check_endpoint_addresses(self, endpoint: str, timeout_s: float) -> None:
        """:meth:`check_addresses` for a ZMQ endpoint the gateway connects to: a ``tcp://``
        host name is resolved and every address checked, unless it is in ``hosts``."""
        self.check_endpoint_form(endpoint)
        target = _zmq_tcp_target(endpoint)
        if target is None:
            return
        host, port = target
        if host in ("", "*"):
            # libzmq refuses to connect to "*" (EINVAL): say so now, not from a task later
            raise WorkerUrlRefused(endpoint, "the gateway connects to this endpoint, so it "
                                   "must name the worker's host (tcp://HOST:PORT)")
        await self._check_host(endpoint, host, port, timeout_s)

    async def _check_host(self, url: str, host: str, port: int, timeout_s: float) -> None:
        """Resolve ``host`` (unless it is an address, checked from the form, or named in
        ``hosts``) and check every address it resolves to."""
        if _literal_address(host) is not None or host.lower() in self.hosts:
            return
        try:
            with anyio.fail_after(timeout_s):
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise WorkerUrlRefused(url, f"{host!r} was not resolved within {timeout_s:g} s; "
                                   "name it in worker_urls.hosts to trust it without "
                                   "resolving it") from None
        except (OSError, UnicodeError) as err:  # socket.gaierror; a name IDNA cannot encode
            raise WorkerUrlRefused(url, f"cannot resolve {host!r} ({err}); name it in "
                                   "worker_urls.hosts to trust it without resolving it") from None
        if not infos:
            raise WorkerUrlRefused(url, f"{host!r} resolves to no address")
        for _family, _type, _proto, _name, sockaddr in infos:
            # the scope id of a link-local IPv6 answer (fe80::1%eth0) is dropped first
            self._check_address(url, ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]),
                                resolved_from=host)

    def _check_address(self, url: str, address: IpAddress, resolved_from: str | None = None
                       ) -> None:
        # An IPv4 address written as IPv6 (::ffff:169.254.169.254) reaches the IPv4 one.
        mapped = getattr(address, "ipv4_mapped", None)
        effective = mapped if mapped is not None else address
        if any(effective in network for network in self.networks):
            return
        where = f"{resolved_from!r} resolves to {effective}" if resolved_from else str(effective)
        raise WorkerUrlRefused(
            url, f"{where}, which is in none of worker_urls.networks "
            f"({', '.join(str(n) for n in self.networks) or 'none'})")


def shown(url: str) -> str:
    """``url`` as it may be logged and answered: user info masked (a password in a URL must
    not reach a log line or an admin's error message)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if sep and "@" in netloc:
        return f"{scheme}://***@{netloc.rsplit('@', 1)[1]}{slash}{tail}"
    return url


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as err:  # an unbalanced IPv6 bracket, say
        raise WorkerUrlRefused(url, f"not a URL ({err})") from None


def _zmq_tcp_target(endpoint: str) -> tuple[str, int] | None:
    """The host and port (0 when not a number) a ``tcp://`` endpoint connects to, as libzmq
    reads it: after the last ``;`` (``tcp://SOURCE;HOST:PORT`` binds SOURCE locally first),
    the port after the last ``:``, an IPv6 host in brackets or not. None for other
    transports."""
    scheme, separator, rest = endpoint.partition("://")
    if not separator or scheme.lower() != "tcp":
        return None
    host, _, port = rest.rpartition(";")[2].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port) if port.isdigit() else 0


def _literal_address(host: str) -> IpAddress | None:
    """``host`` as an IP address when it is written as one (IPv6 with a scope id included),
    else None. Other numeric forms (``2130706433``, ``0x7f.1``) are names here: the resolver
    reads them as addresses, and :meth:`UrlAllowList.check_addresses` checks what it reads."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
