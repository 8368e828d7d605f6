"""What the KV-event subscriber (controller/subscriber.py) keeps per worker: its counters
(:class:`KvEventStats`, which the metrics read), its queue and the seq streams of its
data-parallel ranks (:class:`KvSource`, :class:`Stream`). Data only: the subscriber's tasks
are the one writer, on the gateway's event loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from controller.serve_config import WorkerConfig


@dataclass(slots=True)
class KvEventStats:
    """Counters of one index key (a worker of the fleet), read by the metrics collector."""

    received: int = 0
    applied: int = 0
    replayed: int = 0
    dropped: int = 0
    gaps_repaired: int = 0
    # events of a type this version does not know (a newer engine's), skipped; the rest of
    # their batch is applied
    events_skipped: int = 0
    undecodable: int = 0  # batches (live or replayed) that do not decode, dropped
    resets: dict[str, int] = field(default_factory=dict)
    last_seq: dict[int, int] = field(default_factory=dict)  # rank -> seq last applied


class Stream:
    """One publisher's seq stream: (worker, data-parallel rank)."""

    __slots__ = ("worker", "rank", "index_key", "replay", "expected", "fresh", "epoch",
                 "pending_reset", "resets", "caught_up_to")

    def __init__(self, worker: str, rank: int, index_key: str, replay: str | None) -> None:
        self.worker = worker
        self.rank = rank
        self.index_key = index_key
        self.replay = replay
        self.expected = 0
        # Nothing of this stream has been applied since its index key was last emptied, so
        # batches missing before the next one applied cost nothing (catch-up, not a gap).
        self.fresh = True
        self.epoch: bytes | None = None
        # Another stream reset the index key this one feeds: catch up from seq 0.
        self.pending_reset = False
        self.resets = 0
        # The last seq the catch-up at start applied, until a live batch past it arrives:
        # live batches at or below it are the ones it applied (the subscriber skips them).
        self.caught_up_to: int | None = None


class KvSource:
    """One worker's queue and applier; the streams of its ranks (what
    :meth:`KvEventSubscriber.add` returns and :meth:`KvEventSubscriber.run_source` runs)."""

    def __init__(self, worker: WorkerConfig, bound: bool, hwm: int) -> None:
        self.worker = worker
        self.name = worker.name
        self.bound = bound  # fed from the kv_events_bind socket
        self.hwm = hwm
        self.send, self.receive = anyio.create_memory_object_stream[tuple](max_buffer_size=hwm)
        self.enqueued = 0   # batches put on the queue so far (the next one's position)
        self.queued_bytes = 0  # payload bytes of the batches on the queue now
        self.dropping = 0   # batches dropped since the queue last accepted one
        # rank -> (seq, queue position at the time) of the latest batch dropped
        self.drops: dict[int, tuple[int, int]] = {}
        self.streams: dict[int, Stream] = {}

    @property
    def queued(self) -> int:
        return self.receive.statistics().current_buffer_used
