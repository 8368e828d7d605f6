"""Wire conformance: payloads produced by vLLM 0.32's own structs and encoder decode with the
core's structs (``scheduler.kv_events``), unknown keys included.

The fixtures under tests/fixtures/vllm_wire were written by
``.venv-vllm/bin/python scripts/gen_vllm_wire_fixtures.py`` (see its docstring) and are
committed, so this test needs no vLLM. ``expected.json`` holds what each payload carries in
vLLM's terms; tests/e2e checks the fixtures are still what vLLM writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventBatchDecoder,
    EventBatchEncoder,
)
from scheduler.kv_index import KVIndex

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_wire"
MANIFEST = json.loads((FIXTURES / "expected.json").read_text())
ENTRIES: dict[str, dict] = MANIFEST["fixtures"]
CORE = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
# Keys the core adds for the Sluice engine plugin; vLLM never sends them.
SLUICE_ONLY = {"BlockStored": {"continuation_id"}, "BlockRemoved": {"continuation_id", "num_tokens"},
               "AllBlocksCleared": set()}


def payload(name: str) -> bytes:
    return (FIXTURES / f"{name}.bin").read_bytes()


def plain(value: Any) -> Any:
    """The JSON form expected.json uses: bytes as {"hex"}, tuples as lists."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def test_manifest_covers_every_fixture():
    assert sorted(p.stem for p in FIXTURES.glob("*.bin")) == sorted(ENTRIES)
    assert MANIFEST["vllm"].startswith("0.32")
    # The core declares every field vLLM declares, in vLLM's order (then its own).
    for kind, fields in MANIFEST["vllm_fields"].items():
        core_fields = CORE[kind].__struct_fields__
        assert core_fields[:len(fields)] == tuple(fields), kind
        assert set(core_fields[len(fields):]) == SLUICE_ONLY[kind], kind


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_decodes_with_core_structs(name):
    want = ENTRIES[name]
    batch = EventBatchDecoder().decode(payload(name))
    assert isinstance(batch, EventBatch)
    assert batch.ts == want["ts"]
    assert batch.data_parallel_rank == want["data_parallel_rank"]
    assert len(batch.events) == len(want["events"])
    for got, expected in zip(batch.events, want["events"]):
        kind = expected["type"]
        assert type(got) is CORE[kind]
        for field in MANIFEST["vllm_fields"][kind]:
            assert plain(getattr(got, field)) == expected[field], f"{name}: {kind}.{field}"
        for field in SLUICE_ONLY[kind]:
            assert getattr(got, field) is None, f"{name}: {kind}.{field}"


def _ordered(value: Any) -> Any:
    """Untyped msgpack with map key order kept (as lists of pairs)."""
    if isinstance(value, dict):
        return [(k, _ordered(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


@pytest.mark.parametrize("name", sorted(n for n, e in ENTRIES.items() if e["reencode_identical"]))
def test_core_encoder_writes_what_vllm_writes(name):
    """What the core encodes (the simulator publishes this way) is what vLLM's encoder
    wrote: the same msgpack values, keys in the same order, the same omissions. (Not always
    the same bytes: the core's BlockStored has one more optional field, which pushes
    msgspec to a map16 header where vLLM's fits a fixmap; both are valid msgpack.)"""
    raw = payload(name)
    ours = EventBatchEncoder().encode(EventBatchDecoder().decode(raw))
    assert _ordered(msgspec.msgpack.decode(ours)) == _ordered(msgspec.msgpack.decode(raw))


@pytest.mark.parametrize("name", sorted(n for n in ENTRIES if n.startswith("unknown_keys")))
def test_unknown_keys_are_on_the_wire_and_ignored(name):
    want = ENTRIES[name]
    raw = msgspec.msgpack.decode(payload(name))
    on_wire = {key for event in raw[1] for key in event}
    assert set(want["unknown_keys"]) <= on_wire  # the fixture really carries them
    assert len(raw) == 3 + want.get("extra_batch_elements", 0)
    batch = EventBatchDecoder().decode(payload(name))
    for event in batch.events:
        for key in want["unknown_keys"]:
            assert not hasattr(event, key)


def test_publisher_frames_are_numbered_and_topiced():
    frames = sorted((e["seq"], e["topic"]) for e in ENTRIES.values() if "seq" in e)
    assert [seq for seq, _ in frames] == list(range(len(frames)))
    assert {topic for _, topic in frames} == {"kv@w0@tiny"}


def test_publisher_frames_drive_the_index():
    """vLLM's BlockPool story, through the index: sess-A stores two blocks, sess-B reuses
    them (a full-mode hit report) and adds one, everything is evicted, then cleared."""
    index = KVIndex()
    decoder = EventBatchDecoder()
    seqs = sorted((e["seq"], n) for n, e in ENTRIES.items() if "seq" in e)
    batches = [decoder.decode(payload(n)) for _, n in seqs]
    stored = batches[0].events[0]
    bs = stored.block_size
    index.apply_batch("w0", batches[0])
    kv = index.worker("w0")
    assert kv.session_tokens == {"sess-A": 2 * bs}
    assert kv.prefix_tokens(stored.block_hashes) == 2 * bs
    index.apply_batch("w0", batches[1])
    assert kv.session_tokens == {"sess-A": 2 * bs, "sess-B": 3 * bs}
    third = batches[1].events[1]
    assert third.parent_block_hash == stored.block_hashes[-1]
    assert kv.prefix_tokens([*stored.block_hashes, *third.block_hashes]) == 3 * bs
    index.apply_batch("w0", batches[2])
    assert kv.blocks == {} and kv.session_tokens == {} and kv.unknown_removals == 0
    index.apply_batch("w0", batches[3])
    assert kv.blocks == {} and kv.events_seen == sum(len(b.events) for b in batches)
