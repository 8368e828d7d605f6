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


class BlockStoredRaw(BlockStored, tag="BlockStored"):
    """A ``BlockStored`` as the index ingests it (``EventBatchDecoder(token_ids=False)``):
    ``token_ids`` stays the msgpack array it came as (:class:`msgspec.Raw`, unparsed), since
    the index reads only how many there are (:func:`stored_token_count`). Building the ids
    was about 40% of decoding a busy worker's batches. Encodes back to the same bytes."""

    token_ids: msgspec.Raw  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # Run by msgspec as it decodes each store (a ValueError here fails the decode): the
        # check costs the stores alone, where a pass over a batch's events cost every event.
        if raw_array_len(self.token_ids) < 0:
            raise ValueError("token_ids is no array")  # the decoder reports the full schema's


AnyKVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``; the rank is nil when there is none (msgspec
    writes every field of an array-like struct, as vLLM does); a two-element array decodes."""

    ts: float
    events: list[AnyKVEvent]
    data_parallel_rank: int | None = None


class _EventBatchRaw(EventBatch):
    """An :class:`EventBatch` with :class:`BlockStoredRaw` for its stores (decoding only)."""

    events: list[Union[BlockStoredRaw, BlockRemoved, AllBlocksCleared]]  # type: ignore[assignment]


_KNOWN_TYPES = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


class EventBatchDecoder:
    """Decodes one frame payload; keeps msgspec's compiled decoder between calls.

    An event of a type this version does not know (a newer engine's) does not fail the
    batch: the known events are kept, in order, and the unknown ones are counted by type in
    :attr:`skipped`. Failing the batch would make the subscriber reset the worker's index on
    every such batch, which loses far more than one event it cannot interpret. A known event
    that breaks its schema (a required key missing) still fails the whole batch.

    ``token_ids=False`` (the subscriber's, feeding the index): stores come as
    :class:`BlockStoredRaw`, their ids unparsed. A ``token_ids`` that is no array still fails
    the batch, with the error the full decoder gives; the ids in the array are not checked to
    be ints (that is what parsing them would cost). A batch that needs the fallback for
    unknown types comes back with plain :class:`BlockStored` events, checked in full.
    """

    def __init__(self, token_ids: bool = True) -> None:
        self._full = msgspec.msgpack.Decoder(EventBatch)
        self._raw = None if token_ids else msgspec.msgpack.Decoder(_EventBatchRaw)
        self.skipped: dict[str, int] = {}
        self.skipped_total = 0

    def decode(self, payload: bytes) -> EventBatch:
        """The batch in ``payload``; raises :class:`msgspec.DecodeError` for anything that is
        not one, nesting too deep to decode included (msgspec raises RecursionError for that,
        which callers would take for a bug of their own rather than bad input)."""
        try:
            try:
                if self._raw is None:
                    return self._full.decode(payload)
                # a ``token_ids`` that is no array fails this too (BlockStoredRaw.__post_init__)
                return self._raw.decode(payload)
            except msgspec.ValidationError as err:
                if self._raw is not None:  # the full schema's error (it fails where this one did)
                    try:
                        return self._full.decode(payload)
                    except msgspec.ValidationError as full_err:
                        err = full_err
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


def raw_array_len(raw: msgspec.Raw) -> int:
    """The length a msgpack array's header says, or -1 for anything else (``raw`` is one
    whole value, as msgspec cut it: at least one byte, the header complete)."""
    head = memoryview(raw)
    first = head[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC:
        return head[1] << 8 | head[2]
    if first == 0xDD:
        return int.from_bytes(head[1:5], "big")
    return -1


def stored_token_count(event: BlockStored) -> int:
    """How many token ids ``event`` carries (parsed or not: :class:`BlockStoredRaw`)."""
    ids = event.token_ids
    return raw_array_len(ids) if ids.__class__ is msgspec.Raw else len(ids)


def block_token_counts(event: BlockStored) -> list[int]:
    """Tokens each stored block covers, in order.

    ``token_ids`` holds the tokens of all ``block_hashes`` concatenated; the last block may
    be partial. When an engine sends no token ids, every block counts ``block_size``.
    """
    return token_counts(len(event.block_hashes), event.block_size, stored_token_count(event))


def token_counts(n_blocks: int, size: int, n_tokens: int) -> list[int]:
    """:func:`block_token_counts` from the numbers alone."""
    if n_tokens == 0 or size <= 0:
        return [max(size, 0)] * n_blocks
    if n_tokens >= n_blocks * size:
        return [size] * n_blocks  # full blocks (ids past the last block count for none)
    counts = []
    remaining = n_tokens
    for _ in range(n_blocks):
        take = min(size, remaining)
        counts.append(take)
        remaining -= take
    return counts
