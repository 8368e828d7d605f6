"""Fidelity: ``sim.block_pool.BlockPool`` behaves exactly like vLLM 0.32's ``BlockPool``.

Seeded random operation sequences (request arrivals that share prefixes, prefix lookups and
touches, allocation including exhaustion, caching of full blocks, decode extensions and
preemption, reverse-order frees, duplicate prompts cached twice, ``reset_prefix_cache`` both
failing and succeeding, ``kv_cache_report_mode: "full"`` reports of hits) are run once through
vLLM's real pool by ``vllm_blockpool_driver.py`` in the vLLM venv (one subprocess for all
sequences) and replayed here on the simulator's pool, with the block hashes vLLM computed.
After every op the two must agree on the outcome, the hit / allocated / freed block ids, the
free count, usage, the whole free-queue order, and the events, compared as the msgpack maps
they put on the wire: every field, the key order and the value types (see ``_canonical`` for
the one byte-level difference, which lies in ``scheduler.kv_events``, not the pool). No retention directives are used: that is the mode in
which the simulator claims to be vLLM.

The vLLM venv (``.venv-vllm``) is created with ``scripts/setup_vllm_venv.sh`` when missing;
if that fails the test fails, it never skips.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from scheduler.kv_events import EventBatchEncoder
from sim.block_pool import BlockPool, PoolExhausted
from tests.support.vllm_venv import ROOT, build_vllm_venv, vllm_python

DRIVER = Path(__file__).resolve().parent / "vllm_blockpool_driver.py"

SEEDS = list(range(30))
OPS_PER_SEQUENCE = 200

_msgpack = EventBatchEncoder()._encoder


# -- op generation --------------------------------------------------------------------------


def generate_sequence(seed: int, n_ops: int = OPS_PER_SEQUENCE) -> dict:
    """One random op sequence. Liveness is only what the generator asked for; ops on a
    request whose arrival failed (or that was preempted) are no-ops on both sides."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 4, 8, 16])
    num_blocks = rng.randint(6, 40)
    vocab = rng.choice([50, 1000, 32000])

    def rand_tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    families = [rand_tokens(rng.randint(1, 8) * bs + rng.randrange(bs)) for _ in range(rng.randint(2, 5))]
    sessions = [f"sess-{seed}-{k}" for k in range(rng.randint(1, 6))]
    prompts: list[list[int]] = []          # every prompt asked for so far
    live: dict[str, list[int]] = {}        # rid -> its tokens (prompt + extensions)
    ops: list[dict] = []
    next_rid = 0

    def new_prompt() -> list[int]:
        r = rng.random()
        if r < 0.55 or not prompts:
            base = rng.choice(families)
            if rng.random() < 0.5:
                cut = rng.randint(0, len(base) // bs) * bs          # block-aligned share
            else:
                cut = rng.randint(0, len(base))
            tokens = base[:cut] + rand_tokens(rng.randint(0, 3 * bs))
        elif r < 0.72:
            tokens = list(rng.choice(prompts))                     # exact repeat
        elif r < 0.85:
            tokens = rng.choice(prompts) + rand_tokens(rng.randint(1, 3 * bs))
        else:
            tokens = rand_tokens(rng.randint(1, 6 * bs))
        if not tokens:
            tokens = rand_tokens(1)
        # now and then ask for more than the whole pool
        limit = (num_blocks + 2) * bs if rng.random() < 0.05 else (num_blocks // 2 + 1) * bs
        return tokens[:limit] if len(tokens) > limit else tokens

    def arrive(tokens: list[int], lookup: bool = True) -> None:
        nonlocal next_rid
        rid = f"r{next_rid}"
        next_rid += 1
        mode = rng.choice(["full", "full", "incremental", "incremental", None])
        session = rng.choice(sessions) if rng.random() < 0.8 else None
        ops.append({"op": "arrive", "rid": rid, "tokens": tokens, "session": session,
                    "mode": mode, "lookup": lookup})
        prompts.append(tokens)
        live[rid] = list(tokens)

    def free(rid: str) -> None:
        ops.append({"op": "free", "rid": rid})
        del live[rid]

    while len(ops) < n_ops:
        r = rng.random()
        if len(live) >= 8:
            r = 0.6  # free something
        elif not live and r < 0.95:
            r = 0.0  # nothing to extend or free: a new request
        if r < 0.36:
            arrive(new_prompt())
        elif r < 0.44:
            # duplicate: same prompt as a live request, not reading the prefix cache, so it
            # allocates and caches its own copies of the same hashes
            arrive(list(live[rng.choice(list(live))]), lookup=False)
        elif r < 0.58:
            rid = rng.choice(list(live))
            extra = rand_tokens(rng.randint(1, 2 * bs))
            live[rid].extend(extra)
            ops.append({"op": "extend", "rid": rid, "tokens": extra})
        elif r < 0.91:
            free(rng.choice(list(live)))
        elif r < 0.95:
            for rid in rng.sample(list(live), len(live)):
                free(rid)
            ops.append({"op": "reset"})
        else:
            ops.append({"op": "reset"})  # fails unless everything happens to be free
    return {"id": f"seed{seed}", "seed": seed, "num_blocks": num_blocks, "block_size": bs,
            "ops": ops[:n_ops]}


# -- running vLLM ---------------------------------------------------------------------------


def _run_driver(ops_path: Path, out_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    return subprocess.run([str(vllm_python()), str(DRIVER), str(ops_path), "-o", str(out_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def fidelity_runs(tmp_path_factory) -> dict[int, tuple[dict, list[dict]]]:
    """seed -> (sequence, vLLM's per-op results), from one driver run for all seeds."""
    sequences = [generate_sequence(seed) for seed in SEEDS]
    tmp = tmp_path_factory.mktemp("fidelity")
    ops_path, out_path = tmp / "ops.json", tmp / "vllm.json"
    ops_path.write_text(json.dumps({"sequences": sequences}))
    proc = _run_driver(ops_path, out_path)
    if proc.returncode != 0 and ("ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr):
        build_vllm_venv()  # a broken venv: the script repairs it (it is idempotent)
        proc = _run_driver(ops_path, out_path)
    if proc.returncode != 0:
        pytest.fail(f"vLLM driver failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}",
                    pytrace=False)
    out = json.loads(out_path.read_text())
    assert out["vllm_version"].startswith("0.32."), out["vllm_version"]
    assert len(out["sequences"]) == len(sequences)
    return {seq["seed"]: (seq, res["results"]) for seq, res in zip(sequences, out["sequences"])}


# -- replay on the simulator ----------------------------------------------------------------


def _event_fields(event) -> tuple[dict, str]:
    wire = _msgpack.encode(event)
    return msgspec.msgpack.decode(wire), wire.hex()


def _canonical(wire: bytes) -> bytes:
    """The event's map re-encoded as a plain dict: the raw bytes differ in one harmless way,
    the map header. msgspec sizes a struct's map header by its declared field count, and
    Sluice's ``BlockStored`` declares 16 possible keys (vLLM's 15), so Sluice writes a map16
    header (``de 00 0b``) where vLLM writes a fixmap (``8b``) for the same 11 entries. Every
    msgpack decoder, vLLM's typed one included, reads both the same."""
    return _msgpack.encode(msgspec.msgpack.decode(wire))


class SimReplay:
    """The same calls the driver makes on vLLM's pool, made on the simulator's, with the
    block hashes vLLM computed (the simulator takes hashes as opaque values)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_caching=True, enable_events=True)
        # rid -> [tokens, blocks, num_cached_blocks, session]
        self.live: dict[str, list] = {}

    def step(self, op: dict, vres: dict) -> dict:
        pool, bs = self.pool, self.bs
        kind = op["op"]
        res: dict = {"op": kind}
        if kind == "arrive":
            tokens, session = list(op["tokens"]), op["session"]
            hashes = vres["hashes"]
            hits: list[int] = []
            if op["lookup"]:
                max_blocks = (len(tokens) - 1) // bs
                hits = pool.longest_hit(hashes, max_blocks=max_blocks)
                # block-by-block lookups agree with longest_hit
                assert [pool.get_cached_block(h) for h in hashes[:len(hits)]] == hits
                if len(hits) < max_blocks:
                    assert pool.get_cached_block(hashes[len(hits)]) is None
            res["hits"] = hits
            if hits and op["mode"] == "full":
                pool.emit_cached_block_events(hashes, len(hits), session_id=session,
                                              token_ids=tokens[:len(hits) * bs])
            pool.touch(hits)
            need = -(-len(tokens) // bs) - len(hits)
            try:
                new = pool.get_new_blocks(need)
            except PoolExhausted:
                pool.free_blocks(list(reversed(hits)), session_id=session)
                res["status"] = "fail"
            else:
                blocks = hits + new
                num_full = len(tokens) // bs
                pool.cache_full_blocks(blocks, hashes, len(hits), num_full, session_id=session,
                                       token_ids=tokens[len(hits) * bs:num_full * bs])
                self.live[op["rid"]] = [tokens, blocks, max(num_full, len(hits)), session]
                res["status"] = "ok"
                res["new"] = new
        elif kind == "extend":
            entry = self.live.get(op["rid"])
            if entry is None:
                res["status"] = "noop"
            else:
                tokens, blocks, num_cached, session = entry
                tokens.extend(op["tokens"])
                hashes = vres["hashes"]
                need = -(-len(tokens) // bs) - len(blocks)
                try:
                    new = pool.get_new_blocks(need) if need > 0 else []
                except PoolExhausted:
                    pool.free_blocks(list(reversed(blocks)), session_id=session)
                    del self.live[op["rid"]]
                    res["status"] = "preempted"
                    res["freed"] = list(reversed(blocks))
                else:
                    blocks.extend(new)
                    num_full = len(tokens) // bs
                    pool.cache_full_blocks(blocks, hashes, num_cached, num_full,
                                           session_id=session,
                                           token_ids=tokens[num_cached * bs:num_full * bs])
                    entry[2] = max(num_full, num_cached)
                    res["status"] = "ok"
                    res["new"] = new
        elif kind == "free":
            entry = self.live.pop(op["rid"], None)
            if entry is None:
                res["status"] = "noop"
            else:
                blocks, session = entry[1], entry[3]
                pool.free_blocks(list(reversed(blocks)), session_id=session)
                res["status"] = "ok"
                res["freed"] = list(reversed(blocks))
        elif kind == "reset":
            res["status"] = pool.reset_prefix_cache()
        else:
            raise ValueError(kind)
        res["num_free"] = pool.num_free
        res["usage"] = pool.usage
        res["free_queue"] = pool.free_queue_order()
        res["events"] = [_event_fields(e) for e in pool.take_events()]
        return res


COMPARED = ("status", "hits", "new", "freed", "num_free", "usage", "free_queue")
EVENT_FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "session_id", "group_idx", "medium")


def _compare_op(i: int, op: dict, vres: dict, sres: dict) -> list[str]:
    problems = []
    if "hits_manager" in vres and vres["hits_manager"] != vres["hits"]:
        problems.append(f"vLLM self-check: FullAttentionManager hit {vres['hits_manager']} "
                        f"!= get_cached_block walk {vres['hits']}")
    for key in COMPARED:
        if vres.get(key) != sres.get(key):
            problems.append(f"{key}: vLLM {vres.get(key)!r} != sim {sres.get(key)!r}")
    vevents, sevents = vres["events"], sres["events"]
    if len(vevents) != len(sevents):
        problems.append(f"{len(vevents)} vLLM events != {len(sevents)} sim events")
    for k, (ve, (sfields, swire)) in enumerate(zip(vevents, sevents)):
        vfields = ve["fields"]
        for name in EVENT_FIELDS:
            if vfields.get(name) != sfields.get(name):
                problems.append(f"event {k} {name}: vLLM {vfields.get(name)!r} != sim "
                                f"{sfields.get(name)!r}")
        if vfields != sfields:
            problems.append(f"event {k} map: vLLM {vfields!r} != sim {sfields!r}")
        elif list(vfields) != list(sfields):
            problems.append(f"event {k} key order: vLLM {list(vfields)} != sim {list(sfields)}")
        elif _canonical(bytes.fromhex(ve["wire"])) != _canonical(bytes.fromhex(swire)):
            # same keys and ==-equal values, but a value of another msgpack type (4 vs 4.0)
            problems.append(f"event {k} msgpack value types: vLLM {ve['wire']} != sim {swire}")
    if problems:
        brief = {k: v for k, v in op.items() if k != "tokens"}
        if "tokens" in op:
            brief["n_tokens"] = len(op["tokens"])
        return [f"op {i} {brief}:"] + ["    " + p for p in problems]
    return []


@pytest.mark.parametrize("seed", SEEDS)
def test_sim_block_pool_matches_vllm(fidelity_runs, seed):
    seq, vresults = fidelity_runs[seed]
    assert len(vresults) == len(seq["ops"])
    sim = SimReplay(seq["num_blocks"], seq["block_size"])
    for i, (op, vres) in enumerate(zip(seq["ops"], vresults)):
        sres = sim.step(op, vres)
        problems = _compare_op(i, op, vres, sres)
        if problems:
            pytest.fail(f"seed {seed} (num_blocks={seq['num_blocks']}, block_size="
                        f"{seq['block_size']}) diverges from vLLM at\n" + "\n".join(problems),
                        pytrace=False)


def test_sequences_cover_the_interesting_paths(fidelity_runs):
    """Guards the generator: the runs above must actually hit every path they claim to."""
    seen: Counter = Counter()
    for seq, vresults in fidelity_runs.values():
        stored_hashes: Counter = Counter()
        for op, vres in zip(seq["ops"], vresults):
            kind, status = op["op"], vres["status"]
            seen[f"{kind}:{status}"] += 1
            if vres.get("hits"):
                seen["prefix hit"] += 1
                if op.get("mode") == "full":
                    seen["full-mode hit report"] += 1
            for ev in vres["events"]:
                f = ev["fields"]
                seen[f["type"]] += 1
                if f["type"] == "BlockStored":
                    if f["parent_block_hash"] is not None:
                        seen["store with parent"] += 1
                    if f.get("session_id") is None:
                        seen["store without session"] += 1
                    for h in f["block_hashes"]:
                        stored_hashes[h] += 1
            if kind == "arrive" and not op["lookup"] and status == "ok":
                seen["duplicate arrival"] += 1
        if any(n > 1 for n in stored_hashes.values()):
            seen["hash stored twice"] += 1
    needed = ["arrive:ok", "arrive:fail", "extend:ok", "extend:preempted", "free:ok",
              "reset:True", "reset:False", "prefix hit", "full-mode hit report", "BlockStored",
              "BlockRemoved", "AllBlocksCleared", "store with parent", "store without session",
              "duplicate arrival", "hash stored twice"]
    missing = [k for k in needed if not seen[k]]
    assert not missing, f"op sequences never exercised {missing}: {dict(seen)}"
    assert sum(len(seq["ops"]) for seq, _ in fidelity_runs.values()) == len(SEEDS) * OPS_PER_SEQUENCE


if __name__ == "__main__":  # regenerate the op file by hand: python test_block_pool_fidelity.py > ops.json
    json.dump({"sequences": [generate_sequence(s) for s in SEEDS]}, sys.stdout)
