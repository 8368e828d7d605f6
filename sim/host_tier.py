"""A worker's host (CPU DRAM) KV tier, as vLLM 0.32's native offloading runs it.

The bookkeeping mirrors the scheduler side of vLLM's ``OffloadingConnector`` with its CPU
backend and the default LRU policy (``vllm/v1/kv_offload/cpu/manager.py``
``CPUOffloadingManager``, ``vllm/v1/kv_offload/cpu/policies/lru.py`` ``LRUCachePolicy``);
docs/design-notes.md, "Host KV tier", says what vLLM does and where. One chunk is one GPU
block (vLLM's default ``blocks_per_chunk = 1``), keyed by the block's hash:

- a chunk is *pending* from ``prepare_store`` until ``complete_store`` (the GPU→host copy is
  in flight): lookups see it but cannot load it, and it cannot be evicted;
- a *ready* chunk can be pinned by loads (``prepare_load`` … ``complete_load``); only ready,
  unpinned chunks are evicted, least recently used first;
- recency: a chunk is most recent when inserted; ``touch`` and the end of a request re-rank
  the keys given, tail first, so the head of a prefix ends most recent and a prefix is evicted
  from its tail;
- ``prepare_store`` evicts what it needs for the chunks not yet held (never one of the keys it
  was offered) or, when that many cannot be evicted, stores nothing and returns None;
- events: ``BlockRemoved`` (medium ``"CPU"``) when chunks are evicted, ``BlockStored`` (medium
  ``"CPU"``) when a store completes.

Sluice's directives (the engine plugin's semantics, ``sluice_vllm_plugin/host_tier.py``):
``park`` (``kv.offload``) remembers the session's held keys and makes them most recent;
``favour`` (``kv.prefetch``) puts the session's parked keys behind everyone else's in eviction,
favoured ones going by ascending priority (a bias, never a pin), until its deadline, a load of
one of its keys, or ``unfavour`` (``kv.release``). With no directive eviction is vLLM's.

Transfers go over the worker's host link (PCIe), one queue per direction (the link is full
duplex): a copy starts when the link is free and lasts bytes / bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.kv_events import MEDIUM_CPU, BlockHash, BlockRemoved, BlockStored, KVEvent

# ``_Chunk.pins`` of a chunk whose store has not completed (vLLM's ref_cnt of -1)
_STORE_PENDING = -1


class LookupResult:
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"


@dataclass(slots=True)
class _Chunk:
    pins: int = _STORE_PENDING


@dataclass(slots=True)
class _RequestAccess:
    """The keys one request stored or reused, with their block index in its sequence: at its
    end they are re-ranked in prefix order, whatever order they were seen in."""

    positions: dict[BlockHash, int] = field(default_factory=dict)


@dataclass(slots=True)
class StoreOutcome:
    stored: list[BlockHash]  # keys now pending in the tier (the copy to make)
    evicted: list[BlockHash]


class HostLink:
    """One direction of a host↔GPU link: copies run one after another at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    def transfer(self, now: float, num_bytes: int) -> float:
        """Queue a copy of ``num_bytes`` at ``now``; returns when it ends."""
        start = max(now, self.free_at)
        self.free_at = start + num_bytes / self.bytes_per_s
        return self.free_at


class HostTier:
    def __init__(self, num_chunks: int, block_size: int, *, enable_events: bool = True) -> None:
        if num_chunks <= 0:
            raise ValueError(f"a host tier needs at least one chunk, got {num_chunks}")
        self.num_chunks = num_chunks
        self.block_size = block_size
        self.enable_events = enable_events
        # insertion order is recency order: the first key is the least recently used
        self._chunks: dict[BlockHash, _Chunk] = {}
        self._evictable = 0
        self._requests: dict[str, _RequestAccess] = {}
        self._events: list[KVEvent] = []
        # Sluice's directives: session -> its parked keys; key -> its session (bounded by the
        # tier: a key leaves both when it is evicted); favoured session -> (priority, until)
        self._parked: dict[str, dict[BlockHash, None]] = {}
        self._parked_by: dict[BlockHash, str] = {}
        self._favoured: dict[str, tuple[int, float]] = {}

    # -- what it holds ----------------------------------------------------------------

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def num_free(self) -> int:
        return self.num_chunks - len(self._chunks)

    def keys_lru_first(self) -> list[BlockHash]:
        return list(self._chunks)

    def is_ready(self, key: BlockHash) -> bool:
        chunk = self._chunks.get(key)
        return chunk is not None and chunk.pins != _STORE_PENDING

    def lookup(self, key: BlockHash) -> str:
        chunk = self._chunks.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.pins != _STORE_PENDING else LookupResult.HIT_PENDING

    def loadable_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, are held and ready (a pending one ends the run:
        the simulated engine does not defer a request for it, see the design notes)."""
        count = 0
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None or chunk.pins == _STORE_PENDING:
                break
            count += 1
        return count

    # -- stores -----------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockHash], request_id: str,
                      first_block: int) -> StoreOutcome | None:
        """Make room for and reserve the chunks of ``keys`` not held yet; ``keys`` are the
        request's blocks from index ``first_block`` on."""
        chunks = self._chunks
        to_store = [key for key in keys if key not in chunks]
        positions = self._access(request_id).positions
        for index, key in enumerate(keys, first_block):
            chunk = chunks.get(key)
            # a chunk another request is still storing is not this request's access
            if chunk is None or chunk.pins != _STORE_PENDING:
                positions.setdefault(key, index)
        if not to_store:
            return StoreOutcome([], [])
        shortfall = len(to_store) - self.num_free
        evicted: list[BlockHash] = []
        if shortfall > 0:
            if shortfall > self._evictable:
                return None
            offered = set(keys)
            favoured, parked_by = self._favoured, self._parked_by
            spared: list[tuple[int, int, BlockHash]] = []
            for rank, (key, chunk) in enumerate(chunks.items()):
                if chunk.pins == 0 and key not in offered:
                    owner = parked_by.get(key) if favoured else None
                    if owner is not None and owner in favoured:
                        spared.append((favoured[owner][0], rank, key))
                        continue
                    evicted.append(key)
                    if len(evicted) == shortfall:
                        break
            if len(evicted) < shortfall:
                # favoured keys go last, the lowest priority first, each session's LRU first
                spared.sort()
                evicted += [key for _, _, key in spared[:shortfall - len(evicted)]]
            if len(evicted) < shortfall:
                return None
            for key in evicted:
                del chunks[key]
                self._unpark(key)
            self._evictable -= len(evicted)
            if self.enable_events:
                self._events.append(BlockRemoved(list(evicted), MEDIUM_CPU))
        for key in to_store:
            chunks[key] = _Chunk()
        return StoreOutcome(to_store, evicted)

    def complete_store(self, keys: Sequence[BlockHash]) -> None:
        stored = []
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None and chunk.pins == _STORE_PENDING:
                chunk.pins = 0
                self._evictable += 1
                stored.append(key)
        if stored and self.enable_events:
            self._events.append(BlockStored(stored, None, [], self.block_size, None, MEDIUM_CPU, None))

    # -- loads ------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[BlockHash], request_id: str, first_block: int) -> None:
        """Pin the chunks of ``keys`` (the request's blocks from ``first_block`` on) for a load."""
        positions = self._access(request_id).positions
        for index, key in enumerate(keys, first_block):
            chunk = self._chunks[key]
            if chunk.pins == _STORE_PENDING:
                raise ValueError(f"chunk {key!r} is not ready to load")
            if chunk.pins == 0:
                self._evictable -= 1
            chunk.pins += 1
            positions.setdefault(key, index)
            if self._favoured:
                owner = self._parked_by.get(key)
                if owner is not None:
                    self._favoured.pop(owner, None)  # it is coming back: the favour has done its work

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            chunk = self._chunks[key]
            if chunk.pins <= 0:
                raise ValueError(f"chunk {key!r} was not being loaded")
            chunk.pins -= 1
            if chunk.pins == 0:
                self._evictable += 1

    # -- Sluice's directives ----------------------------------------------------------

    def park(self, session_id: str, keys: Sequence[BlockHash]) -> int:
        """``kv.offload``: remember the held ones of ``keys`` (prefix order) as the session's
        and make them most recent; returns how many were held."""
        held = [key for key in keys if key in self._chunks]
        if not held:
            return 0
        parked = self._parked.setdefault(session_id, {})
        for key in held:
            previous = self._parked_by.get(key)
            if previous is not None and previous != session_id:
                self._unpark(key)
                parked = self._parked.setdefault(session_id, {})
            parked[key] = None
            self._parked_by[key] = session_id
        self._rerank(held)
        return len(held)

    def favour(self, session_id: str, priority: int, until: float) -> None:
        """``kv.prefetch``: the session's parked keys go after everyone else's until ``until``."""
        if session_id in self._parked:
            self._favoured[session_id] = (priority, until)

    def unfavour(self, session_id: str) -> None:
        """``kv.release``: forget the session's favour and what it parked."""
        self._favoured.pop(session_id, None)
        for key in self._parked.pop(session_id, ()):
            del self._parked_by[key]

    def expire_favours(self, now: float) -> None:
        if self._favoured:
            for session_id in [s for s, (_, until) in self._favoured.items() if until <= now]:
                del self._favoured[session_id]

    def parked_keys(self, session_id: str) -> list[BlockHash]:
        return list(self._parked.get(session_id, ()))

    def _unpark(self, key: BlockHash) -> None:
        owner = self._parked_by.pop(key, None)
        if owner is None:
            return
        parked = self._parked[owner]
        del parked[key]
        if not parked:
            del self._parked[owner]
            self._favoured.pop(owner, None)

    # -- recency ----------------------------------------------------------------------

    def touch(self, keys: Sequence[BlockHash]) -> None:
        self._rerank(keys)

    def request_finished(self, request_id: str) -> None:
        access = self._requests.pop(request_id, None)
        if access is not None:
            positions = access.positions
            self._rerank(sorted(positions, key=positions.__getitem__))

    def forget_request(self, request_id: str) -> None:
        """Drop a request's access record without re-ranking (it never reached the engine's
        end: aborted)."""
        self._requests.pop(request_id, None)

    def _rerank(self, keys: Sequence[BlockHash]) -> None:
        # tail first, so the prefix's head ends most recent (vLLM: reversed keys, new ranks)
        chunks = self._chunks
        for key in reversed(keys):
            chunk = chunks.pop(key, None)
            if chunk is not None:
                chunks[key] = chunk

    def _access(self, request_id: str) -> _RequestAccess:
        access = self._requests.get(request_id)
        if access is None:
            access = self._requests[request_id] = _RequestAccess()
        return access

    # -- events -----------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
