"""Run with vLLM's virtualenv (``.venv-vllm/bin/python``): time block allocation on vLLM's
own ``BlockPool`` without and with the Sluice plugin's patches, and print one JSON line.

One cycle = a request-sized batch of blocks allocated, cached under fresh hashes (events on,
so labels and removal attribution run), freed in reverse, and later evicted when reallocated.
Rounds alternate plain and patched to spread machine noise over both.
"""

from __future__ import annotations

import json
import sys
import time

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

from controller.vllm_plugin import labels, retention

BLOCK = 16
BLOCKS_PER_REQUEST = 64
POOL_BLOCKS = 4096


def _requests(n: int, hasher) -> list[Request]:
    out = []
    for i in range(n):
        tokens = [(i * 7919 + j) % 1000 for j in range(BLOCK * BLOCKS_PER_REQUEST)]
        params = SamplingParams(max_tokens=1, extra_args={"continuation_id": f"c{i}"})
        out.append(Request(f"r{i}", tokens, params, None, block_hasher=hasher, session_id=f"s{i % 50}"))
    return out


def _round(requests: list[Request]) -> tuple[float, int]:
    pool = BlockPool(num_gpu_blocks=POOL_BLOCKS, enable_caching=True, hash_block_size=BLOCK,
                     enable_kv_cache_events=True)
    blocks_done = 0
    start = time.perf_counter()
    for request in requests:
        blocks = pool.get_new_blocks(BLOCKS_PER_REQUEST)
        pool.cache_full_blocks(request, blocks, 0, BLOCKS_PER_REQUEST, BLOCK, 0)
        pool.free_blocks(reversed(blocks))
        pool.take_events()
        blocks_done += BLOCKS_PER_REQUEST
    return time.perf_counter() - start, blocks_done


def main() -> int:
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
    requests = _requests(int(sys.argv[1]) if len(sys.argv) > 1 else 600, hasher)
    plain, patched = [], []
    _round(requests[:50])  # warm-up
    for i in range(6):
        for mode in (("plain", "patched") if i % 2 == 0 else ("patched", "plain")):
            if mode == "patched":
                labels.apply()
                retention.apply()
            seconds, blocks = _round(requests)
            if mode == "patched":
                retention.remove()
                labels.remove()
                patched.append(seconds / blocks)
            else:
                plain.append(seconds / blocks)
    best_plain, best_patched = min(plain), min(patched)
    print(json.dumps({"plain_us_per_block": best_plain * 1e6, "patched_us_per_block": best_patched * 1e6,
                      "overhead_pct": (best_patched / best_plain - 1.0) * 100.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
