"""Initial binding: each new program's home worker on a consistent-hash ring.

Source: vllm-project/router ``src/program_scheduling/binding/mod.rs`` (``ConsistentHashBinding``):
every worker ("rank") owns ``hash_virtual_nodes`` points, the hashes of ``"{worker}:{i}"``; a
program goes to the owner of the first point at or after its key's hash, wrapping around.
Binding is made once, at the program's first call, and kept; the ring is rebuilt when the
set of workers changes. Sluice's choices where the source is its own: the key is the
session id (the source hashes its placement key, a session header or the request body), and
the hash is BLAKE2b's first 8 bytes (the source's FurcHash + MurmurHash64A is not in the
standard library; any well-mixed 64-bit hash gives the ring its balance).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Iterable


def ring_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """The ring of the workers a program may be bound to, rebuilt when they change."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._built_for: tuple[tuple[str, ...], int] = ((), 0)
        # parallel tuples, sorted by point: a rebuilt ring replaces them whole
        self._points: tuple[int, ...] = ()
        self._owners: tuple[str, ...] = ()

    def pick(self, key: str, workers: Iterable[str]) -> str | None:
        """The worker ``key`` is bound to among ``workers`` (None when there is none)."""
        names = tuple(sorted(workers))
        if self._built_for != (names, self.virtual_nodes):
            ring = sorted((ring_hash(f"{name}:{node}"), name)
                          for name in names for node in range(self.virtual_nodes))
            self._points = tuple(point for point, _ in ring)
            self._owners = tuple(owner for _, owner in ring)
            self._built_for = (names, self.virtual_nodes)
        if not self._points:
            return None
        at = bisect_left(self._points, ring_hash(key))
        return self._owners[at % len(self._owners)]
