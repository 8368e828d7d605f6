"""Fuzz target: the KV-event frames the gateway's subscriber reads (controller/subscriber.py),
through the decoding it does: the topic of the bound-socket layout
(controller/kv_wire.py ``worker_from_topic``), the seq frame, the publisher's epoch frame,
the batch's rank peeked without its events (``RankPeek``), and the batch itself
(scheduler/kv_events.py ``EventBatchDecoder``).

Inputs: frames ``[topic, seq, payload(, epoch)]`` of any length and content, payloads of
arbitrary msgpack, batches close to vLLM's with hostile events (wrong types, unknown event
types, tags that are not strings, huge and negative numbers), nesting deeper than msgpack's
decoder can go, and bytes that are not msgpack.

Properties: each step either gives its value or rejects the frame with the error the
subscriber catches for it (``msgspec.DecodeError``, and ``RecursionError`` for the rank peek);
no other exception, which would escape into the subscriber's loop.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from controller.kv_wire import RankPeek, publisher_epoch, worker_from_topic
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventBatchDecoder
from tests.fuzz.profiles import fuzz_settings
from tests.fuzz.strategies import TEXT, weighted

WORKERS = ["w0", "w0@x", "gpu-1", "a@b@c"]
MODEL = "m@odel"

INT64 = st.integers(-(2**63), 2**64 - 1)
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), INT64, st.floats(), TEXT,
                   st.binary(max_size=16))
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(TEXT, st.integers(-3, 3)), inner, max_size=4)),
    max_leaves=20,
)
HASHES = st.one_of(INT64, st.binary(max_size=33))


HASHABLE = st.one_of(st.none(), st.booleans(), INT64, st.floats(), TEXT, st.binary(max_size=16))
UNHASHABLE = st.one_of(st.lists(TEXT, max_size=2), st.dictionaries(TEXT, TEXT, max_size=2))


@st.composite
def near_valid_events(draw: st.DrawFn) -> dict:
    """An event as vLLM (or the engine plugin) writes it, some of its fields hostile (its
    ``type`` a list or a map, now and then)."""
    def value(good, hostile=VALUES):
        return draw(hostile) if draw(st.integers(0, 5)) == 0 else good

    kind = value(draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared",
                                       "NewEngineEvent"])),
                 st.one_of(HASHABLE, UNHASHABLE))
    hashes = draw(st.lists(HASHES, max_size=4))
    fields = {"type": kind}
    if kind == "BlockStored":
        fields.update(block_hashes=value(hashes), parent_block_hash=value(draw(st.one_of(st.none(), HASHES))),
                      token_ids=value(draw(st.lists(INT64, max_size=70))),
                      block_size=value(draw(st.integers(-2, 64))), lora_id=value(None),
                      medium=value(draw(st.sampled_from([None, "GPU", "CPU"]))), lora_name=value(None),
                      session_id=value(draw(st.one_of(st.none(), TEXT))),
                      continuation_id=value(draw(st.one_of(st.none(), TEXT))))
    elif kind == "BlockRemoved":
        fields.update(block_hashes=value(hashes), medium=value(None),
                      num_tokens=value(draw(st.one_of(st.none(), INT64))))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2)):
        if draw(st.booleans()):
            fields.pop(name, None)
        else:
            fields[name] = draw(VALUES)
    return fields


@st.composite
def near_valid_batches(draw: st.DrawFn) -> list:
    events = st.lists(near_valid_events(), max_size=4)
    batch = [draw(st.one_of(st.floats(), INT64, VALUES)), draw(weighted((4, events), (1, VALUES)))]
    if draw(st.booleans()):
        batch.append(draw(st.one_of(st.none(), INT64, VALUES)))
    if draw(st.integers(0, 6)) == 0:
        batch.append(draw(VALUES))  # a fourth element: a batch vLLM never sends
    return batch


def _deep_msgpack(depth: int) -> bytes:
    return b"\x93\xcb" + b"\x00" * 8 + b"\x91" * depth + b"\xc0" + b"\xc0"  # [ts, [[[...]]], nil]


def payloads() -> st.SearchStrategy[bytes]:
    batches = near_valid_batches().map(msgspec.msgpack.encode)
    return weighted(
        (6, batches),
        (2, VALUES.map(msgspec.msgpack.encode)),
        (1, st.binary(max_size=200)),
        (1, st.sampled_from([10, 999, 1_001, 5_000, 100_000]).map(_deep_msgpack)),
        # a batch cut short, or with bytes after it
        (1, st.tuples(batches, st.integers(0, 300), st.binary(max_size=6)).map(
            lambda t: t[0][:t[1]] + t[2])),
    )


PAYLOADS = payloads()
TOPICS = weighted(
    (3, st.sampled_from(WORKERS).map(lambda w: f"kv@{w}@{MODEL}".encode())),
    (1, st.sampled_from(WORKERS).map(lambda w: f"kv@{w}".encode())),
    (2, st.binary(max_size=40)),
    (1, TEXT.map(lambda t: ("kv@" + t).encode("utf-8", "surrogatepass"))),
)
SEQS = weighted((8, st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "big"))),
                (1, st.binary(max_size=12)))


@st.composite
def frame_lists(draw: st.DrawFn) -> list[bytes]:
    frames = [draw(TOPICS), draw(SEQS), draw(PAYLOADS)]
    extra = draw(st.lists(st.binary(max_size=16), max_size=2))  # an epoch, and more
    if draw(st.sampled_from([False] * 7 + [True])):  # too few frames, now and then
        return (frames + extra)[:draw(st.integers(0, 2))]
    return frames + extra


PEEK = msgspec.msgpack.Decoder(RankPeek)


@fuzz_settings(short_examples=300)
@given(frames=frame_lists())
def test_the_frame_reader_gives_a_worker_a_seq_an_epoch_and_a_rank_or_rejects(frames):
    """The subscriber's steps before it queues a batch (``_read_bound`` and ``_accept``)."""
    name = worker_from_topic(frames[0], WORKERS) if frames else None
    if frames:
        # the longest worker name the topic's "kv@<worker>[@<model>]" fits, names and models
        # both holding "@"; none for a topic that is not UTF-8 or not kv@
        try:
            text = frames[0].decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        rest = text[3:] if text.startswith("kv@") else None
        fits = [w for w in WORKERS if rest is not None and (rest == w or rest.startswith(w + "@"))]
        assert name == (max(fits, key=len) if fits else None), (frames[0], name, fits)
    if len(frames) < 3 or len(frames[1]) != 8:
        event("malformed frames")
        return
    assert 0 <= int.from_bytes(frames[1], "big") < 2**64
    epoch = publisher_epoch(frames)
    assert epoch is None or (epoch == frames[3] and epoch)
    try:
        rank = PEEK.decode(frames[2]).data_parallel_rank
    except (msgspec.DecodeError, RecursionError):
        event("rank: undecodable")
        return
    event("rank peeked")
    assert rank is None or isinstance(rank, int)


def check_batch_decoder(payload: bytes) -> None:
    decoder = EventBatchDecoder()
    try:
        batch = decoder.decode(payload)
    except msgspec.DecodeError:
        event("rejected")
        return
    event("decoded")
    assert isinstance(batch, EventBatch)
    assert all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in batch.events)


@fuzz_settings(short_examples=300)
@given(payload=PAYLOADS)
def test_the_batch_decoder_gives_known_events_or_a_decode_error(payload):
    check_batch_decoder(payload)


# Found by the target above: an event whose "type" was a list or a map (unhashable) made the
# decoder's fallback for unknown event types raise TypeError instead of DecodeError, which the
# subscriber did not catch (its applier loop failed and was restarted).
@pytest.mark.parametrize("tag", [[1], {"a": 1}], ids=["list", "map"])
def test_an_event_tagged_with_an_unhashable_type_is_a_decode_error(tag):
    payload = msgspec.msgpack.encode([0.0, [{"type": tag}]])
    with pytest.raises(msgspec.DecodeError):
        EventBatchDecoder().decode(payload)
