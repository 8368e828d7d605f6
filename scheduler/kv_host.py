"""A worker's host-tier (CPU) blocks, the other half of its KV index (scheduler/kv_index.py,
"Media"), and the shedding both halves share when a worker's index outgrows its bound
("Bound" there).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice
from typing import Any

from scheduler.kv_events import MEDIUM_CPU, BlockHash, BlockRemoved, BlockStored, block_token_counts

# An index over its bound sheds this fraction of the bound at once, not just the excess: the
# oldest block is found by scanning the dict from its front, past the slots of blocks removed
# since the dict last resized, so one scan per eighth of the bound keeps shedding O(1) per block.
SHED_FRACTION = 8


def oldest_over_bound(blocks: dict[BlockHash, Any], max_blocks: int) -> list[BlockHash]:
    """The hashes to drop from ``blocks`` (stored oldest first) once it holds more than
    ``max_blocks``: the oldest, down to ``max_blocks`` less a :data:`SHED_FRACTION`th."""
    keep = max_blocks - max_blocks // SHED_FRACTION
    return list(islice(blocks, max(len(blocks) - keep, 0)))


class HostKV:
    """One worker's host-tier (CPU) blocks and whose they are.

    The tier's own events name no session (vLLM's offloading events carry the block keys; the
    simulator's the same), so a stored block belongs to the sessions the event names, else to
    the sessions holding that hash on the worker's GPU when the store lands (the tier stores
    write-through from running requests, so the GPU copy is there then). A block whose GPU
    copy is already gone counts for nobody: it is under-reported, never over.

    Invariant 5: ``session_tokens[s] == sum(tokens of b for b in blocks if s in sessions of b)``
    and ``session_blocks[s]`` lists exactly those blocks (numbered after :class:`WorkerKV`'s).
    Bounded by the tier's capacity, as the GPU side is by the pool's; and by ``max_blocks``
    when set (:meth:`KVIndex.set_capacity`), the oldest stored going first.
    """

    def __init__(self) -> None:
        # hash -> (tokens, sessions)
        self.blocks: dict[BlockHash, tuple[int, tuple[str, ...]]] = {}
        self.session_tokens: dict[str, int] = {}
        self.session_blocks: dict[str, dict[BlockHash, None]] = {}
        self.events_seen = 0
        self.unknown_removals = 0
        self.max_blocks: int | None = None  # None: unbounded (:meth:`set_bound`)
        # blocks dropped because the tier's index held more than ``max_blocks`` (survives resets)
        self.overflow_dropped = 0

    def store(self, event: BlockStored, gpu_blocks: Mapping[BlockHash, Any]) -> None:
        """Apply a tier store; ``gpu_blocks`` is the worker's GPU side
        (:attr:`scheduler.kv_index.WorkerKV.blocks`), whose sessions a block names no one for
        inherits."""
        named = (event.session_id,) if event.session_id is not None else None
        for block_hash, tokens in zip(event.block_hashes, block_token_counts(event)):
            if block_hash in self.blocks:
                continue  # a re-store of a held chunk changes nothing (the manager's reuse)
            if named is not None:
                sessions = named
            else:
                on_gpu = gpu_blocks.get(block_hash)
                sessions = tuple(on_gpu.sessions) if on_gpu is not None else ()
            self.blocks[block_hash] = (tokens, sessions)
            for session in sessions:  # keeps invariant 5
                self.session_tokens[session] = self.session_tokens.get(session, 0) + tokens
                self.session_blocks.setdefault(session, {})[block_hash] = None
            # Checked per block, not per event: one event must not overshoot the bound (the
            # tier's blocks do not link, so shedding in the middle of an event is safe).
            if self.max_blocks is not None and len(self.blocks) > self.max_blocks:
                self.shed()

    def set_bound(self, max_blocks: int | None) -> None:
        """Hold at most ``max_blocks`` blocks from now on (None: unbounded); blocks over it
        are dropped at once."""
        self.max_blocks = max_blocks
        self.shed()

    def shed(self) -> None:
        """Drop the oldest stored blocks while the tier's index is over ``max_blocks``."""
        if self.max_blocks is None or len(self.blocks) <= self.max_blocks:
            return
        victims = oldest_over_bound(self.blocks, self.max_blocks)
        self.remove(BlockRemoved(block_hashes=victims, medium=MEDIUM_CPU))
        self.overflow_dropped += len(victims)

    def remove(self, event: BlockRemoved) -> None:
        for block_hash in event.block_hashes:
            held = self.blocks.pop(block_hash, None)
            if held is None:
                self.unknown_removals += 1
                continue
            tokens, sessions = held
            for session in sessions:  # keeps invariant 5
                owned = self.session_blocks[session]
                del owned[block_hash]
                if owned:
                    self.session_tokens[session] -= tokens
                else:
                    del self.session_blocks[session]
                    del self.session_tokens[session]

    def clear(self) -> None:
        self.blocks = {}
        self.session_tokens = {}
        self.session_blocks = {}

    @property
    def resident_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.blocks.values())
