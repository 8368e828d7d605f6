"""Drive vLLM's scheduler-side host KV tier (``CPUOffloadingManager``, LRU policy) next to a real
``BlockPool``, with and without Sluice's plugin, and print one JSON object.

Run in the vLLM venv with the repository on ``PYTHONPATH``:

    PYTHONPATH=. .venv-vllm/bin/python tests/fidelity/host_tier_driver.py

The GPU→CPU copy itself needs a CUDA or XPU device (``CPUOffloadingSpec.get_worker``,
``vllm/v1/kv_offload/cpu/spec.py``), so a store is what the offloading connector's scheduler does
around it: ``prepare_store`` of a request's block keys as they are computed, then
``complete_store`` as the worker would report it (``update_connector_output``).

Scenarios (each a key of the output):

* ``plain_equal``: a seeded mix of stores, touches and loads on a plain manager and on one built
  with the plugin applied but no directive: the evicted keys, in order, and the final contents.
* ``offload``: sessions A, B, C each run one request (GPU blocks cached, stored to the tier,
  freed under the session); ``kv.offload`` for A; then new stores push the tier to evict.
* ``prefetch``: the same, with ``kv.prefetch`` for A (A is the least recent in the tier), then
  stores that need fewer chunks than the others hold, then more than all the others hold.
* ``prefetch_load``: a prefetch ends when a request loads the session's keys.
* ``offload_without_tier``: ``kv.offload`` on a pool in a process with no host tier demotes.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from sluice_vllm_plugin import host_tier, labels, retention  # noqa: E402
from sluice_vllm_plugin.directive_envelope import (KvOffload, KvPrefetch,  # noqa: E402
                                                  OffloadPayload, PrefetchPayload)

kcu.init_none_hash(sha256)
BS = 4
BLOCKS_PER_SESSION = 3
CTX = ReqContext(req_id="driver")


def request(rid: str, base: int, session: str) -> Request:
    tokens = list(range(base, base + BS * BLOCKS_PER_SESSION))
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=kcu.get_request_block_hasher(BS, sha256), session_id=session)


def store(manager, keys) -> list:
    """prepare_store + complete_store; the keys the manager evicted for it (hex)."""
    out = manager.prepare_store(keys, CTX)
    if out is None:
        return ["REFUSED"]
    manager.complete_store(out.keys_to_store, CTX)
    return [k.hex() for k in out.evicted_keys]


def run_session(pool, manager, session: str, base: int) -> list:
    """One request of ``session``: allocate, cache, store to the tier, free. Its keys (hex)."""
    req = request(f"r-{session}", base, session)
    blocks = pool.get_new_blocks(BLOCKS_PER_SESSION)
    pool.cache_full_blocks(req, blocks, 0, BLOCKS_PER_SESSION, BS, 0)
    keys = host_tier.offload_keys(blocks)
    store(manager, keys)
    with retention.freeing(pool, session):
        pool.free_blocks(reversed(blocks))
    return keys


def contents(manager) -> list:
    return sorted(k.hex() for k in manager._policy.chunks)


def fresh_keys(tag: int, n: int) -> list:
    return [bytes([tag, i]) * 8 + (0).to_bytes(4, "big") for i in range(n)]


def sc_plain_equal(patched: bool) -> dict:
    if patched:
        host_tier.apply()
    try:
        manager = CPUOffloadingManager(num_chunks=16)
        rng = random.Random(11)
        universe = fresh_keys(9, 40)
        evicted = []
        for _ in range(300):
            r = rng.random()
            keys = rng.sample(universe, rng.randint(1, 5))
            if r < 0.6:
                evicted.append(store(manager, keys))
            elif r < 0.8:
                manager.touch(keys, CTX)
            else:
                held = [k for k in keys if manager._policy.get(k) is not None]
                if held:
                    manager.prepare_load(held, CTX)
                    manager.complete_load(held, CTX)
        return {"evicted": evicted, "contents": contents(manager),
                "installed": host_tier.tier(manager) is not None}
    finally:
        host_tier.remove()


def _setup(num_chunks: int):
    labels.apply()
    retention.apply()
    host_tier.apply()
    pool = BlockPool(32, True, BS, enable_kv_cache_events=False)
    manager = CPUOffloadingManager(num_chunks=num_chunks)
    host = host_tier.tier(manager)
    clock = [0.0]
    host.clock = retention.state(pool).clock = lambda: clock[0]
    keys = {s: run_session(pool, manager, s, base)
            for s, base in (("A", 100), ("B", 200), ("C", 300))}
    return pool, manager, host, keys, clock


def _teardown() -> None:
    # a manager and its HostTier refer to each other: collect them, so the next scenario's
    # directives reach its own tier only
    gc.collect()
    host_tier.remove()
    retention.remove()
    labels.remove()


def sc_offload() -> dict:
    pool, manager, host, keys, _ = _setup(num_chunks=9)
    try:
        st = retention.state(pool)
        st.post(KvOffload(OffloadPayload("A")))
        st.drain()
        order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        a_blocks = [b.block_id for b in st.queue.owned("A")]
        evicted = store(manager, fresh_keys(1, 3))      # the tier is full: 3 go
        return {"keys": {s: [k.hex() for k in v] for s, v in keys.items()},
                "parked": [k.hex() for k in host.parked.get("A", [])],
                "a_class": st.class_of("A"), "a_blocks": a_blocks, "free_order": order,
                "evicted": evicted, "contents": contents(manager), "not_held": host.not_held}
    finally:
        _teardown()


def sc_prefetch() -> dict:
    pool, manager, host, keys, clock = _setup(num_chunks=9)
    try:
        st = retention.state(pool)
        st.post(KvOffload(OffloadPayload("A")))
        st.drain()
        # B and C become more recent than A in the tier (a touch makes its first key the most
        # recent, so C is next after A): A is LRU again
        manager.touch(keys["B"] + keys["C"], CTX)
        st.post(KvPrefetch(PrefetchPayload("A", priority=60, deadline_s=10.0)))
        st.drain()
        first = store(manager, fresh_keys(1, 3))        # C's 3 (LRU after A) go, not A's
        # 7 to evict, 6 unfavoured (B's 3, the 3 new): one of A's goes too, a bias, not a pin
        second = store(manager, fresh_keys(2, 7))
        a_class = st.class_of("A")
        return {"keys": {s: [k.hex() for k in v] for s, v in keys.items()},
                "first": first, "second": second, "a_class": a_class,
                "favoured_after": sorted(host.favoured)}
    finally:
        _teardown()


def sc_prefetch_expiry_and_load() -> dict:
    pool, manager, host, keys, clock = _setup(num_chunks=9)
    try:
        st = retention.state(pool)
        st.post(KvPrefetch(PrefetchPayload("A", priority=60, deadline_s=5.0)))
        st.drain()
        favoured = sorted(host.favoured)
        clock[0] = 6.0
        # deadline passed: plain LRU; the prefetch's touch made A the most recent, so B goes
        expired = store(manager, fresh_keys(1, 3))
        st.post(KvPrefetch(PrefetchPayload("C", priority=60)))
        st.drain()
        favoured_before_load = sorted(host.favoured)
        manager.prepare_load(keys["C"][:1], CTX)
        manager.complete_load(keys["C"][:1], CTX)
        return {"keys": {s: [k.hex() for k in v] for s, v in keys.items()},
                "favoured": favoured, "expired_evicts": expired,
                "favoured_before_load": favoured_before_load,
                "favoured_after_load": sorted(host.favoured)}
    finally:
        _teardown()


def sc_offload_without_tier() -> dict:
    labels.apply()
    retention.apply()
    try:
        pool = BlockPool(16, True, BS, enable_kv_cache_events=False)
        st = retention.state(pool)
        blocks = pool.get_new_blocks(BLOCKS_PER_SESSION)
        pool.cache_full_blocks(request("r", 100, "A"), blocks, 0, BLOCKS_PER_SESSION, BS, 0)
        with retention.freeing(pool, "A"):
            pool.free_blocks(reversed(blocks))
        st.post(KvOffload(OffloadPayload("A")))
        st.drain()
        after_offload = st.class_of("A")
        st.post(KvPrefetch(PrefetchPayload("A", priority=50)))
        st.drain()
        return {"after_offload": after_offload, "after_prefetch": st.class_of("A"),
                "dropped": st.dropped}
    finally:
        retention.remove()
        labels.remove()


def main() -> int:
    out = {
        "plain_equal": {"plain": sc_plain_equal(False), "patched": sc_plain_equal(True)},
        "offload": sc_offload(),
        "prefetch": sc_prefetch(),
        "prefetch_expiry_and_load": sc_prefetch_expiry_and_load(),
        "offload_without_tier": sc_offload_without_tier(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
