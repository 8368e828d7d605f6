"""Run with vLLM's virtualenv: build vLLM's own ``ZmqEventPublisher`` with the Sluice plugin's
epoch patch applied, publish one batch, and print as JSON the frames a SUB received.

argv: one mode per publisher to start in turn, ``on`` or ``off`` (``SLUICE_PUBLISHER_EPOCH``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import zmq
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

from sluice_vllm_plugin import epoch


def publish_once(ctx: zmq.Context, endpoint: str) -> list[str]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv@w0")
    try:
        time.sleep(0.3)  # let the SUB join before anything is published
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        frames = sub.recv_multipart()
        stamped = epoch.epoch_of(publisher)
        return {"frames": [f.hex() for f in frames], "epoch": stamped.hex() if stamped else None}
    finally:
        publisher.shutdown()
        sub.close(0)


def main() -> int:
    epoch.apply()
    ctx = zmq.Context.instance()
    out = []
    for i, mode in enumerate(sys.argv[1:]):
        os.environ[epoch.ENV_SWITCH] = mode
        out.append(publish_once(ctx, f"inproc://sluice-epoch-{i}"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
