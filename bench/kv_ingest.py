"""KV-event ingest: msgpack decode + KV index update, single-threaded.

Builds a stream of vLLM-0.32-shaped event batches for a few workers whose block pools are
full (the steady state of a busy fleet), encodes them up front with
:class:`EventBatchEncoder`, then times only ``EventBatchDecoder.decode`` (``token_ids=False``,
as the gateway's subscriber decodes for the index) + ``KVIndex.apply_batch`` over the whole
stream on a fresh index. Reported: block hashes
carried per second (stored and removed hashes both count, as ``apply_batch`` counts them).

Stream shape (per batch = one engine step of one worker, 10–50 events):
- ``BlockStored`` of 1–32 blocks, ``block_size`` 16 and the blocks' ``token_ids``,
  64-bit int hashes chained to the request's previous block by ``parent_block_hash``,
  labelled with ``session_id`` (and ``continuation_id``, as the engine plugin sends it).
  Half are decode steps (1 block), half prefill chunks (2–32 blocks); one in ten re-reports
  an already-resident prefix from block 0 (``kv_cache_report_mode: "full"`` hits).
- ``BlockRemoved`` of one hash each (vLLM 0.32 sends one per evicted block), oldest first,
  as many as it takes to keep the pool at its capacity — so about as many hashes are
  removed as stored.
"""

from __future__ import annotations

import random
import time
from collections import deque

from bench.common import progress, result
from scheduler.kv_events import BlockRemoved, BlockStored, EventBatch, EventBatchDecoder, EventBatchEncoder
from scheduler.kv_index import KVIndex

BLOCK_SIZE = 16
VOCAB = 151_936


class _Stream:
    """One worker's engine: sequences growing block by block, a full pool evicting FIFO."""

    def __init__(self, rng: random.Random, worker: int, pool_blocks: int, sessions: int) -> None:
        self.rng = rng
        self.worker = worker
        self.pool_blocks = pool_blocks
        self.resident: deque[int] = deque()
        self.resident_set: set[int] = set()
        self.sessions = [f"w{worker}-sess-{i:05d}" for i in range(sessions)]
        self.chains: dict[str, list[int]] = {s: [] for s in self.sessions}
        self.next_hash = (worker + 1) << 40
        self.step = 0

    def _new_hash(self) -> int:
        self.next_hash += 1
        # spread over the 64-bit range, as vLLM's truncated sha256 hashes are
        return (self.next_hash * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)

    def _stored(self, session: str) -> BlockStored:
        rng = self.rng
        chain = self.chains[session]
        if chain and rng.random() < 0.1:
            # a prefix-cache hit re-reported from block 0 (hashes still resident)
            live = [h for h in chain[:32] if h in self.resident_set]
            if live and live == chain[: len(live)]:
                n = len(live)
                return BlockStored(
                    block_hashes=live, parent_block_hash=None,
                    token_ids=[rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)],
                    block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
                    group_idx=0, session_id=session, continuation_id=f"{session}/c{len(chain)}",
                )
        n = 1 if rng.random() < 0.5 else rng.randint(2, 32)
        parent = chain[-1] if chain else None
        hashes = [self._new_hash() for _ in range(n)]
        chain.extend(hashes)
        if len(chain) > 4_000:  # the program ended; a new one takes the session slot
            chain.clear()
        for h in hashes:
            self.resident.append(h)
            self.resident_set.add(h)
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent,
            token_ids=[rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)],
            block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
            group_idx=0, session_id=session, continuation_id=f"{session}/c{len(chain)}",
        )

    def batch(self, ts: float) -> tuple[EventBatch, int]:
        rng = self.rng
        target = rng.randint(10, 50)
        events: list[BlockStored | BlockRemoved] = []
        hashes = 0
        while len(events) < target:
            overflow = len(self.resident) - self.pool_blocks
            if overflow > 0:
                victim = self.resident.popleft()
                self.resident_set.discard(victim)
                events.append(BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))
                hashes += 1
            else:
                event = self._stored(rng.choice(self.sessions))
                events.append(event)
                hashes += len(event.block_hashes)
        return EventBatch(ts=ts, events=events), hashes


def build_stream(seed: int, workers: int, batches: int, pool_blocks: int, sessions: int,
                 prefill: bool = True) -> tuple[list[tuple[str, bytes]], int, list[tuple[str, bytes]]]:
    """Encoded batches (worker, payload): a fill phase bringing each pool to capacity (not
    timed), then ``batches`` steady-state batches. Returns (fill, hashes in steady, steady)."""
    rng = random.Random(seed)
    encoder = EventBatchEncoder()
    streams = [_Stream(rng, w, pool_blocks, sessions) for w in range(workers)]
    fill: list[tuple[str, bytes]] = []
    ts = 1_700_000_000.0
    if prefill:
        for stream in streams:
            while len(stream.resident) < pool_blocks:
                batch, _ = stream.batch(ts)
                fill.append((f"w{stream.worker}", encoder.encode(batch)))
                ts += 0.01
    steady: list[tuple[str, bytes]] = []
    total = 0
    for i in range(batches):
        stream = streams[i % workers]
        batch, hashes = stream.batch(ts)
        steady.append((f"w{stream.worker}", encoder.encode(batch)))
        total += hashes
        ts += 0.01
    return fill, total, steady


def _ingest(decoder: EventBatchDecoder, index: KVIndex, payloads: list[tuple[str, bytes]]) -> int:
    hashes = 0
    for worker, payload in payloads:
        hashes += index.apply_batch(worker, decoder.decode(payload))
    return hashes


def run(seed: int = 11, workers: int = 4, batches: int = 40_000, pool_blocks: int = 60_000,
        sessions: int = 200, repeats: int = 5) -> dict[str, float]:
    """Reports the median of ``repeats`` timed passes (after one warm-up pass)."""
    progress(f"kv ingest: encoding {workers} workers x {pool_blocks:,}-block pools "
             f"and {batches:,} steady-state batches")
    t0 = time.perf_counter()
    fill, expected, steady = build_stream(seed, workers, batches, pool_blocks, sessions)
    n_events = 0
    decoder = EventBatchDecoder()
    for _, payload in steady[:1000]:
        n_events += len(decoder.decode(payload).events)
    progress(f"kv ingest: built in {time.perf_counter() - t0:.1f}s; {len(steady):,} batches, "
             f"{expected:,} hashes, ~{n_events / min(1000, len(steady)):.0f} events/batch, "
             f"{sum(len(p) for _, p in steady) / len(steady):,.0f} bytes/batch")
    rates = []
    for rep in range(repeats + 1):
        index = KVIndex()
        decoder = EventBatchDecoder(token_ids=False)  # as the subscriber decodes for the index
        _ingest(decoder, index, fill)  # bring the pools to capacity (not timed)
        t0, c0 = time.perf_counter(), time.process_time()
        hashes = _ingest(decoder, index, steady)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if hashes != expected:
            raise AssertionError(f"index counted {hashes} hashes, stream carried {expected}")
        unknown = sum(index.worker(f"w{w}").unknown_removals for w in range(workers))
        if unknown:
            raise AssertionError(f"{unknown} removals of unknown hashes: the stream is inconsistent")
        rate = hashes / elapsed
        label = "warm-up" if rep == 0 else f"run {rep}/{repeats}"
        progress(f"kv ingest: {label}: {hashes:,} hashes in {elapsed:.3f}s = {rate:,.0f} hashes/s "
                 f"(CPU time {cpu:.3f}s = {hashes / cpu:,.0f} hashes/s per CPU second)")
        if rep > 0:
            rates.append(rate)
    rates.sort()
    median = rates[len(rates) // 2]
    result("kv_ingest_hashes_per_s", median, "hashes/s")
    return {"kv_ingest_hashes_per_s": median}
