"""Fidelity: ``sim.host_tier.HostTier`` holds and evicts exactly what vLLM 0.32's CPU offloading
manager does (``vllm/v1/kv_offload/cpu/manager.py`` with the default LRU policy).

Seeded sequences of what the offloading connector's scheduler side asks of the manager —
requests storing their prefix chains (with eviction, including a tier too full to store),
stores completing, lookups (miss / pending / hit), loads pinning chunks and completing,
touches, and requests finishing (which re-ranks what they used) — are run once through vLLM's
manager by ``vllm_offload_driver.py`` in the vLLM venv and replayed here on the simulator's
tier. After every op the two must agree on the answer (lookup results; stored and evicted keys,
or a refused store), on every chunk held and whether it is ready, and on the events (medium
"CPU", stored or removed, which keys).

The vLLM venv is found (or built) as for the block-pool fidelity test; it never skips.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from scheduler.kv_events import BlockRemoved
from sim.host_tier import HostTier
from tests.support.vllm_venv import ROOT, vllm_python

DRIVER = Path(__file__).resolve().parent / "vllm_offload_driver.py"
SEEDS = list(range(20))
OPS_PER_SEQUENCE = 250
BLOCK_SIZE = 16


def _sequence(seed: int) -> dict:
    """Ops that are valid at each point: generated against the simulator's tier (which is
    then checked against vLLM)."""
    rng = random.Random(seed)
    num_chunks = rng.choice([8, 12, 20])
    tier = HostTier(num_chunks, BLOCK_SIZE, enable_events=False)
    # prefix chains: programs share a root, each request extends its program's chain
    chains = [[1000 * p + i for i in range(rng.randint(4, 14))] for p in range(4)]
    live: dict[str, dict] = {}  # request → {"chain", "offered", "loading"}
    pending_stores: list[list[int]] = []
    ops: list[dict] = []
    next_req = 0

    def emit(op: str, req: str, keys: list[int], positions: list[int] | None = None,
             first_block: int = 0) -> None:
        ops.append({"op": op, "req": req, "keys": keys, "positions": positions or [],
                    "first_block": first_block})

    while len(ops) < OPS_PER_SEQUENCE:
        roll = rng.random()
        if roll < 0.15 or not live:
            next_req += 1
            req = f"r{next_req}"
            chain = chains[rng.randrange(len(chains))]
            length = rng.randint(1, len(chain))
            live[req] = {"chain": chain[:length], "offered": 0, "loading": []}
            keys = chain[:length]
            emit("lookup", req, keys, [BLOCK_SIZE * (i + 1) for i in range(length)])
            hits = tier.loadable_prefix(keys)
            if hits and rng.random() < 0.7:
                emit("prepare_load", req, keys[:hits], first_block=0)
                tier.prepare_load(keys[:hits], req, 0)
                live[req]["loading"] = keys[:hits]
                live[req]["offered"] = hits
            continue
        req = rng.choice(sorted(live))
        state = live[req]
        if roll < 0.45 and state["offered"] < len(state["chain"]):
            upto = rng.randint(state["offered"] + 1, len(state["chain"]))
            start = 0 if rng.random() < 0.3 else state["offered"]  # re-offers happen too
            keys = state["chain"][start:upto]
            emit("prepare_store", req, keys, first_block=start)
            outcome = tier.prepare_store(keys, req, start)
            if outcome is not None:
                state["offered"] = upto
                if outcome.stored:
                    pending_stores.append(outcome.stored)
        elif roll < 0.65 and pending_stores:
            keys = pending_stores.pop(rng.randrange(len(pending_stores)))
            emit("complete_store", req, keys)
            tier.complete_store(keys)
        elif roll < 0.75 and state["loading"]:
            emit("complete_load", req, state["loading"])
            tier.complete_load(state["loading"])
            state["loading"] = []
        elif roll < 0.82:
            keys = [k for k in state["chain"] if k in tier]
            rng.shuffle(keys)
            keys = sorted(keys[:rng.randint(0, len(keys))])
            emit("touch", req, keys)
            tier.touch(keys)
        elif roll < 0.9:
            emit("lookup", req, state["chain"])
        elif not state["loading"]:
            emit("finish", req, [])
            tier.request_finished(req)
            del live[req]
    return {"num_chunks": num_chunks, "ops": ops}


@pytest.fixture(scope="module")
def fidelity_runs() -> dict[int, tuple[dict, list[dict]]]:
    sequences = {seed: _sequence(seed) for seed in SEEDS}
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    proc = subprocess.run([str(vllm_python()), str(DRIVER)], cwd=ROOT, env=env,
                          input=json.dumps([sequences[s] for s in SEEDS]),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    return {seed: (sequences[seed], result) for seed, result in zip(SEEDS, results)}


def _replay(op: dict, tier: HostTier):
    name, req, keys = op["op"], op["req"], op["keys"]
    if name == "lookup":
        return [tier.lookup(k) for k in keys]
    if name == "prepare_store":
        outcome = tier.prepare_store(keys, req, op["first_block"])
        return None if outcome is None else {"stored": outcome.stored, "evicted": outcome.evicted}
    if name == "complete_store":
        tier.complete_store(keys)
    elif name == "prepare_load":
        tier.prepare_load(keys, req, op["first_block"])
    elif name == "complete_load":
        tier.complete_load(keys)
    elif name == "touch":
        tier.touch(keys)
    elif name == "finish":
        tier.request_finished(req)
    return None


@pytest.mark.parametrize("seed", SEEDS)
def test_sim_host_tier_matches_vllm(fidelity_runs, seed):
    sequence, expected = fidelity_runs[seed]
    tier = HostTier(sequence["num_chunks"], BLOCK_SIZE)
    for step, (op, want) in enumerate(zip(sequence["ops"], expected)):
        answer = _replay(op, tier)
        held = sorted([k, int(tier.is_ready(k))] for k in tier.keys_lru_first())
        events = [{"removed": isinstance(e, BlockRemoved), "medium": e.medium,
                   "keys": list(e.block_hashes)} for e in tier.take_events()]
        got = {"answer": answer, "held": held, "events": events}
        assert got == want, f"seed {seed}, op {step} {op}"


def test_sequences_cover_the_interesting_paths(fidelity_runs):
    """Guards the generator: the runs must evict, refuse a store, see pending and hit lookups."""
    seen: Counter = Counter()
    for sequence, expected in fidelity_runs.values():
        for op, want in zip(sequence["ops"], expected):
            answer = want["answer"]
            if op["op"] == "prepare_store":
                seen["refused" if answer is None else "store"] += 1
                if answer and answer["evicted"]:
                    seen["evicted"] += 1
            if op["op"] == "lookup":
                seen.update(answer)
            seen[op["op"]] += 1
    for path in ("store", "refused", "evicted", "hit", "miss", "hit_pending", "touch", "finish",
                 "prepare_load", "complete_load", "complete_store"):
        assert seen[path] > 0, (path, seen)
