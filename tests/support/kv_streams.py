"""KV-event streams for the tests that check the gateway's subscriber on real ZMQ sockets
(tests/integration/test_subscriber.py, test_membership_wiring.py): a publisher with vLLM's
framing and replay socket, a deterministic stream of events, the index an uninterrupted
subscriber would hold, and waits for the gateway to have applied a batch."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from scheduler.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventBatchDecoder,
    EventBatchEncoder,
    KVEvent,
)
from scheduler.kv_index import KVIndex, WorkerKV
from tests.support.gateway_harness import wait_for

BS = 16
END_SEQ = b"\xff" * 8


# -- a publisher with vLLM's framing and replay ----------------------------------------------


class FramePublisher:
    """PUB ``[topic, seq, payload(, epoch)]`` + a replay ROUTER served from a thread.

    ``publish(..., send=False)`` buffers a batch for replay without sending it: the frame
    is lost on the way, as with a PUB/SUB high-water mark."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay: str | None = "tcp://127.0.0.1:*",
                 topic: str = "", rank: int | None = 0, buffer_steps: int = 10_000,
                 epoch: bytes | None = None, bind: bool | None = None) -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.rank = rank
        self.epoch = epoch
        self.next_seq = 0
        self.history: list[bytes] = []  # every payload, by seq
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._encoder = EventBatchEncoder()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = self._attach(self.pub, endpoint, bind)
        self.replay: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay is not None:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay = self._attach(router, replay, bind)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    @staticmethod
    def _attach(socket: zmq.Socket, endpoint: str, bind: bool | None) -> str:
        """Bind (a wildcard endpoint, or ``bind``), else connect."""
        if bind or (bind is None and "*" in endpoint):
            socket.bind(endpoint)
            return socket.getsockopt_string(zmq.LAST_ENDPOINT)
        socket.connect(endpoint)
        return endpoint

    def publish(self, events: list[KVEvent], send: bool = True) -> int:
        return self.publish_raw(self._encoder.encode(EventBatch(time.time(), list(events), self.rank)),
                                send)

    def publish_raw(self, payload: bytes, send: bool = True) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.history.append(payload)
        with self._lock:
            self._buffer.append((seq, payload))
        if send:
            frames = [self.topic, seq.to_bytes(8, "big"), payload]
            if self.epoch is not None:
                frames.append(self.epoch)
            self.pub.send_multipart(frames)
        return seq

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                client, _, start = router.recv_multipart()
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    buffered = [(s, p) for s, p in self._buffer if s >= start_seq]
                for seq, payload in buffered:
                    router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        if self.ctx.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(linger=0)
        self.ctx.term()


@contextmanager
def publisher(**kwargs: Any) -> Iterator[FramePublisher]:
    pub = FramePublisher(**kwargs)
    try:
        yield pub
    finally:
        pub.close()


class Workload:
    """Deterministic stores (chained per session, some re-touching resident blocks) and
    removals, over hashes from ``base`` up."""

    def __init__(self, seed: int, base: int = 1, sessions: int = 4) -> None:
        self.rng = random.Random(seed)
        self.next_hash = base
        self.sessions = sessions
        self.resident: list[int] = []
        self.tails: dict[str, int] = {}

    def batch(self) -> list[KVEvent]:
        rng = self.rng
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 3)):
            session = f"s{rng.randrange(self.sessions)}"
            if self.resident and rng.random() < 0.35:
                victims = rng.sample(self.resident, rng.randint(1, min(3, len(self.resident))))
                for h in victims:
                    self.resident.remove(h)
                events.append(BlockRemoved(block_hashes=victims, medium="GPU"))
                continue
            if self.resident and rng.random() < 0.2:  # another session hits a resident block
                hashes, parent = [rng.choice(self.resident)], None
            else:
                n = rng.randint(1, 3)
                hashes = list(range(self.next_hash, self.next_hash + n))
                self.next_hash += n
                parent = self.tails.get(session)
                if parent not in self.resident:
                    parent = None
                self.resident.extend(hashes)
            self.tails[session] = hashes[-1]
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                      token_ids=list(range(len(hashes) * BS)), block_size=BS,
                                      lora_id=None, medium="GPU", lora_name=None, session_id=session))
        return events


# -- looking inside ----------------------------------------------------------------------------


def snapshot(kv: WorkerKV) -> tuple[dict, dict]:
    blocks = {h: (b.parent, b.tokens, b.prefix_tokens, b.admitter, b.continuation, tuple(b.sessions))
              for h, b in kv.blocks.items()}
    return blocks, dict(kv.session_tokens)


def baseline(*payload_lists: list[bytes]) -> tuple[dict, dict]:
    """The index an uninterrupted subscriber would hold after these batches."""
    decoder = EventBatchDecoder()
    index = KVIndex()
    for payloads in payload_lists:
        for payload in payloads:
            index.apply_batch("w", decoder.decode(payload))
    return snapshot(index.worker("w"))


def stats(gw, worker: str):
    return gw.parts.kv_events.stats[worker]


def applied_through(gw, worker: str, seq: int, rank: int = 0, timeout: float = 5.0) -> None:
    wait_for(lambda: stats(gw, worker).last_seq.get(rank) == seq
             and gw.parts.kv_events.queue_depths().get(worker, 0) == 0,
             timeout=timeout, what=f"{worker} rank {rank} to apply seq {seq}")


def sync(gw, pub: FramePublisher, worker: str, rank: int = 0) -> None:
    """Publish empty batches until the gateway applies one: the subscription is live."""
    deadline = time.monotonic() + 5
    while True:
        seq = pub.publish([])
        try:
            applied_through(gw, worker, seq, rank, timeout=0.25)
            return
        except AssertionError:
            assert time.monotonic() < deadline, f"{worker} never received events"


def replay_all(endpoint: str) -> list[bytes]:
    """Every batch a publisher still buffers, from seq 0 (its replay socket answers with all)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = []
        while True:
            assert dealer.poll(5000), "no replay answer from the simworker"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return payloads
            assert int.from_bytes(seq, "big") == len(payloads)
            payloads.append(payload)
    finally:
        dealer.close()
        ctx.term()
