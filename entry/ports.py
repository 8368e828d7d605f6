"""Free TCP ports for the processes a run starts on this machine: simworkers, gateways,
vLLM workers (the demo, the benchmarks and the tests all pick theirs here)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where a port is drawn when the kernel's ephemeral range leaves too little below it.
_LOWEST_PORT = 10_000
_MIN_SPAN = 2_000
_ATTEMPTS_PER_PORT = 500


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on, drawn outside the kernel's ephemeral range:
    every ``bind(0)`` on the machine (vLLM's own internal sockets among them) draws from that
    range, so a port picked there may be taken again before the process meant to bind it
    starts. Each is checked by binding ``0.0.0.0`` (KV-event sockets bind ``tcp://*:PORT``)."""
    lo, hi = _ephemeral_range()
    span = (_LOWEST_PORT, lo) if lo - _LOWEST_PORT >= _MIN_SPAN else (hi + 1, 65535)
    rng = random.SystemRandom()
    picked: list[int] = []
    for _ in range(_ATTEMPTS_PER_PORT * count):
        if len(picked) == count:
            return picked
        port = rng.randrange(*span)
        if port in picked:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        picked.append(port)
    if len(picked) == count:
        return picked
    raise RuntimeError(f"no {count} free ports in {span}")


def free_port() -> int:
    """One port nothing listens on (see :func:`free_ports`)."""
    return free_ports(1)[0]
