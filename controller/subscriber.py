"""KV events from the engines into the policy's index (architecture.md §5.3, "KV events").

Two layouts, both on pyzmq's asyncio sockets:

- **Per worker**: each worker with ``kv_events`` gets a SUB socket connected to that
  endpoint (bound instead when it holds ``*``), subscribed to ``kv_topic`` (all topics when
  unset). Every frame on it belongs to that worker, whatever its topic.
- **llm-d**: with ``kv_events_bind`` set, Sluice binds ONE SUB there and the engines connect
  to it with topic ``kv@<worker>@<model>`` (``kv@<worker>`` also works). The worker is
  taken from the topic: the longest name of a worker in the fleet now that the topic
  names. Workers that have their own ``kv_events`` are not fed from the bound socket (their
  frames there are ignored and counted: two publishers under one name would mix two seq
  streams).

**Membership.** :meth:`KvEventSubscriber.add` enters one worker (its stats, and its queue
when it has ``kv_events`` or the bound socket feeds it) and returns its
:class:`KvSource`; :meth:`KvEventSubscriber.run_source` runs that worker's applier and
reader until cancelled; :meth:`KvEventSubscriber.remove` drops the worker once they have
stopped. The fleet (controller/fleet.py) does the three for every worker, the configured
ones at start and the ones added at run time alike, so a worker added live is caught up
from seq 0 by replay and repaired exactly like one in the config. :meth:`KvEventSubscriber.run`
is the bound socket's reader; the ZMQ context is made at the first socket and destroyed by
:meth:`KvEventSubscriber.aclose`.

The frames, topics, replay protocol and socket setup (size limit) are controller/kv_wire.py's.

**Streams.** Sequence numbers count per publisher, and a data-parallel engine has one
publisher per rank, so a stream is (worker, ``data_parallel_rank``). Its batches go to the
index under the worker's name; a batch of rank ``r > 0`` goes to the worker
``f"{worker}#dp{r}"`` when the fleet has one (the ledger knows workers by name only, so a
rank can be scheduled on separately only if it is a worker of the fleet), and otherwise to
the worker itself: the ranks' blocks then share one index, and a reset caused by one rank
clears them all (the others catch up from their replay buffers at once, before the
applier takes its next batch). Replay of a rank: in the
per-worker layout, the worker's ``replay`` (the endpoints name one publisher); in the llm-d
layout, the ``f"{worker}#dp{r}"`` worker's ``replay`` when set, else the worker's ``replay``
offset as vLLM offsets it for rank ``r`` (tcp port + r).

**Reader → queue → applier.** A reader task per socket only splits frames, peeks the rank
(without decoding the events) and puts the batch on its worker's queue, which holds at most
``kv_events_queue`` batches and :data:`QUEUE_BYTES_LIMIT` bytes of them. When it is full the
batch is dropped and counted; the drop is then repaired like any other gap: by the next batch
of that stream (its seq jumps), or, when no batch follows, as soon as the queue has drained.
One applier task per worker decodes batches with :class:`~scheduler.kv_events.EventBatchDecoder`
(``token_ids=False``: stores' token ids are left unparsed, only counted) and feeds them, in seq order, to ``policy.observe_kv`` under the admission lock.

**Per batch of a stream** (``expected`` is the next seq the stream should carry):

- ``seq == expected``: applied.
- ``seq > expected`` (a gap: the network, the SUB's high-water mark or our queue dropped
  batches): the missing ``[expected, seq)`` are asked from the worker's replay socket
  (:func:`~controller.kv_wire.replay_from`) and applied in order, then the batch itself.
  Replayed batches past the gap are read and ignored: the queue still holds them, so nothing
  is applied twice and a lower seq can only mean a restart. If the replay no longer starts
  at ``expected`` (its buffer moved on), has no answer within ``kv_replay_timeout_s``, or the
  worker has no ``replay``, the worker's index is reset and rebuilt from what the replay
  still holds and the events that follow.
- ``seq < expected``, or a new publisher epoch: the engine restarted; the worker's index is
  reset and the new publisher's stream is caught up from seq 0 by replay. (vLLM's own
  publisher sends no epoch, so a restart whose first batch to arrive is already at or past
  ``expected`` cannot be told from the old stream going on; the plugin's epoch closes that
  hole.)
- A stream seen for the first time, or again after a reset, is caught up from seq 0 by
  replay when its first batch is not seq 0 (Sluice started after the engine, or the SUB
  joined late): what the buffer still holds is applied, and nothing counts as lost, since
  the index holds nothing of that stream yet.
- **At start**, a worker with ``replay`` is caught up before its first live batch: its
  applier first asks the replay socket for everything from seq 0 (:meth:`KvEventSubscriber.
  _catch_up`). A gateway that restarts, or a worker added live, then knows where each
  program's KV is before any program calls again, even on an engine that publishes nothing
  until it is sent work. Live batches the SUB queued meanwhile at or below the last seq
  replayed are the same batches, skipped; the first one past it ends that window (within it,
  only an epoch tells an engine restart from them, as below).
- A message that does not decode is counted (``undecodable``) and dropped before its seq, rank
  or epoch is trusted: no gap, no restart, no reset (if it was the engine's, the next batch
  shows the gap). Only the replay's copy, the engine's own, not decoding loses the batch: a
  reset (``undecodable``) unless the stream is fresh. An event of a type Sluice does not know
  (a newer engine's) is not a decode failure: skipped and counted, the rest of its batch applied.

When a ``f"{worker}#dp{r}"`` worker joins or leaves the fleet, that rank's stream moves to
its new index key at its next batch and is caught up there from seq 0 by replay; the index
it fed until then is reset when it stays in the fleet (it holds that rank's blocks), and the
other ranks feeding that index are caught up again from their replay right away.

Resets are counted by reason (:data:`RESET_REASONS`). A loop that fails is logged with its
context and restarted after a backoff; an applier that failed resets the indexes it feeds,
since a batch may have been half applied.

Only this module's tasks and the fleet's add and remove touch the subscriber's state, all on
the gateway's event loop.

**Invariants** (cited where kept):

1. A stream's batches reach the index in seq order, each at most once: a batch is applied
   only at ``expected``, which then moves past it (:meth:`KvEventSubscriber._apply`).
2. The index never holds a stream with a hole in it: a gap that replay cannot fill, unless
   the stream is fresh (nothing of it applied yet), resets the index first
   (:meth:`KvEventSubscriber._repair`).
3. No batch of a worker that left the fleet is applied (``Admission.observe_kv`` checks
   under the lock, and its stats are gone).
4. A message that does not decode changes no stream and no index
   (:meth:`KvEventSubscriber._handle`); only the replay's copy of a batch can (``_repair``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import zmq
import zmq.asyncio

from controller.admission import Admission
from controller.kv_wire import (MAX_MESSAGE_BYTES, RankPeek, ReplayError, attach, bind_private,
                                offset_endpoint, prepare_bound_socket, prepare_socket,
                                publisher_epoch, reconnect_when_lost, replay_from,
                                worker_from_topic)
from controller.kv_streams import KvEventStats, KvSource, Stream
from controller.serve_config import ServeConfig, WorkerConfig
from controller.zmq_keys import GatewayZmqKeys
from scheduler.kv_events import EventBatch, EventBatchDecoder

RESET_REASONS = (
    "gap_beyond_replay",  # the replay buffer no longer holds the missing batches
    "no_replay",          # a gap, and the worker has no replay endpoint
    "replay_failed",      # the replay socket did not answer (in time) or answered garbage
    "seq_backwards",      # the engine restarted (its seq started over)
    "epoch_changed",      # the engine restarted (a new publisher epoch)
    "undecodable",        # the replay's copy of a missing batch does not decode: it is lost
    "subscriber_error",   # the applier failed mid-batch
    "rank_rerouted",      # a data-parallel rank's own worker joined: its blocks leave this index
)
IGNORE_REASONS = ("malformed", "unknown_topic", "worker_has_endpoint", "undecodable")
# Bytes of batches a worker's queue may hold: well-behaved ones are KBs (``kv_events_queue``
# binds first); this stops outsized frames from holding kv_events_queue × MAX_MESSAGE_BYTES.
QUEUE_BYTES_LIMIT = 2 * MAX_MESSAGE_BYTES
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# A loop that ran this long before failing starts over at the shortest backoff.
BACKOFF_RESET_AFTER_S = 30.0


class KvEventSubscriber:
    """Feeds each worker's KV events to ``admission.policy``; workers come and go with
    :meth:`add` and :meth:`remove`."""

    def __init__(self, config: ServeConfig, admission: Admission, log: Any) -> None:
        self._admission = admission
        self._log = log.bind(component="kv_events")
        self._workers: dict[str, WorkerConfig] = {}  # the fleet now (index keys, topics)
        self._bind = config.kv_events_bind
        self._queue_size = config.kv_events_queue
        self._replay_timeout_s = config.kv_replay_timeout_s
        self._zmq_keys = GatewayZmqKeys(config)  # CURVE client keys, per worker
        self._decoder = EventBatchDecoder(token_ids=False)  # the index reads only their count
        self._peek = msgspec.msgpack.Decoder(RankPeek)
        self._sources: dict[str, KvSource] = {}
        self.stats: dict[str, KvEventStats] = {}
        self.ignored: dict[str, int] = {reason: 0 for reason in IGNORE_REASONS}
        self.bound_endpoint: str | None = None  # where kv_events_bind ended up (port 0 → real)
        self._ctx: zmq.asyncio.Context | None = None

    def queue_depths(self) -> dict[str, int]:
        return {name: source.queued for name, source in self._sources.items()}

    # -- membership ------------------------------------------------------------------------

    def add(self, worker: WorkerConfig) -> KvSource | None:
        """Enter ``worker``: its stats, and its source (queue and streams) when it has
        ``kv_events`` or the bound socket feeds it; None when nothing feeds it (its U is
        then the usage-based estimate). Its batches are applied once :meth:`run_source`
        runs the source."""
        if worker.name in self._workers:
            raise ValueError(f"KV events: a worker named {worker.name!r} exists already")
        self._workers[worker.name] = worker
        self.stats[worker.name] = KvEventStats()
        if worker.kv_events is not None:
            source = self._sources[worker.name] = KvSource(worker, False, self._queue_size)
            return source
        if self._bind is not None:
            source = self._sources[worker.name] = KvSource(worker, True, self._queue_size)
            return source
        return None

    def remove(self, name: str) -> None:
        """Drop worker ``name``: its source, queue and stats (call it once the tasks of
        :meth:`run_source` have stopped). Frames for it on the bound socket count as
        ``unknown_topic`` from now on."""
        source = self._sources.pop(name, None)
        if source is not None:
            source.send.close()
            source.receive.close()
        del self._workers[name]
        del self.stats[name]

    # -- the tasks -------------------------------------------------------------------------

    async def run(self) -> None:
        """The bound socket's reader (llm-d layout) until cancelled; returns at once
        without ``kv_events_bind``. Each worker's own tasks are :meth:`run_source`'s."""
        if self._bind is None:
            return
        await self._supervise("bound reader", self._read_bound, None, None,
                              {"endpoint": self._bind})

    async def run_source(self, source: KvSource) -> None:
        """One worker's applier and, unless the bound socket feeds it, its reader (SUB
        socket), until cancelled; the socket is closed when they stop."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._supervise, "applier", self._apply_loop, source, self._recover,
                          {"worker": source.name}, name=f"KV-event applier of {source.name}")
            if not source.bound:
                tg.start_soon(self._supervise, "reader", self._read_worker, source, None,
                              {"worker": source.name, "endpoint": source.worker.kv_events},
                              name=f"KV-event reader of {source.name}")

    async def aclose(self) -> None:
        """Destroy the ZMQ context (at shutdown, once every task has stopped)."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def _supervise(self, what: str, loop: Callable[..., Awaitable[None]], arg: Any,
                         on_failure: Callable[[Any], Awaitable[None]] | None,
                         context: dict[str, Any]) -> None:
        """Run ``loop`` for ever: a failure is logged with its context, then the loop is
        restarted after a backoff that doubles up to BACKOFF_MAX_S."""
        backoff = BACKOFF_MIN_S
        while True:
            started = time.monotonic()
            try:
                await (loop() if arg is None else loop(arg))
                self._log.error("KV-event loop ended by itself; restarting", loop=what,
                                retry_s=backoff, **context)
            except Exception:
                self._log.exception("KV-event loop failed; restarting", loop=what,
                                    retry_s=backoff, **context)
                if on_failure is not None:
                    try:
                        await on_failure(arg)
                    except Exception:
                        self._log.exception("KV-event loop recovery failed", loop=what, **context)
            if time.monotonic() - started > BACKOFF_RESET_AFTER_S:
                backoff = BACKOFF_MIN_S
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _read_worker(self, source: KvSource) -> None:
        assert source.worker.kv_events is not None
        socket = self._context().socket(zmq.SUB)
        try:
            prepare_socket(socket, self._zmq_keys.client(source.worker))
            topic = source.worker.kv_topic or ""
            socket.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            endpoint = attach(socket, source.worker.kv_events)
            log = self._log.bind(worker=source.name)
            log.info("subscribed to KV events", endpoint=endpoint, topic=topic)
            async with anyio.create_task_group() as tg:
                if endpoint == source.worker.kv_events:  # connected, not bound
                    tg.start_soon(reconnect_when_lost, socket, endpoint, log)
                while True:
                    frames = await socket.recv_multipart()
                    self._accept(source, frames)
                    await anyio.lowlevel.checkpoint()  # a flood must not starve the gateway
        finally:
            socket.close(linger=0)

    async def _read_bound(self) -> None:
        assert self._bind is not None
        socket = self._context().socket(zmq.SUB)
        auth = None
        try:
            auth = prepare_bound_socket(socket, self._zmq_keys.publishers())  # CURVE with keys
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            self.bound_endpoint = bind_private(socket, self._bind)  # an ipc:// file 0600
            self._log.info("KV events bound (llm-d layout)", endpoint=self.bound_endpoint,
                           workers=[s.name for s in self._sources.values() if s.bound])
            while True:
                frames = await socket.recv_multipart()
                name = worker_from_topic(frames[0], self._workers) if frames else None
                if name is None:
                    self._ignore("unknown_topic", topic=frames[0][:200].decode("utf-8", "replace")
                                 if frames else None)
                else:
                    source = self._sources.get(name)
                    if source is None or not source.bound:
                        self._ignore("worker_has_endpoint", worker=name)
                    else:
                        self._accept(source, frames)
                await anyio.lowlevel.checkpoint()
        finally:
            self.bound_endpoint = None
            socket.close(linger=0)
            if auth is not None:  # after the socket: a ZAP handler outlives what it answers
                auth.stop()

    def _accept(self, source: KvSource, frames: list[bytes]) -> None:
        """Queue one message of ``source``'s worker; drop it (counted) when it does not decode
        or the queue is full."""
        if len(frames) < 3 or len(frames[1]) != 8:
            self._ignore("malformed", worker=source.name, frames=len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        try:
            rank = max(self._peek.decode(payload).data_parallel_rank or 0, 0)
        except (msgspec.DecodeError, RecursionError) as err:  # the latter: nested too deep
            self.stats[source.name].received += 1
            self._undecodable(source.name, seq, err, replayed=False)
            return
        stats = self.stats[self._index_key(source, rank)]
        stats.received += 1
        try:
            if source.queued_bytes and source.queued_bytes + len(payload) > QUEUE_BYTES_LIMIT:
                raise anyio.WouldBlock
            source.send.send_nowait((seq, rank, payload, publisher_epoch(frames), source.enqueued))
        except anyio.WouldBlock:
            stats.dropped += 1
            source.drops[rank] = (seq, source.enqueued)
            if source.dropping == 0:
                self._log.warning("KV-event queue full; dropping batches (repaired from replay "
                                  "later)", worker=source.name, kv_events_queue=source.hwm, seq=seq)
            source.dropping += 1
            return
        source.enqueued += 1
        source.queued_bytes += len(payload)
        if source.dropping:
            self._log.info("KV-event queue accepts batches again", worker=source.name,
                           dropped=source.dropping)
            source.dropping = 0

    def _ignore(self, reason: str, **context: Any) -> None:
        n = self.ignored[reason] = self.ignored[reason] + 1
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th ... of each kind
            self._log.warning("KV-event message ignored", reason=reason, count=n, **context)

    def _undecodable(self, key: str, seq: int, err: Exception, replayed: bool) -> None:
        """Count a batch of index key ``key`` that does not decode (its caller drops it)."""
        if (stats := self.stats.get(key)) is not None:  # else its worker left the fleet
            stats.undecodable += 1
        self._ignore("undecodable", worker=key, seq=seq, replayed=replayed,
                     problem=str(err)[:200])

    def _decode(self, key: str, seq: int, payload: bytes, replayed: bool) -> EventBatch | None:
        """The batch in ``payload``, or None (counted) when it does not decode."""
        skipped_before = self._decoder.skipped_total
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as err:
            self._undecodable(key, seq, err, replayed)
            return None
        skipped = self._decoder.skipped_total - skipped_before
        if skipped and (stats := self.stats.get(key)) is not None:
            stats.events_skipped += skipped
            if stats.events_skipped == skipped:  # the first
                self._log.warning("Unknown KV event types skipped; the rest of each batch applied",
                                  worker=key, seq=seq, types=sorted(self._decoder.skipped))
        return batch

    # -- applying --------------------------------------------------------------------------

    async def _apply_loop(self, source: KvSource) -> None:
        await self._catch_up(source)
        while True:
            item = await source.receive.receive()
            source.queued_bytes -= len(item[2])
            await self._handle(source, item)
            if source.drops and source.queued == 0:
                await self._repair_drops(source)

    async def _handle(self, source: KvSource, item: tuple) -> None:
        seq, rank, payload, epoch, position = item
        # Decoded first: an undecodable frame's seq, rank and epoch are not to be trusted; it
        # must neither open a gap, nor look like a restart, nor make a stream (invariant 4).
        batch = self._decode(self._index_key(source, rank), seq, payload, replayed=False)
        if batch is None:
            return
        stream = await self._stream(source, rank)
        self._take_pending(stream)
        if epoch is not None:
            if stream.epoch is not None and epoch != stream.epoch:
                await self._reset(stream, "epoch_changed", seq=seq)
                self._forget_drops(source, rank, position)
            stream.epoch = epoch
        if stream.caught_up_to is not None:
            if seq <= stream.caught_up_to:
                return  # applied by the catch-up at start (invariant 1)
            stream.caught_up_to = None
        if seq < stream.expected:
            await self._reset(stream, "seq_backwards", seq=seq, expected=stream.expected)
            self._forget_drops(source, rank, position)
        if seq > stream.expected:
            await self._repair(stream, seq - 1)
        await self._apply(stream, seq, batch, replayed=False)
        await self._catch_up_siblings(source)

    async def _repair_drops(self, source: KvSource) -> None:
        """The queue has drained, but batches dropped at its end were never followed by one
        that would show the gap: repair up to the last one dropped."""
        drops, source.drops = source.drops, {}
        for rank, (seq, _) in drops.items():
            stream = await self._stream(source, rank)
            self._take_pending(stream)
            if seq >= stream.expected:
                await self._repair(stream, seq)
        await self._catch_up_siblings(source)

    @staticmethod
    def _forget_drops(source: KvSource, rank: int, position: int) -> None:
        """After a restart, drops that happened before this batch was queued belong to the
        old publisher."""
        drop = source.drops.get(rank)
        if drop is not None and drop[1] <= position:
            del source.drops[rank]

    async def _catch_up(self, source: KvSource) -> None:
        """Before any live batch: the worker's stream (rank 0) caught up from seq 0 to the end
        of its replay buffer, when it has ``replay`` and nothing of it is applied yet."""
        if source.worker.replay is None:
            return
        stream = await self._stream(source, 0)
        if stream.fresh:
            await self._repair(stream, None)
            if not stream.fresh:
                stream.caught_up_to = stream.expected - 1

    async def _catch_up_siblings(self, source: KvSource) -> None:
        """The streams of this socket whose index another stream reset: caught up from seq 0
        by replay now, not at their next batch (a rank that publishes nothing for a while
        would leave its blocks out of the index until then). Streams of other sockets catch
        up at their next batch: their applier is another task."""
        for stream in list(source.streams.values()):
            if stream.pending_reset:
                self._take_pending(stream)
                await self._repair(stream, None)
                if not stream.fresh:
                    stream.caught_up_to = stream.expected - 1

    async def _repair(self, stream: Stream, upto: int | None) -> None:
        """Apply the stream's batches ``[expected, upto]`` (``upto`` None: to the end of the
        buffer) from the replay socket; reset the index when they are not all there (unless
        the stream is fresh)."""
        needed = stream.expected
        was_fresh = stream.fresh
        resets = stream.resets
        problem: str | None = None
        if stream.replay is None:
            problem = "no replay endpoint"
            if not stream.fresh:
                await self._reset(stream, "no_replay", needed=needed, upto=upto)
        else:
            try:
                keys = self._zmq_keys.client(self._workers.get(stream.index_key))
                async with replay_from(self._context(), stream.replay, needed,
                                       self._replay_timeout_s, keys) as next_batch:
                    while (got := await next_batch()) is not None:
                        seq, payload = got
                        if upto is not None and seq > upto:
                            break  # the queue holds the rest
                        if seq < stream.expected:
                            continue
                        if seq > stream.expected:  # the buffer starts past what is missing
                            if not stream.fresh:
                                await self._reset(stream, "gap_beyond_replay", needed=stream.expected,
                                                  first_replayed=seq)
                            stream.expected = seq
                        batch = self._decode(stream.index_key, seq, payload, replayed=True)
                        if batch is None:  # the engine's own copy: the batch is lost (invariant 2)
                            if not stream.fresh:
                                await self._reset(stream, "undecodable", seq=seq)
                            stream.expected = seq + 1
                            continue
                        await self._apply(stream, seq, batch, replayed=True)
            except ReplayError as err:
                problem = str(err)
                if not stream.fresh:
                    await self._reset(stream, "replay_failed", endpoint=stream.replay,
                                      needed=stream.expected, problem=problem)
        if upto is not None and stream.expected <= upto:  # the replay ended before the gap did
            if not stream.fresh:  # invariant 2
                await self._reset(stream, "gap_beyond_replay", needed=stream.expected, upto=upto)
            stream.expected = upto + 1
        stats = self.stats.get(stream.index_key)
        if stream.resets != resets or stats is None:
            return
        if was_fresh:
            self._log.info("KV-event stream caught up", worker=stream.index_key,
                           publisher=stream.worker, rank=stream.rank, from_seq=needed,
                           to_seq=upto, last_seq=stats.last_seq.get(stream.rank),
                           problem=problem)
        else:
            stats.gaps_repaired += 1
            self._log.debug("KV-event gap repaired from replay", worker=stream.index_key,
                            rank=stream.rank, from_seq=needed, to_seq=upto)

    async def _apply(self, stream: Stream, seq: int, batch: EventBatch, replayed: bool) -> None:
        stats = self.stats.get(stream.index_key)
        if stats is None:
            return  # its index key left the fleet: the stream moves on at its next batch
        # Every policy call runs under the admission lock (a batch is applied whole,
        # between two other policy calls).
        if not await self._admission.observe_kv(stream.index_key, batch):
            return  # its worker left the fleet while the batch waited for the lock (invariant 3)
        stream.expected = seq + 1  # invariant 1
        stream.fresh = False
        stats.applied += 1
        if replayed:
            stats.replayed += 1
        stats.last_seq[stream.rank] = seq

    async def _reset(self, stream: Stream, reason: str, **context: Any) -> None:
        """Empty the index of ``stream``'s worker. The stream starts over (fresh, at seq 0;
        the caller moves it on); every other stream feeding that index catches up from its
        replay: those of the same socket once the applier is done with this batch
        (:meth:`_catch_up_siblings`), the others at their next batch."""
        key = stream.index_key
        await self._admission.reset_worker_kv(key)
        stats = self.stats.get(key)
        if stats is not None:  # else the worker left the fleet meanwhile, its counts with it
            stats.resets[reason] = stats.resets.get(reason, 0) + 1
        stream.resets += 1
        stream.expected = 0
        stream.fresh = True
        stream.caught_up_to = None
        for source in self._sources.values():
            for other in source.streams.values():
                if other is not stream and other.index_key == key:
                    other.pending_reset = True
        self._log.warning("KV index of a worker reset", worker=key, reason=reason,
                          publisher=stream.worker, rank=stream.rank, **context)

    async def _recover(self, source: KvSource) -> None:
        """The applier failed, maybe half-way through a batch: reset what it feeds."""
        for stream in list(source.streams.values()):
            await self._reset(stream, "subscriber_error")

    @staticmethod
    def _take_pending(stream: Stream) -> None:
        if stream.pending_reset:
            stream.pending_reset = False
            stream.expected = 0
            stream.fresh = True
            stream.caught_up_to = None

    # -- streams and replay ----------------------------------------------------------------

    def _index_key(self, source: KvSource, rank: int) -> str:
        if rank > 0:
            name = f"{source.name}#dp{rank}"
            if name in self._workers:
                return name
        return source.name

    async def _stream(self, source: KvSource, rank: int) -> Stream:
        key = self._index_key(source, rank)
        stream = source.streams.get(rank)
        if stream is not None and stream.index_key == key:
            return stream
        replay = source.worker.replay
        if source.bound and rank > 0:
            # every rank connected to our socket; its replay socket is its own
            own = self._workers[key].replay if key != source.name else None
            replay = own or offset_endpoint(replay, rank)
        if stream is not None and stream.index_key in self._workers:
            # The rank's own worker joined the fleet: the index this rank fed until now
            # holds its blocks (the other ranks feeding it catch up from their replay).
            await self._reset(stream, "rank_rerouted", rank_worker=key)
        # New, or moved to another index key, which holds nothing of this rank yet: caught
        # up from seq 0 by replay.
        stream = source.streams[rank] = Stream(source.name, rank, key, replay)
        return stream
