"""The simworker's replay socket against hostile requests: a frame far longer than any replay
request is refused unread, malformed requests are dropped and counted, and the socket goes on
answering good ones (real ZMQ sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from controller.kv_wire import replay_from
from scheduler.kv_events import AllBlocksCleared
from simworker.kv_publisher import MAX_INBOUND_FRAME_BYTES, KvEventPublisher

WAIT_S = 10.0


def test_hostile_replay_requests_are_dropped_and_good_ones_still_answered() -> None:
    async def main() -> None:
        publisher = KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                     topic="kv@w0")
        publisher.open()
        publisher.publish([AllBlocksCleared()])
        serving = asyncio.create_task(publisher.serve_replay())
        ctx = zmq.asyncio.Context()
        try:
            hostile = ctx.socket(zmq.DEALER)
            hostile.setsockopt(zmq.LINGER, 0)
            hostile.connect(publisher.bound_replay_endpoint)
            await hostile.send_multipart((b"", b"x" * (MAX_INBOUND_FRAME_BYTES * 64)))  # refused unread
            await hostile.send_multipart((b"", b"\x00" * 3))  # a start seq of 3 bytes
            await hostile.send_multipart((b"",))              # no start seq at all
            # the oversized frame cost the hostile socket its connection (it may reconnect):
            # the malformed ones are sent again on a fresh one until they have reached it
            probe = ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(publisher.bound_replay_endpoint)
            for _ in range(100):
                await probe.send_multipart((b"", b"\x00" * 3))
                await probe.send_multipart((b"",))
                await asyncio.sleep(0.1)
                if publisher.ignored_requests >= 2:
                    break
            probe.close()
            assert publisher.ignored_requests >= 2
            async with replay_from(ctx, publisher.bound_replay_endpoint, 0, WAIT_S) as next_batch:
                first = await next_batch()
            assert first is not None and first[0] == 0
            assert not serving.done()  # the replay socket goes on
        finally:
            serving.cancel()
            ctx.destroy(linger=0)
            publisher.close()

    asyncio.run(main())
