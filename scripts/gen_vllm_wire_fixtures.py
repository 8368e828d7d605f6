#!/usr/bin/env python3
"""Write KV-event wire fixtures with vLLM's own structs and encoder.

    .venv-vllm/bin/python scripts/gen_vllm_wire_fixtures.py [OUT_DIR]   # default tests/fixtures/vllm_wire
    .venv-vllm/bin/python scripts/gen_vllm_wire_fixtures.py --check [OUT_DIR]

Every ``*.bin`` is one ZMQ payload frame (a msgpack ``[ts, events, data_parallel_rank]``)
exactly as vLLM 0.32 puts it on the wire; ``expected.json`` holds, per file, the values a
decoder must recover (bytes as ``{"hex": ...}``, tuples as lists) and, for the frames that
went through vLLM's :class:`ZmqEventPublisher`, their topic and sequence number.

Sources:

- ``publisher_*``: events made by a real :class:`vllm.v1.core.block_pool.BlockPool` (stores
  with session ids, a prefix-hit report, evictions, a reset) and published through a real
  ``ZmqEventPublisher``; the frames are read back from its replay socket.
- ``all_fields_bytes_hashes``, ``required_only_no_rank``: hand-built vLLM structs covering
  every optional field, 32-byte hashes, and the minimal form.
- ``unknown_keys_subclass``: subclasses of vLLM's structs add fields that no Sluice struct
  has (an extra batch element too), as a newer engine or plugin would.
- ``unknown_keys_edited``: a publisher frame decoded to plain msgpack, unknown keys of every
  msgpack kind added to each event map (at the end and between known fields), re-encoded.

Deterministic: fixed timestamps, sha256 block hashes with vLLM's default seed
(``PYTHONHASHSEED`` is ignored here), so a re-run writes the same bytes; ``--check``
regenerates into a temporary directory and fails if anything differs from OUT_DIR.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# vLLM derives NONE_HASH from PYTHONHASHSEED when it is set; fixtures must not depend on it.
os.environ.pop("PYTHONHASHSEED", None)

import msgspec  # noqa: E402
import zmq  # noqa: E402

import vllm  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "vllm_wire"
TOPIC = "kv@w0@tiny"
BLOCK_SIZE = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# vLLM's field names, in declaration order: what a decoder must recover for each event.
FIELDS = {name: cls.__struct_fields__ for name, cls in
          (("BlockStored", BlockStored), ("BlockRemoved", BlockRemoved),
           ("AllBlocksCleared", AllBlocksCleared))}


# -- expected values as JSON ----------------------------------------------------------------

def plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def expected_event(event: Any) -> dict:
    """The vLLM-known fields of ``event`` (of its base vLLM class, even for subclasses)."""
    kind = next(name for name, cls in (("BlockStored", BlockStored), ("BlockRemoved", BlockRemoved),
                                       ("AllBlocksCleared", AllBlocksCleared)) if isinstance(event, cls))
    out = {"type": kind}
    for field in FIELDS[kind]:
        out[field] = plain(getattr(event, field))
    return out


def expected_batch(batch: Any) -> dict:
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [expected_event(e) for e in batch.events]}


# -- sources ----------------------------------------------------------------------------------

def blockpool_batches() -> list[KVEventBatch]:
    """Events a real BlockPool emits: two sessions store and reuse a prefix, blocks are
    evicted, the cache is reset."""
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256)

    def request(rid: str, tokens: list[int], session: str | None) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher,
                       session_id=session)

    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BLOCK_SIZE,
                     enable_kv_cache_events=True)
    batches = []
    r1 = request("r1", list(range(10)), "sess-A")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(r1, blocks, num_cached_blocks=0, num_full_blocks=2,
                           block_size=BLOCK_SIZE, kv_cache_group_id=0)
    batches.append(KVEventBatch(ts=1700000000.25, events=pool.take_events()))
    # r2 shares r1's two full blocks: "full" report mode re-announces them under sess-B;
    # then r2 stores a third block of its own after the shared prefix.
    r2 = request("r2", list(range(8)) + [99, 98, 97, 96, 95], "sess-B")
    pool.touch(blocks[:2])
    pool.emit_cached_block_events(r2, num_cached_blocks=2, block_size=BLOCK_SIZE, kv_cache_group_id=0)
    extra = pool.get_new_blocks(1)
    pool.cache_full_blocks(r2, blocks[:2] + extra, num_cached_blocks=2, num_full_blocks=3,
                           block_size=BLOCK_SIZE, kv_cache_group_id=0)
    batches.append(KVEventBatch(ts=1700000000.5, events=pool.take_events()))
    pool.free_blocks(reversed(blocks[:2] + extra))
    pool.free_blocks(reversed(blocks))
    got = pool.get_new_blocks(5)  # reuses every free block: evicts all cached ones
    batches.append(KVEventBatch(ts=1700000001.0, events=pool.take_events()))
    pool.free_blocks(got)
    assert pool.reset_prefix_cache()
    batches.append(KVEventBatch(ts=1700000002.0, events=pool.take_events()))
    for batch in batches:
        assert batch.events, "BlockPool emitted no events"
    return batches


def publish(batches: list[KVEventBatch], workdir: Path) -> list[tuple[str, int, bytes]]:
    """Send ``batches`` through vLLM's ZmqEventPublisher; return ``(topic, seq, payload)``
    of every frame, read back from its replay socket."""
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{workdir}/pub",
                            replay_endpoint=f"ipc://{workdir}/replay", topic=TOPIC)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        for batch in batches:
            pub.publish(batch)
        dealer.connect(f"ipc://{workdir}/replay")
        frames: list[tuple[str, int, bytes]] = []
        deadline = time.monotonic() + 20
        while len(frames) < len(batches):  # the publisher thread may still be sending
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay gave {len(frames)} of {len(batches)} frames")
            dealer.send_multipart([b"", len(frames).to_bytes(8, "big")])
            while True:
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    break
                frames.append((topic.decode(), int.from_bytes(seq, "big"), payload))
            time.sleep(0.05)
        return frames
    finally:
        dealer.close()
        ctx.term()
        pub.shutdown()


class BlockStoredNext(BlockStored, tag="BlockStored"):
    """A BlockStored from a future engine: fields no Sluice struct knows."""

    priority_class: str | None = None
    tier_hints: list[int] | None = None
    origin: dict[str, Any] | None = None


class BlockRemovedNext(BlockRemoved, tag="BlockRemoved"):
    reason: str | None = None
    evicted_at_step: int | None = None


class KVEventBatchNext(KVEventBatch):
    """A batch with a trailing element (a publisher epoch) after ``data_parallel_rank``."""

    publisher_epoch: int | None = None


def hand_built() -> dict[str, KVEventBatch]:
    h = [bytes([i]) * 32 for i in (1, 2, 3)]
    all_fields = KVEventBatch(ts=1700000100.125, data_parallel_rank=3, events=[
        BlockStored(block_hashes=h[1:], parent_block_hash=h[0], token_ids=list(range(100, 107)),
                    block_size=4, lora_id=7, medium="CPU", lora_name="adapter-a",
                    extra_keys=[("adapter-a", ("mm-img-1", 0), "salt-x"), None], group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096,
                    locality="REMOTE", ownership="offload-tier-1", session_id="sess-ü"),
        BlockRemoved(block_hashes=[h[2]], medium="CPU", group_idx=1, locality="LOCAL",
                     ownership="offload-tier-1"),
        AllBlocksCleared(),
    ])
    required_only = KVEventBatch(ts=1700000200.0, data_parallel_rank=None, events=[
        BlockStored(block_hashes=[11, 12, 2**64 - 1], parent_block_hash=None,
                    token_ids=list(range(12)), block_size=4, lora_id=None, medium=None,
                    lora_name=None),
        BlockRemoved(block_hashes=[11], medium=None),
    ])
    unknown = KVEventBatchNext(ts=1700000300.5, data_parallel_rank=0, publisher_epoch=42, events=[
        BlockStoredNext(block_hashes=[21, 22], parent_block_hash=20, token_ids=list(range(8)),
                        block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                        session_id="sess-next", priority_class="retain",
                        tier_hints=[1, 2], origin={"plugin": "x", "v": 2}),
        BlockRemovedNext(block_hashes=[21], medium="GPU", group_idx=0, reason="lru",
                         evicted_at_step=17),
        AllBlocksCleared(),
    ])
    return {"all_fields_bytes_hashes": all_fields, "required_only_no_rank": required_only,
            "unknown_keys_subclass": unknown}


def edited(payload: bytes) -> tuple[bytes, dict]:
    """Add unknown keys of every msgpack kind to each event map of ``payload``."""
    raw = msgspec.msgpack.decode(payload)
    unknown = {"x_future_int": -5, "x_future_str": "hello", "x_future_bin": b"\x00\xff",
               "x_future_map": {"nested": [1, {"deep": None}]}, "x_future_float": 1.5,
               "x_future_bool": True, "x_future_nil": None, "x_future_arr": [[], {}]}
    events = []
    for event in raw[1]:
        keys = list(event)
        # one unknown key right after "type", the rest at the end
        out = {keys[0]: event[keys[0]], "x_between": {"a": 1}}
        out.update({k: event[k] for k in keys[1:]})
        out.update(unknown)
        events.append(out)
    raw[1] = events
    return msgspec.msgpack.encode(raw), {"unknown_keys": ["x_between", *unknown]}


# -- writing ----------------------------------------------------------------------------------

def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    encode = msgspec.msgpack.Encoder().encode  # what ZmqEventPublisher uses
    entries: dict[str, dict] = {}

    batches = blockpool_batches()
    with tempfile.TemporaryDirectory(prefix="sluice-wire-") as tmp:
        frames = publish(batches, Path(tmp))
    for (topic, seq, payload), batch in zip(frames, batches):
        name = f"publisher_seq{seq}"
        assert payload == encode(batch), "publisher bytes differ from msgspec's encoder"
        (out / f"{name}.bin").write_bytes(payload)
        entries[name] = {"source": "BlockPool events through ZmqEventPublisher (replayed)",
                         "topic": topic, "seq": seq, "reencode_identical": True,
                         **expected_batch(batch)}

    for name, batch in hand_built().items():
        (out / f"{name}.bin").write_bytes(encode(batch))
        subclass = name.startswith("unknown")
        entries[name] = {"source": "vLLM structs built by hand, msgspec encoder",
                         "reencode_identical": not subclass, **expected_batch(batch)}
        if subclass:
            entries[name]["unknown_keys"] = ["priority_class", "tier_hints", "origin", "reason",
                                             "evicted_at_step"]
            entries[name]["extra_batch_elements"] = 1

    first = frames[0][2]
    payload, notes = edited(first)
    (out / "unknown_keys_edited.bin").write_bytes(payload)
    entries["unknown_keys_edited"] = {"source": "publisher_seq0 with unknown keys added to each event map",
                                      "reencode_identical": False, **notes,
                                      **expected_batch(batches[0])}

    manifest = {
        "generated_by": "scripts/gen_vllm_wire_fixtures.py",
        "vllm": vllm.__version__,
        "msgspec": msgspec.__version__,
        "vllm_fields": {k: list(v) for k, v in FIELDS.items()},
        "fixtures": entries,
    }
    (out / "expected.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_OUT))
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temp dir and compare with OUT_DIR")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if not args.check:
        generate(out)
        print(f"wrote {len(list(out.glob('*.bin')))} fixtures to {out}")
        return 0
    with tempfile.TemporaryDirectory(prefix="sluice-wire-check-") as tmp:
        generate(Path(tmp))
        names = sorted(p.name for p in Path(tmp).iterdir())
        have = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        _, mismatch, errors = filecmp.cmpfiles(tmp, out, names, shallow=False)
        problems = mismatch + errors + sorted(set(have) - set(names))
        if problems:
            print(f"fixtures in {out} are stale or missing: {problems}", file=sys.stderr)
            return 1
    print(f"fixtures in {out} are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
