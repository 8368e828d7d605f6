"""vLLM 0.32 KV-event wire format: decode hand-built frames, encode frames vLLM would accept.

The fixtures are built by hand from plain dicts and lists in the layout vLLM 0.32 publishes
(``vllm/distributed/kv_events.py``): one msgpack array ``[ts, events, data_parallel_rank]``,
each event a map whose first key is ``"type"`` (the struct's class name), then its fields in
declaration order; fields without a default are always written, ``None`` as nil; fields with
a ``None`` default are left out when ``None``.
"""

from __future__ import annotations

import msgspec
import pytest

from scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventBatchDecoder,
    EventBatchEncoder,
    block_token_counts,
)

# vLLM 0.32 declares these without defaults: its decoder rejects a map that lacks one.
VLLM_REQUIRED = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

SHA = bytes(range(32))  # a 32-byte sha256-style block hash
SHA2 = bytes(range(32, 64))

STORED_ALL_KEYS = {
    "type": "BlockStored",
    "block_hashes": [SHA, SHA2],
    "parent_block_hash": bytes(32),
    "token_ids": list(range(100, 132)),
    "block_size": 16,
    "lora_id": 7,
    "medium": "GPU",
    "lora_name": "adapter-a",
    "extra_keys": [["adapter-a", ["mm-img-1", 0], "salt-x"], None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "LOCAL",
    "ownership": "offload-tier-1",
    "session_id": "sess-42",
}

STORED_REQUIRED_ONLY = {
    "type": "BlockStored",
    "block_hashes": [11, 12, 13],
    "parent_block_hash": None,
    "token_ids": list(range(40)),
    "block_size": 16,
    "lora_id": None,
    "medium": None,
    "lora_name": None,
}

REMOVED = {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "GPU"}
REMOVED_OPTIONALS = {"type": "BlockRemoved", "block_hashes": [SHA], "medium": None,
                     "group_idx": 0, "locality": "REMOTE", "ownership": "cpu"}
CLEARED = {"type": "AllBlocksCleared"}


def frame(events: list, ts: float = 1_700_000_000.25, rank=None, with_rank: bool = True) -> bytes:
    batch = [ts, events, rank] if with_rank else [ts, events]
    return msgspec.msgpack.encode(batch)


def decode(payload: bytes) -> EventBatch:
    return EventBatchDecoder().decode(payload)


# -- decoding what vLLM sends ------------------------------------------------------------


def test_decodes_a_block_stored_with_every_required_and_optional_key():
    batch = decode(frame([STORED_ALL_KEYS], rank=2))
    assert batch.ts == 1_700_000_000.25
    assert batch.data_parallel_rank == 2
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [SHA, SHA2]
    assert ev.parent_block_hash == bytes(32)
    assert ev.token_ids == list(range(100, 132))
    assert ev.block_size == 16
    assert ev.lora_id == 7
    assert ev.medium == "GPU"
    assert ev.lora_name == "adapter-a"
    assert ev.extra_keys == [["adapter-a", ["mm-img-1", 0], "salt-x"], None]
    assert ev.group_idx == 1
    assert ev.kv_cache_spec_kind == "sliding_window"
    assert ev.kv_cache_spec_sliding_window == 4096
    assert ev.locality == "LOCAL"
    assert ev.ownership == "offload-tier-1"
    assert ev.session_id == "sess-42"
    assert ev.continuation_id is None


def test_decodes_a_block_stored_with_only_the_required_keys_and_nil_values():
    (ev,) = decode(frame([STORED_REQUIRED_ONLY])).events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [11, 12, 13]
    assert ev.parent_block_hash is None
    assert ev.lora_id is None and ev.medium is None and ev.lora_name is None
    assert ev.extra_keys is None and ev.group_idx is None and ev.session_id is None


def test_decodes_block_removed_and_all_blocks_cleared_in_order():
    events = decode(frame([STORED_REQUIRED_ONLY, REMOVED, REMOVED_OPTIONALS, CLEARED])).events
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockRemoved, AllBlocksCleared]
    assert events[1].block_hashes == [11, 12] and events[1].medium == "GPU"
    assert events[2].block_hashes == [SHA]
    assert (events[2].group_idx, events[2].locality, events[2].ownership) == (0, "REMOTE", "cpu")
    assert events[1].num_tokens is None and events[1].continuation_id is None


@pytest.mark.parametrize(
    "hashes",
    [
        [0, 1, 2**63 - 1],
        [2**64 - 1],  # unsigned 64-bit
        [-(2**63), -1],  # signed 64-bit
        [SHA, b"\x00", b""],
        [5, SHA, 6],  # mixed within one event
    ],
    ids=["int", "uint64-max", "negative", "bytes", "mixed"],
)
def test_block_hashes_decode_as_ints_or_bytes_unchanged(hashes):
    stored = dict(STORED_REQUIRED_ONLY, block_hashes=hashes, parent_block_hash=hashes[0],
                  token_ids=[])
    removed = dict(REMOVED, block_hashes=hashes)
    ev_s, ev_r = decode(frame([stored, removed])).events
    assert ev_s.block_hashes == hashes
    assert ev_s.parent_block_hash == hashes[0]
    assert type(ev_s.parent_block_hash) is type(hashes[0])
    assert ev_r.block_hashes == hashes
    assert [type(h) for h in ev_r.block_hashes] == [type(h) for h in hashes]


def test_unknown_extra_keys_are_ignored():
    stored = dict(STORED_REQUIRED_ONLY, future_field={"nested": [1, 2]}, another=7)
    removed = dict(REMOVED, tier_hint="ssd")
    cleared = dict(CLEARED, reason="reset")
    plain = decode(frame([STORED_REQUIRED_ONLY, REMOVED, CLEARED]))
    extra = decode(frame([stored, removed, cleared]))
    assert extra == plain


def test_batch_without_dp_rank_decodes_with_rank_none():
    batch = decode(frame([REMOVED], with_rank=False))
    assert batch.data_parallel_rank is None
    assert len(batch.events) == 1
    assert decode(frame([REMOVED], rank=None)) == batch


def test_empty_event_list_decodes():
    batch = decode(frame([], rank=0))
    assert batch.events == [] and batch.data_parallel_rank == 0


def test_sluice_keys_decode_from_plugin_labelled_events():
    stored = dict(STORED_REQUIRED_ONLY, session_id="s", continuation_id="ab" * 16)
    removed = dict(REMOVED, continuation_id="cd" * 16, num_tokens=32)
    ev_s, ev_r = decode(frame([stored, removed])).events
    assert ev_s.continuation_id == "ab" * 16
    assert ev_r.continuation_id == "cd" * 16 and ev_r.num_tokens == 32


def test_a_map_missing_a_vllm_required_key_is_rejected():
    broken = {k: v for k, v in STORED_REQUIRED_ONLY.items() if k != "block_hashes"}
    with pytest.raises(msgspec.ValidationError):
        decode(frame([broken]))


def test_an_unknown_event_type_is_skipped_and_counted_and_the_known_ones_kept_in_order():
    decoder = EventBatchDecoder()
    future = {"type": "BlockMovedToTier", "block_hashes": [11], "tier": "cpu"}
    batch = decoder.decode(frame([STORED_REQUIRED_ONLY, future, REMOVED, future, CLEARED], rank=2))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events == decode(frame([STORED_REQUIRED_ONLY, REMOVED, CLEARED])).events
    assert batch.data_parallel_rank == 2
    assert decoder.skipped == {"BlockMovedToTier": 2}


def test_a_known_event_breaking_its_schema_fails_the_batch_even_beside_an_unknown_type():
    broken = {k: v for k, v in REMOVED.items() if k != "block_hashes"}
    decoder = EventBatchDecoder()
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(frame([{"type": "SomethingNew"}, broken]))
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(frame([{"no_type": 1}]))
    assert decoder.skipped == {}


def test_decoder_is_reusable_across_frames():
    decoder = EventBatchDecoder()
    a = decoder.decode(frame([REMOVED]))
    b = decoder.decode(frame([CLEARED], ts=2.0))
    assert isinstance(a.events[0], BlockRemoved)
    assert isinstance(b.events[0], AllBlocksCleared) and b.ts == 2.0


# -- encoding what the simulator publishes -----------------------------------------------


def _events_from(dicts: list[dict]) -> list:
    return decode(frame(dicts)).events


@pytest.mark.parametrize(
    "fixture",
    [STORED_ALL_KEYS, STORED_REQUIRED_ONLY, REMOVED, REMOVED_OPTIONALS, CLEARED],
    ids=["stored-all", "stored-required", "removed", "removed-optionals", "cleared"],
)
def test_encoder_output_has_exactly_the_hand_built_vllm_layout(fixture):
    batch = EventBatch(ts=12.5, events=_events_from([fixture]), data_parallel_rank=1)
    payload = EventBatchEncoder().encode(batch)
    plain = msgspec.msgpack.decode(payload)
    assert isinstance(plain, list)
    assert plain == [12.5, [fixture], 1]
    (event_map,) = plain[1]
    assert isinstance(event_map, dict)
    assert next(iter(event_map)) == "type"
    for key in VLLM_REQUIRED[fixture["type"]]:
        assert key in event_map, f"{fixture['type']} lacks vLLM-required key {key!r}"


def test_encoder_writes_vllm_required_keys_even_when_they_hold_defaults():
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=0,
                     lora_id=None, medium=None, lora_name=None)
    rm = BlockRemoved(block_hashes=[1], medium=None)
    plain = msgspec.msgpack.decode(EventBatchEncoder().encode(EventBatch(0.0, [ev, rm])))
    stored_map, removed_map = plain[1]
    assert stored_map == {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [], "block_size": 0, "lora_id": None, "medium": None,
                          "lora_name": None}
    assert removed_map == {"type": "BlockRemoved", "block_hashes": [1], "medium": None}


def test_encoder_batch_without_rank_is_a_three_element_array_with_nil_rank_as_vllm_sends():
    batch = EventBatch(ts=3.0, events=[AllBlocksCleared()])
    plain = msgspec.msgpack.decode(EventBatchEncoder().encode(batch))
    assert plain == [3.0, [{"type": "AllBlocksCleared"}], None]


def test_encoder_output_decodes_back_to_equal_structs():
    events = _events_from([STORED_ALL_KEYS, STORED_REQUIRED_ONLY, REMOVED, REMOVED_OPTIONALS,
                           CLEARED])
    events.append(BlockStored(block_hashes=[SHA], parent_block_hash=99, token_ids=[1, 2, 3],
                              block_size=2, lora_id=None, medium="GPU", lora_name=None,
                              session_id="s", continuation_id="c" * 32))
    events.append(BlockRemoved(block_hashes=[2**64 - 1, SHA], medium="GPU",
                               continuation_id="c" * 32, num_tokens=3))
    for rank in (None, 0, 5):
        batch = EventBatch(ts=99.75, events=events, data_parallel_rank=rank)
        again = EventBatchDecoder().decode(EventBatchEncoder().encode(batch))
        assert again == batch
        assert [type(e) for e in again.events] == [type(e) for e in events]


def test_encoded_sluice_keys_sit_beside_vllm_keys():
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5], block_size=16,
                     lora_id=None, medium=None, lora_name=None, session_id="s",
                     continuation_id="c" * 32)
    rm = BlockRemoved(block_hashes=[1], medium="GPU", continuation_id="c" * 32, num_tokens=1)
    stored_map, removed_map = msgspec.msgpack.decode(
        EventBatchEncoder().encode(EventBatch(1.0, [ev, rm])))[1]
    assert stored_map["session_id"] == "s" and stored_map["continuation_id"] == "c" * 32
    assert removed_map["continuation_id"] == "c" * 32 and removed_map["num_tokens"] == 1
    assert next(iter(stored_map)) == "type" and next(iter(removed_map)) == "type"


# -- tokens per block ----------------------------------------------------------------------


def stored(n_blocks: int, n_tokens: int, block_size: int) -> BlockStored:
    return BlockStored(block_hashes=list(range(n_blocks)), parent_block_hash=None,
                       token_ids=list(range(n_tokens)), block_size=block_size, lora_id=None,
                       medium=None, lora_name=None)


def test_block_token_counts_full_blocks():
    assert block_token_counts(stored(3, 48, 16)) == [16, 16, 16]


def test_block_token_counts_partial_last_block():
    assert block_token_counts(stored(3, 40, 16)) == [16, 16, 8]
    assert block_token_counts(stored(1, 5, 16)) == [5]


def test_block_token_counts_without_token_ids_counts_block_size_per_block():
    assert block_token_counts(stored(4, 0, 16)) == [16, 16, 16, 16]


def test_block_token_counts_sum_to_the_tokens_sent():
    for n_tokens in range(1, 65):
        n_blocks = -(-n_tokens // 16)
        counts = block_token_counts(stored(n_blocks, n_tokens, 16))
        assert sum(counts) == n_tokens
        assert len(counts) == n_blocks
        assert all(0 < c <= 16 for c in counts)


def test_block_token_counts_of_no_blocks_is_empty():
    assert block_token_counts(stored(0, 0, 16)) == []
