"""Runs in vLLM's venv: replays operation sequences on vLLM 0.32's CPU offloading manager.

Reads a JSON list of sequences from stdin; each is ``{"num_chunks": N, "ops": [...]}`` with ops
``{"op": name, "req": id, "keys": [int, ...], "positions": [int, ...]}``. Writes, per op, what
the manager answered, what it holds (key, ready) and the events it emitted, as JSON on stdout.
Keys are ints on the wire and block hashes (8 bytes, big-endian) for vLLM.
"""

import json
import sys

from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


def to_key(n: int):
    return make_offload_key(n.to_bytes(8, "big"), 0)


def from_key(key) -> int:
    return int.from_bytes(get_offload_block_hash(key), "big")


def held(manager: CPUOffloadingManager) -> list[list[int]]:
    chunks = manager._policy.chunks  # the policy's own table: what the tier holds
    return sorted([from_key(key), int(chunk.is_ready)] for key, chunk in chunks.items())


def run(sequence: dict) -> list[dict]:
    manager = CPUOffloadingManager(num_chunks=sequence["num_chunks"], cache_policy="lru",
                                   enable_events=True)
    contexts: dict[str, ReqContext] = {}
    out = []
    for op in sequence["ops"]:
        req = op["req"]
        context = contexts.get(req)
        if context is None:
            context = contexts[req] = ReqContext(req_id=req)
            manager.on_new_request(context)
        keys = [to_key(k) for k in op["keys"]]
        for key, position in zip(keys, op.get("positions", ())):
            context.set_offload_key_position(key, position)
        name = op["op"]
        answer = None
        if name == "lookup":
            answer = [{LookupResult.MISS: "miss", LookupResult.HIT: "hit",
                       LookupResult.HIT_PENDING: "hit_pending"}[manager.lookup(k, context)]
                      for k in keys]
        elif name == "prepare_store":
            result = manager.prepare_store(keys, context)
            answer = None if result is None else {
                "stored": [from_key(k) for k in result.keys_to_store],
                "evicted": [from_key(k) for k in result.evicted_keys]}
        elif name == "complete_store":
            manager.complete_store(keys, context)
        elif name == "prepare_load":
            manager.prepare_load(keys, context)
        elif name == "complete_load":
            manager.complete_load(keys, context)
        elif name == "touch":
            manager.touch(keys, context)
        elif name == "finish":
            manager.on_request_finished(context)
            del contexts[req]
        else:
            raise ValueError(name)
        events = [{"removed": e.removed, "medium": e.medium.value,
                   "keys": [from_key(k) for k in e.keys]} for e in manager.take_events()]
        out.append({"answer": answer, "held": held(manager), "events": events})
    return out


def main() -> None:
    sequences = json.load(sys.stdin)
    json.dump([run(sequence) for sequence in sequences], sys.stdout)


if __name__ == "__main__":
    main()
