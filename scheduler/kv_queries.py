"""What a worker's KV index answers (scheduler/kv_index.py): the longest resident prefix of a
request's block hashes, and of a program's continuations, past the holes and caps that the
index's "Resident prefixes" section defines; and which sessions its shared tokens count (the
ledger's :meth:`~KVQueries.set_counted`). A mixin of :class:`~scheduler.kv_index.WorkerKV`, kept
apart from the events that change what it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from scheduler.kv_events import BlockHash


class KVQueries:
    """The read side of :class:`~scheduler.kv_index.WorkerKV`, over its state; counting
    changes keep ``shared_tokens`` as WorkerKV's numbered rules state it."""

    blocks: dict[BlockHash, Any]  # hash -> the index's block (``kv_index._Block``)
    shared_blocks: dict[str, dict[BlockHash, None]]
    counted: dict[str, None]
    shared_tokens: int
    holes: dict[BlockHash, int]
    caps: dict[str, list[int]]
    continuation_blocks: dict[str, dict[BlockHash, None]]
    _epoch: int

    def set_counted(self, session: str, counted: bool) -> None:
        """Include or exclude ``session`` from the shared-token count."""
        if counted == (session in self.counted):
            return
        blocks = self.blocks
        change = 0
        # A block's share max(0, counted - 1) moves by one exactly when it is (or becomes)
        # held by two or more counted sessions.
        if counted:
            self.counted[session] = None
            for block_hash in self.shared_blocks.get(session, ()):
                block = blocks[block_hash]
                block.counted += 1
                if block.counted >= 2:
                    change += block.tokens
        else:
            del self.counted[session]
            for block_hash in self.shared_blocks.get(session, ()):
                block = blocks[block_hash]
                if block.counted >= 2:
                    change -= block.tokens
                block.counted -= 1
        self.shared_tokens += change  # the shared-token rule of WorkerKV (its second)

    def prefix_tokens(self, hashes: Sequence[BlockHash]) -> int:
        """Tokens of the longest resident prefix of ``hashes``."""
        find = self.blocks.get  # bound once: placement asks every worker for every new program
        total = 0
        for block_hash in hashes:
            block = find(block_hash)
            if block is None:
                break
            total += block.tokens
        return total

    def continuation_tokens(self, continuation_ids: Iterable[str]) -> int:
        """The longest resident prefix admitted under any of these continuation ids: the
        deepest block labelled with one of them that no hole cuts off and no cap of its
        continuation excludes (see scheduler/kv_index.py)."""
        best = 0
        blocks = self.blocks
        check = bool(self.holes)
        epoch = self._epoch
        for cid in continuation_ids:
            labelled = self.continuation_blocks.get(cid)
            if not labelled:
                continue
            caps = self.caps.get(cid)
            below = caps[0] if caps else None
            for block_hash in labelled:
                block = blocks[block_hash]
                end = block.prefix_tokens
                if end <= best or (below is not None and end >= below):
                    continue
                if check and not (block.rooted if block.checked == epoch else self._rooted(block)):
                    continue
                best = end
        return best

    def _rooted(self, block: Any) -> bool:
        """Whether no hole lies above ``block``; walks each chain once per epoch."""
        epoch = self._epoch
        if block.checked == epoch:
            return block.rooted
        blocks, holes = self.blocks, self.holes
        path = []
        while True:
            if block.checked == epoch:
                # known, or on this walk already: a loop of resident blocks has no hole
                rooted = block.rooted
                break
            block.checked, block.rooted = epoch, True
            path.append(block)
            parent = block.parent
            if parent is None:
                rooted = True
                break
            above = blocks.get(parent)
            if above is None:
                rooted = parent not in holes
                break
            block = above
        for walked in path:
            walked.rooted = rooted
        return rooted

    @property
    def resident_tokens(self) -> int:
        return sum(block.tokens for block in self.blocks.values())
