"""Drive vLLM's real ``BlockPool`` with Sluice's plugin (``sluice_vllm_plugin``) applied.

Run in the vLLM venv with the repository on ``PYTHONPATH`` (the plugin is not installed there):

    PYTHONPATH=. .venv-vllm/bin/python tests/fidelity/vllm_plugin_driver.py in.json -o out.json

Input ``{"retention": [{"id", "num_blocks", "block_size", "compacting"?, "ops": [...]}, ...]}``; output
``{"vllm_version", "scenarios": {name: result}, "retention": [{"id", "results": [...]}]}``.
The label scenarios (V1a / V1b) are fixed and always run; see ``SCENARIOS``. Retention ops:

* ``{"op": "arrive", "rid", "tokens", "session", "continuation"?}``: prefix lookup (at most ``(n-1)//bs`` blocks),
  ``touch``, ``get_new_blocks`` for the rest, ``cache_full_blocks`` for the full blocks. When the
  pool is short the hits are freed again (as the session) and the request is dropped.
* ``{"op": "free", "rid"}``: ``free_blocks(reversed(blocks))`` inside ``retention.freeing``.
* ``{"op": "retain", "session", "priority", "ttl"}`` / ``{"op": "demote"|"release", "session"}``:
  posted to the pool's inbox, then drained (a step boundary).
* ``{"op": "tick", "dt"}``: advances the pool's retention clock.

Each op reports ``status``, ``hits``, ``new``, ``hashes`` (arrive), ``removed`` (``[hash,
continuation_id, num_tokens]`` of the BlockRemoved events, in order) and ``free_queue`` (block
ids, next to be handed out first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import msgspec  # noqa: E402
import vllm  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import sluice_vllm_plugin as vllm_plugin  # noqa: E402
from sluice_vllm_plugin import labels, retention  # noqa: E402
from sluice_vllm_plugin.directive_envelope import (KvDemote, KvRelease, KvRetain,  # noqa: E402
                                                  RetainPayload, SessionPayload)

_enc = msgspec.msgpack.Encoder()
kcu.init_none_hash(sha256)


def _hasher(bs):
    return kcu.get_request_block_hasher(bs, sha256)


def mkreq(rid, toks, bs, session=None, cid=None, mode=None):
    extra = {}
    if cid is not None:
        extra["continuation_id"] = cid
    if mode is not None:
        extra["kv_cache_report_mode"] = mode
    sp = SamplingParams(max_tokens=1, extra_args=extra or None)
    return Request(rid, list(toks), sp, None, block_hasher=_hasher(bs), session_id=session)


def wire_hashes(req):
    return [kcu.maybe_convert_block_hash(h) for h in req.block_hashes]


def ev_json(ev):
    wire = _enc.encode(ev)
    return {"fields": msgspec.msgpack.decode(wire), "wire": wire.hex(), "cls": type(ev).__name__}


def take(pool):
    return [ev_json(e) for e in pool.take_events()]


def prefix_hits(pool, req, bs):
    """The request's cached prefix (at most ``(n-1)//bs`` blocks), touched, as KVCacheManager
    looks it up."""
    hits = []
    for h in req.block_hashes[: (req.num_tokens - 1) // bs]:
        got = pool.get_cached_block(h, [0])
        if got is None:
            break
        hits.append(got[0])
    pool.touch(hits)
    return hits


def admit(pool, req, bs, lookup=True):
    """Lookup + touch + allocate + cache, as KVCacheManager does. Returns the blocks."""
    hits = prefix_hits(pool, req, bs) if lookup else []
    need = -(-req.num_tokens // bs) - len(hits)
    blocks = hits + pool.get_new_blocks(need)
    pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
    return hits, blocks


# -- label scenarios ----------------------------------------------------------------------------

BS = 4
A = list(range(100, 112))          # 3 full blocks
B = list(range(200, 212))


def sc_v1a():
    pool = BlockPool(12, True, BS, enable_kv_cache_events=True)
    r1 = mkreq("r1", A[:10], BS, session="s1", cid="c1")
    _, blocks = admit(pool, r1, BS)
    full = take(pool)
    r2 = mkreq("r2", A[:8] + [7, 7, 7], BS, session="s2", cid="c2", mode="full")
    hits, _ = admit(pool, r2, BS)
    # the coordinator's full-report call, as KVCacheManager.get_computed_blocks makes it
    pool.emit_cached_block_events(r2, len(hits), BS, 0)
    reused = take(pool)
    # partial entry: group block size 8 over hash block size 4
    pool8 = BlockPool(6, True, BS, enable_kv_cache_events=True)
    r3 = mkreq("r3", A[:6], BS, session="s3", cid="c3")
    blk = pool8.get_new_blocks(1)[0]
    pool8.cache_partial_block(r3, blk, 4, 0, 8)
    partial = take(pool8)
    r4 = mkreq("r4", A[:10], BS, session="s4")          # no continuation id
    pool9 = BlockPool(6, True, BS, enable_kv_cache_events=True)
    admit(pool9, r4, BS)
    unlabelled = take(pool9)
    return {"full": full, "reused": reused, "hits": len(hits), "partial": partial,
            "unlabelled": unlabelled, "hashes_r1": wire_hashes(r1)}


def _evict_all(pool):
    n = pool.get_num_free_blocks()
    got = pool.get_new_blocks(n)
    ev = take(pool)
    pool.free_blocks(got)
    return ev


def sc_v1b():
    pool = BlockPool(16, True, BS, enable_kv_cache_events=True)
    r1 = mkreq("r1", A[:10], BS, session="s1", cid="c1")
    _, b1 = admit(pool, r1, BS)
    r2 = mkreq("r2", A[:8] + [5, 5, 5, 5, 5], BS, session="s2", cid="c2", mode="full")
    h2, b2 = admit(pool, r2, BS)
    pool.emit_cached_block_events(r2, len(h2), BS, 0)
    # a duplicate: same prompt as r1 cached again in its own blocks, not reading the cache
    r3 = mkreq("r3", A[:10], BS, session="s3", cid="c3")
    _, b3 = admit(pool, r3, BS, lookup=False)
    stores = take(pool)
    side_before = sorted([v[0], v[1]] for v in labels.admitted(pool).values())
    pool.free_blocks(reversed(b1))
    pool.free_blocks(reversed(b2))
    pool.free_blocks(reversed(b3))
    removed = _evict_all(pool)
    side_after = len(labels.admitted(pool))
    # a fresh admission of the same prefix after every copy is gone is the new first admitter
    r4 = mkreq("r4", A[:10], BS, session="s4", cid="c4")
    _, b4 = admit(pool, r4, BS)
    pool.free_blocks(reversed(b4))
    take(pool)
    removed_again = _evict_all(pool)
    return {"stores": stores, "removed": removed, "side_before": side_before,
            "side_after": side_after, "removed_again": removed_again,
            "hashes": wire_hashes(r1), "hashes_r2": wire_hashes(r2), "b1": [b.block_id for b in b1],
            "b2": [b.block_id for b in b2]}


def sc_move():
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    r1 = mkreq("r1", A[:8], BS, session="s1", cid="cm")
    _, b1 = admit(pool, r1, BS)
    dst = pool.get_new_blocks(1)[0]
    pool.move_block_hashes(b1[1], dst)
    moved_events = take(pool)
    pool.free_blocks(reversed(b1))
    pool.free_blocks([dst])
    removed = _evict_all(pool)
    return {"moved_events": moved_events, "removed": removed, "hashes": wire_hashes(r1),
            "side_after": len(labels.admitted(pool))}


def sc_reset():
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    r1 = mkreq("r1", A[:8], BS, session="s1", cid="cr")
    _, b1 = admit(pool, r1, BS)
    side_before = len(labels.admitted(pool))
    failed = pool.reset_prefix_cache()           # blocks in use: fails, keeps the map
    side_after_fail = len(labels.admitted(pool))
    pool.free_blocks(reversed(b1))
    ok = pool.reset_prefix_cache()
    side_after = len(labels.admitted(pool))
    events = take(pool)
    r2 = mkreq("r2", A[:8], BS, session="s2", cid="cr2")
    _, b2 = admit(pool, r2, BS)
    pool.free_blocks(reversed(b2))
    take(pool)
    removed = _evict_all(pool)
    return {"side_before": side_before, "failed": failed, "side_after_fail": side_after_fail,
            "ok": ok, "side_after": side_after, "events": events, "removed": removed}


def sc_events_off():
    pool = BlockPool(8, True, BS, enable_kv_cache_events=False)
    r1 = mkreq("r1", A[:8], BS, session="s1", cid="c1")
    _, b1 = admit(pool, r1, BS)
    blk = pool.get_new_blocks(1)[0]
    pool.cache_partial_block(mkreq("rp", B[:6], BS, cid="cp"), blk, 4, 0, 4)
    pool.free_blocks(reversed(b1))
    pool.free_blocks([blk])
    kept = len(labels.admitted(pool)) + len(pool.__dict__.get("_sluice_admitted") or {})
    pool.get_new_blocks(pool.get_num_free_blocks())
    return {"kept": kept, "kept_after": len(labels.admitted(pool)),
            "events": take(pool), "queue": len(pool.kv_event_queue)}


def sc_hashes():
    ra = mkreq("ra", A, BS, session="s", cid="label-a")
    rb = mkreq("rb", A, BS, session="other", cid="label-b")
    rn = mkreq("rn", A, BS)
    pool = BlockPool(12, True, BS, enable_kv_cache_events=True)
    _, ba = admit(pool, ra, BS)
    hb, bb = admit(pool, rb, BS)
    stores = take(pool)
    return {"a": wire_hashes(ra), "b": wire_hashes(rb), "n": wire_hashes(rn),
            "ba": [b.block_id for b in ba], "hits_b": [b.block_id for b in hb], "stores": stores}


def sc_old_consumer():
    pool = BlockPool(8, True, BS, enable_kv_cache_events=True)
    r1 = mkreq("r1", A[:8], BS, session="s1", cid="c-old")
    _, b1 = admit(pool, r1, BS)
    pool.free_blocks(reversed(b1))
    pool.get_new_blocks(pool.get_num_free_blocks())
    events = pool.take_events()
    batch = KVEventBatch(ts=1.5, events=events, data_parallel_rank=0)
    payload = _enc.encode(batch)
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    plain = []
    for ev in decoded.events:
        plain.append({"cls": type(ev).__name__, "module": type(ev).__module__,
                      "hashes": ev.block_hashes, "session_id": getattr(ev, "session_id", None)})
    return {"payload": payload.hex(), "decoded": plain,
            "orig": [{"cls": type(e).__name__, "hashes": e.block_hashes} for e in events]}


SCENARIOS = {"v1a": sc_v1a, "v1b": sc_v1b, "move": sc_move, "reset": sc_reset,
             "events_off": sc_events_off, "hashes": sc_hashes, "old_consumer": sc_old_consumer}


# -- retention sequences ------------------------------------------------------------------------


def run_retention(seq):
    """One sequence; ``"compacting": true`` runs it with the free queue compacting and the
    ownership logs sweeping as often as they can (their thresholds at the minimum)."""
    saved = retention.COMPACT_SLACK, retention.SWEEP_MIN
    if seq.get("compacting"):
        retention.COMPACT_SLACK, retention.SWEEP_MIN = 0, 1
    try:
        return _run_retention(seq)
    finally:
        retention.COMPACT_SLACK, retention.SWEEP_MIN = saved


def _run_retention(seq):
    bs = int(seq["block_size"])
    pool = BlockPool(int(seq["num_blocks"]), True, bs, enable_kv_cache_events=True)
    r = retention.state(pool)
    now = [0.0]
    r.clock = lambda: now[0]
    live = {}
    out = []
    for op in seq["ops"]:
        kind = op["op"]
        res = {"status": "ok"}
        if kind == "arrive":
            req = mkreq(op["rid"], op["tokens"], bs, session=op["session"], cid=op.get("continuation"))
            res["hashes"] = wire_hashes(req)
            hits = prefix_hits(pool, req, bs)
            need = -(-req.num_tokens // bs) - len(hits)
            res["hits"] = [b.block_id for b in hits]
            try:
                new = pool.get_new_blocks(need)
            except ValueError:
                with retention.freeing(pool, op["session"]):
                    pool.free_blocks(reversed(hits))
                res["status"] = "exhausted"
            else:
                blocks = hits + new
                pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // bs, bs, 0)
                res["new"] = [b.block_id for b in new]
                live[op["rid"]] = (op["session"], blocks)
        elif kind == "free":
            if op["rid"] in live:
                session, blocks = live.pop(op["rid"])
                with retention.freeing(pool, None if op.get("anonymous") else session):
                    pool.free_blocks(reversed(blocks))
            else:
                res["status"] = "noop"
        elif kind == "retain":
            r.post(KvRetain(RetainPayload(op["session"], op["priority"], op["ttl"])))
            r.drain()
        elif kind in ("demote", "release"):
            r.post((KvDemote if kind == "demote" else KvRelease)(SessionPayload(op["session"])))
            r.drain()
        elif kind == "tick":
            now[0] += float(op["dt"])
        elif kind == "reset":
            res["reset"] = pool.reset_prefix_cache()
        else:
            raise ValueError(kind)
        res["removed"] = [[e.block_hashes[0], e.continuation_id, e.num_tokens]
                          for e in pool.take_events() if isinstance(e, BlockRemoved)]
        res["free_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        out.append(res)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("input")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    data = json.load(sys.stdin if args.input == "-" else open(args.input))
    vllm_plugin.apply_patches()
    result = {"vllm_version": vllm.__version__,
              "scenarios": {name: fn() for name, fn in SCENARIOS.items()},
              "retention": [{"id": s["id"], "results": run_retention(s)}
                            for s in data.get("retention", [])]}
    text = json.dumps(result)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
