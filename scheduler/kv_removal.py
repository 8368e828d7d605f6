"""WorkerKV's removal path (scheduler/kv_index.py): a run of removed hashes applied at once.

A mixin of :class:`~scheduler.kv_index.WorkerKV`, kept apart for size, as
:class:`~scheduler.kv_queries.KVQueries` is. vLLM evicts a block per event, and a store's blocks
tend to go together (one after another, oldest first in ``bench/kv_ingest.py``), so what they
share is settled once per run, not per block: the sessions' tokens (the store's blocks share
one sessions tuple), the continuation's block dict, and the hole each block leaves for the next
(a chain evicted from its head opens a hole and closes the one above on every removal; only the
last one open is written to ``holes``). The state after a run is the state block by block.
"""

from __future__ import annotations

from typing import Any

from scheduler.kv_events import BlockHash


class KVRemoval:
    """The removal side of :class:`~scheduler.kv_index.WorkerKV`, over its state, keeping the
    rules WorkerKV numbers."""

    blocks: dict[BlockHash, Any]  # hash -> the index's block (``kv_index._Block``)
    session_tokens: dict[str, int]
    _zero_blocks: dict[str, int]
    shared_blocks: dict[str, dict[BlockHash, None]]
    continuation_blocks: dict[str, dict[BlockHash, None]]
    shared_tokens: int
    holes: dict[BlockHash, int]
    _orphans: dict[BlockHash, int]
    caps: dict[str, list[int]]
    _epoch: int
    unknown_removals: int
    attributed_removals: int
    evicted_tokens: int

    def _cap(self, continuation: str, end: int) -> None:  # pragma: no cover - WorkerKV's
        raise NotImplementedError

    def _remove(self, hashes: list[BlockHash], attributed: str | None = None,
                num_tokens: int | None = None) -> None:
        if attributed is not None:
            self.attributed_removals += len(hashes)
        take = self.blocks.pop
        holes = self.holes
        continuation_blocks, caps = self.continuation_blocks, self.caps
        epoch = self._epoch  # written back at the end; nothing called below reads it
        evicted = 0
        # Written once per run of blocks that share them (a store's blocks come out together):
        # the last continuation seen and its blocks; the sessions (one) of the last blocks and
        # the tokens they lost; the hash of the last block removed with children and how many,
        # whose hole is entered in ``holes`` only if a child is left when another comes (a
        # chain evicted from its head opens a hole and closes the one above on every removal).
        label = labelled = owners = None
        lost = 0
        gone = none_gone = object()  # ``gone``: that hash (equal to no hash), or none
        gone_children = 0
        for block_hash in hashes:
            try:
                block = take(block_hash)
            except KeyError:
                if gone is not none_gone:
                    holes[gone], gone = gone_children, none_gone
                self.unknown_removals += 1
                orphans = self._orphans
                if orphans and block_hash in orphans:
                    holes[block_hash] = orphans.pop(block_hash)
                    epoch += 1
                if attributed is not None and num_tokens is not None and len(hashes) == 1:
                    self._cap(attributed, num_tokens)
                continue
            children = block.children
            parent = block.parent
            if parent == gone:
                # its parent is the hole ``gone``: cut off already, no new epoch
                if children:
                    if gone_children > 1:
                        holes[gone] = gone_children - 1
                    gone, gone_children = block_hash, children
                elif gone_children > 1:
                    gone_children -= 1
                else:
                    gone = none_gone  # a hole nobody hangs from is forgotten
            else:
                cut = False
                if parent is not None:
                    above = self.blocks.get(parent)
                    if above is not None:
                        above.children -= 1
                    else:
                        if gone is not none_gone:
                            holes[gone], gone = gone_children, none_gone
                        hole = holes.get(parent)
                        if hole is not None:
                            cut = True
                            if hole > 1:
                                holes[parent] = hole - 1
                            else:
                                del holes[parent]
                        elif parent == block_hash:
                            children -= 1  # it counted itself
                        else:  # a chain's start the index never held
                            orphans = self._orphans
                            left = orphans[parent] - 1
                            if left:
                                orphans[parent] = left
                            else:
                                del orphans[parent]
                if children:
                    # Its descendants lose their prefix, unless a hole above had cut them off
                    # already (the common case when eviction runs from a chain's head).
                    if not (cut or (block.checked == epoch and not block.rooted)):
                        epoch += 1
                    if gone is not none_gone:
                        holes[gone] = gone_children
                    gone, gone_children = block_hash, children
            sessions = block.sessions
            if sessions is owners:
                # of the store the last block came from (its tuple): one session, one label,
                # and tokens (an empty block has a tuple of its own)
                lost += block.tokens
                if label is not None:
                    del labelled[block_hash]
                    if not labelled:  # its last block: the store's others are gone already
                        del continuation_blocks[label]
                        if caps:
                            caps.pop(label, None)
                        label = None
                continue
            if owners is not None:  # WorkerKV's first rule, once per store's run
                evicted += lost
                self._drop_tokens(owners[0], lost)
            tokens = block.tokens
            if len(sessions) == 1 and tokens:
                owners, lost = sessions, tokens
            else:
                owners = None
                evicted += tokens
                if len(sessions) == 1:
                    self._drop_tokens(sessions[0], tokens)  # type: ignore[index]
                elif sessions:
                    self._drop_shared(block_hash, block)
            label = block.continuation
            if label is not None:
                labelled = continuation_blocks[label]
                del labelled[block_hash]
                if not labelled:
                    del continuation_blocks[label]
                    if caps:
                        caps.pop(label, None)
                    label = None
        if owners is not None:
            evicted += lost
            self._drop_tokens(owners[0], lost)
        if gone is not none_gone:
            holes[gone] = gone_children
        self._epoch = epoch
        self.evicted_tokens += evicted

    def _drop_tokens(self, session: str, tokens: int) -> None:
        """``session`` lost a block of ``tokens``; gone with its last (WorkerKV's first rule)."""
        zero_blocks = self._zero_blocks
        if not tokens:
            left = zero_blocks[session] - 1
            if left:
                zero_blocks[session] = left
            else:
                del zero_blocks[session]
        left = self.session_tokens[session] - tokens
        if left or session in zero_blocks:
            self.session_tokens[session] = left
        else:
            del self.session_tokens[session]

    def _drop_shared(self, block_hash: BlockHash, block: Any) -> None:
        """The sessions' side of removing a block two or more sessions hold."""
        if block.counted >= 2:
            self.shared_tokens -= block.tokens * (block.counted - 1)  # WorkerKV's second rule
        for session in block.sessions:
            shared = self.shared_blocks[session]  # WorkerKV's third rule
            del shared[block_hash]
            if not shared:
                del self.shared_blocks[session]
            self._drop_tokens(session, block.tokens)
