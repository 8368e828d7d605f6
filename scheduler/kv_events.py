"""vLLM's KV-cache event wire format as msgspec structs (vLLM 0.32).

A ZMQ frame's payload is one msgpack array ``[ts, events, data_parallel_rank]``; each event
is a map tagged by its ``"type"`` key (the first key on the wire), fields in declaration
order, optional ones omitted when None. These structs decode what vLLM sends (unknown keys are
ignored, so newer engines still decode) and encode what the simulator publishes, so both
shells build the very same objects. ``continuation_id`` on both events and ``num_tokens`` on
``BlockRemoved`` are Sluice's own keys, added by the engine plugin; old consumers skip them.

Field names follow vllm/distributed/kv_events.py at vLLM 0.32.0.
"""

from __future__ import annotations

from typing import Union

import msgspec

# vLLM sends block hashes as ints (64-bit, after conversion) or as raw bytes.
BlockHash = Union[int, bytes]


class KVEvent(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Base of every KV-cache event."""


# ``medium`` of the host tier's events (vllm/v1/kv_offload/base.py Medium.CPU as its events
# spell it); the GPU pool's say "GPU", and events from before media existed say nothing.
MEDIUM_CPU = "CPU"


class BlockStored(KVEvent, tag="BlockStored"):
    # vLLM declares these seven without defaults and always writes them (None as nil);
    # its decoder rejects a map that lacks one, so ours must always send them too.
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    continuation_id: str | None = None


class BlockRemoved(KVEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    continuation_id: str | None = None
    num_tokens: int | None = None


class AllBlocksCleared(KVEvent, tag="AllBlocksCleared"):
    pass


AnyKVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``; the rank is nil when there is none (msgspec
    writes every field of an array-like struct, as vLLM does); a two-element array decodes."""

    ts: float
    events: list[AnyKVEvent]
    data_parallel_rank: int | None = None


_KNOWN_TYPES = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


class EventBatchDecoder:
    """Decodes one frame payload; keeps msgspec's compiled decoder between calls.

    An event of a type this version does not know (a newer engine's) does not fail the
    batch: the known events are kept, in order, and the unknown ones are counted by type in
    :attr:`skipped`. Failing the batch would make the subscriber reset the worker's index on
    every such batch, which loses far more than one event it cannot interpret. A known event
    that breaks its schema (a required key missing) still fails the whole batch.
    """

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self.skipped: dict[str, int] = {}
        self.skipped_total = 0

    def decode(self, payload: bytes) -> EventBatch:
        """The batch in ``payload``; raises :class:`msgspec.DecodeError` for anything that is
        not one, nesting too deep to decode included (msgspec raises RecursionError for that,
        which callers would take for a bug of their own rather than bad input)."""
        try:
            try:
                return self._decoder.decode(payload)
            except msgspec.ValidationError as err:
                return self._decode_skipping_unknown(payload, err)
        except RecursionError as err:
            raise msgspec.DecodeError(f"nested too deep to decode: {err}") from err

    def _decode_skipping_unknown(self, payload: bytes, err: msgspec.ValidationError) -> EventBatch:
        raw = msgspec.msgpack.decode(payload)
        if not (isinstance(raw, list) and len(raw) in (2, 3) and isinstance(raw[1], list)):
            raise err
        tags = [e.get("type") for e in raw[1] if isinstance(e, dict)]
        if any(not isinstance(tag, str) for tag in tags):
            raise err  # a tag that is no string (a list, a map: unhashable) is a bad tag
        unknown = [tag for tag in tags if tag not in _KNOWN_TYPES]
        if not unknown:
            raise err  # the failure is elsewhere (a known event breaks its schema)
        raw[1] = [e for e in raw[1] if not (isinstance(e, dict) and e.get("type") not in _KNOWN_TYPES)]
        batch = msgspec.convert(raw, EventBatch)
        for kind in unknown:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self.skipped_total += len(unknown)
        return batch


class EventBatchEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        return self._encoder.encode(batch)


def block_token_counts(event: BlockStored) -> list[int]:
    """Tokens each stored block covers, in order.

    ``token_ids`` holds the tokens of all ``block_hashes`` concatenated; the last block may
    be partial. When an engine sends no token ids, every block counts ``block_size``.
    """
    n_blocks = len(event.block_hashes)
    size = event.block_size
    n_tokens = len(event.token_ids)
    if n_tokens == 0 or size <= 0:
        return [max(size, 0)] * n_blocks
    counts = []
    remaining = n_tokens
    for _ in range(n_blocks):
        take = min(size, remaining)
        counts.append(take)
        remaining -= take
    return counts
