"""Drive vLLM's real ``BlockPool`` with a JSON op list; print what it did as JSON.

Run with the vLLM venv, not Sluice's (this file imports only vLLM and the standard library):

    .venv-vllm/bin/python tests/fidelity/vllm_blockpool_driver.py ops.json [-o out.json]
    .venv-vllm/bin/python tests/fidelity/vllm_blockpool_driver.py - < ops.json

Input: ``{"sequences": [{"id": str, "num_blocks": int, "block_size": int, "ops": [op, ...]}]}``.
Each sequence gets a fresh ``BlockPool(num_blocks, enable_caching=True,
hash_block_size=block_size, enable_kv_cache_events=True)``. Ops (request ids are per sequence):

* ``{"op": "arrive", "rid", "tokens", "session", "mode", "lookup"}``: a new request, built as a
  real ``vllm.v1.request.Request`` whose block hashes come from vLLM's own hasher
  (``get_request_block_hasher`` with ``init_none_hash(sha256)``); ``mode`` is its
  ``kv_cache_report_mode`` (passed through ``SamplingParams.extra_args``, as the OpenAI server
  does). The pool calls follow ``KVCacheManager.get_computed_blocks`` / ``allocate_slots``:
  longest prefix hit with ``get_cached_block`` block by block, at most ``(num_tokens - 1) //
  block_size`` blocks (skipped when ``lookup`` is false, as for a request that does not read the
  prefix cache); ``emit_cached_block_events`` when the mode is "full" and something hit;
  ``touch`` the hits; ``get_new_blocks`` for the rest; ``cache_full_blocks`` for the full
  blocks. When ``get_new_blocks`` raises ``ValueError`` the touched hits are freed again
  (reversed) and the request is dropped.
* ``{"op": "extend", "rid", "tokens"}``: decode tokens appended to a live request
  (``append_output_token_ids``, which extends its block hashes), new blocks allocated if the
  tokens need them, newly full blocks cached. If the pool cannot supply the blocks the request
  is preempted: all its blocks are freed in reverse and it is dropped.
* ``{"op": "free", "rid"}``: ``free_blocks(reversed(blocks))``, as
  ``SingleTypeKVCacheManager.free`` does.
* ``{"op": "reset"}``: ``reset_prefix_cache()``.

Ops on a request that is not live (its arrival failed, or it was freed or preempted) are no-ops.

Output: ``{"vllm_version", "sequences": [{"id", "results": [result, ...]}]}``; one result per op
with ``status``, the op's block ids (``hits``, ``hits_manager`` = the hit recomputed with
``FullAttentionManager.find_longest_cache_hit`` as a cross-check, ``new``, ``freed``), the
request's block hashes (``hashes``: the 64-bit ints vLLM puts on the wire), and after the op
``num_free``, ``usage``, ``free_queue`` (block ids, head = next to be handed out) and
``events``: ``take_events()``, each as ``{"fields": <the msgpack map as decoded, keys in wire
order>, "wire": <msgpack bytes, hex>}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import msgspec  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

GROUP = 0
_encoder = msgspec.msgpack.Encoder()


def _event_json(event) -> dict:
    wire = _encoder.encode(event)
    return {"fields": msgspec.msgpack.decode(wire), "wire": wire.hex()}


def _wire_hashes(request: Request) -> list[int]:
    return [kcu.maybe_convert_block_hash(h) for h in request.block_hashes]


def run_sequence(seq: dict) -> list[dict]:
    bs = int(seq["block_size"])
    pool = BlockPool(num_gpu_blocks=int(seq["num_blocks"]), enable_caching=True,
                     hash_block_size=bs, enable_kv_cache_events=True)
    hasher = kcu.get_request_block_hasher(bs, sha256)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    # rid -> [request, blocks, num_cached_blocks]
    live: dict[str, list] = {}
    results: list[dict] = []

    for op in seq["ops"]:
        kind = op["op"]
        res: dict = {"op": kind}
        if kind == "arrive":
            extra = {"kv_cache_report_mode": op["mode"]} if op.get("mode") else None
            req = Request(op["rid"], list(op["tokens"]),
                          SamplingParams(max_tokens=1, extra_args=extra), None,
                          block_hasher=hasher, session_id=op.get("session"))
            res["hashes"] = _wire_hashes(req)
            hits = []
            if op.get("lookup", True):
                max_blocks = (req.num_tokens - 1) // bs
                for block_hash in req.block_hashes[:max_blocks]:
                    cached = pool.get_cached_block(block_hash, [GROUP])
                    if not cached:
                        break
                    hits.append(cached[0])
                (mgr_hits,), _ = FullAttentionManager.find_longest_cache_hit(
                    req.block_hashes, req.num_tokens - 1, [GROUP], pool, spec,
                    drop_eagle_block=False, alignment_tokens=bs)
                res["hits_manager"] = [b.block_id for b in mgr_hits]
            res["hits"] = [b.block_id for b in hits]
            if hits and getattr(req, "kv_cache_report_mode", "incremental") == "full":
                pool.emit_cached_block_events(req, len(hits), bs, GROUP)
            pool.touch(hits)
            need = -(-req.num_tokens // bs) - len(hits)
            try:
                new = pool.get_new_blocks(need)
            except ValueError:
                pool.free_blocks(reversed(hits))
                res["status"] = "fail"
            else:
                blocks = hits + new
                num_full = req.num_tokens // bs
                pool.cache_full_blocks(req, blocks, len(hits), num_full, bs, GROUP)
                live[op["rid"]] = [req, blocks, max(num_full, len(hits))]
                res["status"] = "ok"
                res["new"] = [b.block_id for b in new]
        elif kind == "extend":
            entry = live.get(op["rid"])
            if entry is None:
                res["status"] = "noop"
            else:
                req, blocks, num_cached = entry
                req.append_output_token_ids(list(op["tokens"]))
                res["hashes"] = _wire_hashes(req)
                need = -(-req.num_tokens // bs) - len(blocks)
                try:
                    new = pool.get_new_blocks(need) if need > 0 else []
                except ValueError:
                    pool.free_blocks(reversed(blocks))
                    del live[op["rid"]]
                    res["status"] = "preempted"
                    res["freed"] = [b.block_id for b in reversed(blocks)]
                else:
                    blocks.extend(new)
                    num_full = req.num_tokens // bs
                    pool.cache_full_blocks(req, blocks, num_cached, num_full, bs, GROUP)
                    entry[2] = max(num_full, num_cached)
                    res["status"] = "ok"
                    res["new"] = [b.block_id for b in new]
        elif kind == "free":
            entry = live.pop(op["rid"], None)
            if entry is None:
                res["status"] = "noop"
            else:
                blocks = entry[1]
                pool.free_blocks(reversed(blocks))
                res["status"] = "ok"
                res["freed"] = [b.block_id for b in reversed(blocks)]
        elif kind == "reset":
            res["status"] = bool(pool.reset_prefix_cache())
        else:
            raise ValueError(f"unknown op {kind!r}")
        res["num_free"] = pool.get_num_free_blocks()
        res["usage"] = pool.get_usage()
        res["free_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        res["events"] = [_event_json(e) for e in pool.take_events()]
        results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="?", default="-", help="JSON op file, or - for stdin")
    parser.add_argument("-o", "--output", default="-", help="result file, or - for stdout")
    args = parser.parse_args(argv)
    if args.ops == "-":
        spec = json.load(sys.stdin)
    else:
        with open(args.ops) as f:
            spec = json.load(f)
    kcu.init_none_hash(sha256)
    out = {
        "vllm_version": vllm.__version__,
        "sequences": [{"id": s.get("id"), "results": run_sequence(s)} for s in spec["sequences"]],
    }
    text = json.dumps(out, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
