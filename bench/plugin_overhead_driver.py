"""Run with vLLM's virtualenv (``.venv-vllm/bin/python``): time block allocation on vLLM's
own ``BlockPool`` without and with the Sluice plugin's patches, and print one JSON line.

One cycle is one request's life in the pool, made of the calls ``KVCacheManager`` makes (events
on, so labels and removal attribution run):

* prefix lookup of a system prompt every request shares (``SHARED_BLOCKS`` blocks:
  ``get_cached_block`` + ``touch``, which takes them out of the free queue);
* prefill: ``get_new_blocks`` for ``PREFILL_BLOCKS`` blocks and one ``cache_full_blocks`` for
  them (one ``BlockStored``; under the plugin each new hash is labelled with its first
  admitter);
* decode: ``DECODE_BLOCKS`` times ``get_new_blocks(1)`` then ``cache_full_blocks`` for that one
  block, as a block fills every ``BLOCK`` generated tokens; then one more block for the last,
  partly filled tokens, which is never cached;
* ``take_events`` (the engine step's publish);
* ``free_blocks`` of all the request's blocks in reverse, under the request's session
  (``retention.freeing``, exactly what the patched ``KVCacheManager.free`` does), so the
  plugin records each freed block's owner and files it in the session's eviction class; the
  partial block goes to the head of the queue (no hash), and the next request reuses it.

Requests are distinct apart from the system prompt, so once the pool is full each allocated
block but the reused partial one evicts a cached one (``BlockRemoved``, under the plugin labelled with the hash's first
admitter). Plain rounds run vLLM unpatched and free with ``free_blocks`` alone. The figure is
time per allocated block; rounds alternate plain and patched to spread machine noise over
both, and the best round of each counts.

``overhead_pct`` is the headline: what the plugin adds to every allocation, caching and free,
with no directives. ``directives_overhead_pct`` is informational: the same cycles with one
``retain`` per finished request (TTL of ``RETAIN_CYCLES`` cycles on a cycle clock, then expiry
to the low class), so it also pays for re-classing the session's free blocks twice per request.
``offload_directives_overhead_pct`` is the same with the offload pair the policy sends a paused
program instead: ``offload`` when a request finishes (park in the host tier, demote on the GPU)
and ``prefetch`` when the session's next request arrives (favour in the tier, undo the demotion).
The patched rounds have a host tier (vLLM's ``CPUOffloadingManager``, patched, holding nothing:
the bench times the plugin's side, looking the session's blocks up there, not the connector's
stores), so every directive also pays for those lookups.

Each figure is also given in CPU time per block (``*_cpu_us_per_block``, process time, best
round), which a busy neighbour on a shared machine disturbs less than wall time.
"""

from __future__ import annotations

import gc
import json
import sys
import time

from vllm import envs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from sluice_vllm_plugin import host_tier, labels, retention
from sluice_vllm_plugin.directive_envelope import (KvOffload, KvPrefetch, KvRetain, OffloadPayload,
                                                  PrefetchPayload, RetainPayload)

BLOCK = 16
SHARED_BLOCKS = 8
PREFILL_BLOCKS = 40
DECODE_BLOCKS = 16
FULL_BLOCKS = SHARED_BLOCKS + PREFILL_BLOCKS + DECODE_BLOCKS
BLOCKS_PER_REQUEST = FULL_BLOCKS + 1       # the last one partly filled
POOL_BLOCKS = 4096
SESSIONS = 50
RETAIN_CYCLES = 20
# rounds per mode (best of): the 2-core machine is shared, and a busy spell should not decide
ROUNDS = 10
DIRECTIVE_ROUNDS = 4


def _requests(n: int, hasher) -> list[Request]:
    shared = [j % 997 for j in range(BLOCK * SHARED_BLOCKS)]
    own_tokens = BLOCK * (FULL_BLOCKS - SHARED_BLOCKS) + BLOCK // 2
    out = []
    for i in range(n):
        own = [(i * 7919 + j) % 1000 for j in range(own_tokens)]
        params = SamplingParams(max_tokens=1, extra_args={"continuation_id": f"c{i}"})
        out.append(Request(f"r{i}", shared + own, params, None, block_hasher=hasher,
                           session_id=f"s{i % SESSIONS}"))
    return out


def _round(requests: list[Request], patched: bool,
           directives: str | None = None) -> tuple[float, float, int]:
    """Wall and CPU seconds of one round, and the blocks it allocated. ``directives``: None,
    ``"retain"`` or ``"offload"`` (see the module docstring)."""
    pool = BlockPool(num_gpu_blocks=POOL_BLOCKS, enable_caching=True, hash_block_size=BLOCK,
                     enable_kv_cache_events=True)
    state = retention.state(pool) if patched else None
    # the patched CPUOffloadingManager registers itself as a host tier for directives to reach
    tier = (CPUOffloadingManager(num_chunks=POOL_BLOCKS)
            if patched and directives == "offload" else None)
    offloaded: set[str] = set()
    cycle = [0.0]
    if state is not None:
        state.clock = lambda: cycle[0]
    end_prefill = SHARED_BLOCKS + PREFILL_BLOCKS
    allocated = 0
    gc.collect()       # a full collection of the previous round's garbage would land in this one
    start = time.perf_counter()
    start_cpu = time.process_time()
    for request in requests:
        if directives == "offload" and request.session_id in offloaded:
            # the paused program resumes: the policy prefetches it before its request
            state.post(KvPrefetch(PrefetchPayload(request.session_id, priority=80,
                                                   deadline_s=RETAIN_CYCLES)))
            offloaded.discard(request.session_id)
        hits = []
        for block_hash in request.block_hashes[:SHARED_BLOCKS]:
            got = pool.get_cached_block(block_hash, [0])
            if got is None:
                break
            hits.append(got[0])
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(end_prefill - len(hits))
        pool.cache_full_blocks(request, blocks, len(hits), end_prefill, BLOCK, 0)
        for k in range(end_prefill, FULL_BLOCKS):
            blocks += pool.get_new_blocks(1)
            pool.cache_full_blocks(request, blocks, k, k + 1, BLOCK, 0)
        blocks += pool.get_new_blocks(1)
        pool.take_events()
        allocated += BLOCKS_PER_REQUEST - len(hits)
        if patched:
            with retention.freeing(pool, request.session_id):
                pool.free_blocks(reversed(blocks))
            if directives == "retain":
                state.post(KvRetain(RetainPayload(request.session_id, 80, RETAIN_CYCLES)))
            elif directives == "offload":
                state.post(KvOffload(OffloadPayload(request.session_id)))
                offloaded.add(request.session_id)
            cycle[0] += 1.0
        else:
            pool.free_blocks(reversed(blocks))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    del tier      # kept alive to here: host tiers are held weakly
    return seconds, cpu_seconds, allocated


def _compare(requests: list[Request], directives: str | None,
             rounds: int) -> dict[str, float]:
    """Best wall and CPU seconds per block, plain and patched."""
    plain, patched, plain_cpu, patched_cpu = [], [], [], []
    for i in range(rounds):
        for mode in (("plain", "patched") if i % 2 == 0 else ("patched", "plain")):
            if mode == "patched":
                labels.apply()
                retention.apply()
                host_tier.apply()
                try:
                    seconds, cpu_seconds, blocks = _round(requests, True, directives)
                finally:
                    host_tier.remove()
                    retention.remove()
                    labels.remove()
                patched.append(seconds / blocks)
                patched_cpu.append(cpu_seconds / blocks)
            else:
                seconds, cpu_seconds, blocks = _round(requests, False)
                plain.append(seconds / blocks)
                plain_cpu.append(cpu_seconds / blocks)
    return {"plain": min(plain), "patched": min(patched),
            "plain_cpu": min(plain_cpu), "patched_cpu": min(patched_cpu)}


def _pct(over: float, base: float) -> float:
    return (over / base - 1.0) * 100.0


def main() -> int:
    # The engine core caches vLLM's environment settings once it is up (EngineCore.__init__);
    # without that, every event's hash conversion re-reads os.environ, which would inflate the
    # plain figure and hide the plugin's share.
    envs.enable_envs_cache()
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
    requests = _requests(int(sys.argv[1]) if len(sys.argv) > 1 else 600, hasher)
    _round(requests[:50], False)  # warm-up
    base = _compare(requests, directives=None, rounds=ROUNDS)
    retain = _compare(requests, directives="retain", rounds=DIRECTIVE_ROUNDS)
    offload = _compare(requests, directives="offload", rounds=DIRECTIVE_ROUNDS)
    print(json.dumps({
        "plain_us_per_block": base["plain"] * 1e6,
        "patched_us_per_block": base["patched"] * 1e6,
        "plain_cpu_us_per_block": base["plain_cpu"] * 1e6,
        "patched_cpu_us_per_block": base["patched_cpu"] * 1e6,
        "directives_patched_cpu_us_per_block": retain["patched_cpu"] * 1e6,
        "offload_directives_patched_cpu_us_per_block": offload["patched_cpu"] * 1e6,
        "overhead_pct": _pct(base["patched"], base["plain"]),
        "overhead_cpu_pct": _pct(base["patched_cpu"], base["plain_cpu"]),
        "directives_overhead_pct": _pct(retain["patched"], retain["plain"]),
        "directives_overhead_cpu_pct": _pct(retain["patched_cpu"], retain["plain_cpu"]),
        "offload_directives_overhead_pct": _pct(offload["patched"], offload["plain"]),
        "offload_directives_overhead_cpu_pct": _pct(offload["patched_cpu"], offload["plain_cpu"]),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
