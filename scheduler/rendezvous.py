"""Which shard owns a program: rendezvous (highest-random-weight) hashing of its root session.

Both shells use this one function: the simulator's sharded policy (sim/shards.py) and the
Ray Serve request router that sends each call to the gateway replica owning its program
(ray_fleet/serve_shards.py), so a sharded run measured offline splits the programs exactly as
the live ingress does. Each shard scores ``blake2b(shard, root)`` and the highest wins: when
the number of shards changes, only the programs whose winner changed move (a new shard takes
a 1/K share from every old one; none move between old shards).
"""

from __future__ import annotations

import hashlib


def rendezvous_shard(root: str, shards: int) -> int:
    """The shard (0 … shards − 1) that owns ``root``: the one whose hash with it is highest."""
    if shards < 1:
        raise ValueError(f"shards must be ≥ 1, got {shards}")

    def score(shard: int) -> bytes:
        return hashlib.blake2b(f"{shard}\x00{root}".encode(), digest_size=8).digest()

    return max(range(shards), key=score)
