"""The engine plugin (``sluice_vllm_plugin``) on vLLM 0.32's real ``BlockPool``.

``vllm_plugin_driver.py`` runs in the vLLM venv with the repository on ``PYTHONPATH`` (the plugin
is not installed there), applies the plugin, runs the fixed label scenarios (V1a / V1b) and the
random retention sequences generated here, and prints JSON. The label tests check that JSON and
decode the wire bytes with Sluice's own decoder (``scheduler.kv_events``); the retention test
replays the same operations and directives on ``sim/block_pool.py`` and compares block ids,
evictions and the free-queue order after every op.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import msgspec
import pytest

from scheduler.kv_events import BlockRemoved, BlockStored, EventBatchDecoder
from sim.block_pool import BlockPool as SimPool

from tests.support.vllm_venv import ROOT, run_check, vllm_env, vllm_python

DRIVER = Path(__file__).resolve().parent / "vllm_plugin_driver.py"
SEEDS = list(range(20))
OPS = 150


# -- retention sequences ------------------------------------------------------------------------


def generate_retention(seed: int) -> dict:
    rng = random.Random(1000 + seed)
    bs = rng.choice([2, 4])
    num_blocks = rng.randint(8, 24)
    families = [[rng.randrange(40) for _ in range(rng.randint(2, 6) * bs)] for _ in range(3)]
    sessions = [f"s{k}" for k in range(rng.randint(2, 4))]
    live: list[str] = []
    ops: list[dict] = []
    rid = 0
    while len(ops) < OPS:
        r = rng.random()
        if len(live) >= 4:
            r = 0.5
        if r < 0.4:
            base = rng.choice(families)
            cut = rng.randint(0, len(base))
            tokens = base[:cut] + [rng.randrange(40) for _ in range(rng.randint(1, 2 * bs))]
            tokens = tokens[: (num_blocks // 2) * bs]
            # most requests carry a continuation id (the gateway sets one), some none
            continuation = f"c{rid}" if rng.random() < 0.8 else None
            ops.append({"op": "arrive", "rid": f"r{rid}", "tokens": tokens,
                        "session": rng.choice(sessions), "continuation": continuation})
            live.append(f"r{rid}")
            rid += 1
        elif r < 0.65:
            if live:
                ops.append({"op": "free", "rid": live.pop(rng.randrange(len(live)))})
        elif r < 0.8:
            ops.append({"op": "retain", "session": rng.choice(sessions),
                        "priority": rng.choice([10, 60, 80, 100, 150]),
                        "ttl": rng.choice([1.0, 5.0, 30.0])})
        elif r < 0.86:
            ops.append({"op": "demote", "session": rng.choice(sessions)})
        elif r < 0.92:
            ops.append({"op": "release", "session": rng.choice(sessions)})
        else:
            ops.append({"op": "tick", "dt": rng.choice([0.5, 2.0, 10.0])})
    return {"id": f"seed{seed}", "num_blocks": num_blocks, "block_size": bs, "ops": ops}


def generate_lazy(seed: int) -> dict:
    """Sequences that lean on the free queue's lazy re-classing: sessions that extend their own
    previous request (blocks re-freed by the session that owns them), several directives per
    session that override one another (retains at new priorities, refreshes at the same one,
    demotes, releases) with TTLs that run out between allocations, and frees without a session
    of blocks a session owns."""
    rng = random.Random(5000 + seed)
    bs = 2
    num_blocks = rng.randint(24, 40)
    sessions = [f"s{k}" for k in range(3)]
    last_tokens = {s: [rng.randrange(40) for _ in range(2 * bs)] for s in sessions}
    live: list[str] = []
    ops: list[dict] = []
    rid = 0
    while len(ops) < OPS:
        r = rng.random()
        if len(live) >= 3:
            r = 0.45
        if r < 0.35:
            session = rng.choice(sessions)
            # the session's next call: its previous context plus a little more
            more = [rng.randrange(40) for _ in range(rng.randint(1, 3 * bs))]
            tokens = last_tokens[session] + more
            tokens = tokens[-(num_blocks // 3) * bs:]
            last_tokens[session] = tokens
            ops.append({"op": "arrive", "rid": f"r{rid}", "tokens": tokens, "session": session,
                        "continuation": f"c{rid}"})
            live.append(f"r{rid}")
            rid += 1
        elif r < 0.55:
            if live:
                ops.append({"op": "free", "rid": live.pop(rng.randrange(len(live))),
                            "anonymous": rng.random() < 0.2})
        elif r < 0.8:
            ops.append({"op": "retain", "session": rng.choice(sessions),
                        "priority": rng.choice([30, 60, 60, 90]),
                        "ttl": rng.choice([0.5, 1.0, 3.0])})
        elif r < 0.87:
            ops.append({"op": "demote", "session": rng.choice(sessions)})
        elif r < 0.92:
            ops.append({"op": "release", "session": rng.choice(sessions)})
        elif r < 0.94 and not live:
            # every block free: the reset takes every hash, and directives move cached blocks
            # only, so the side classes' blocks stay where they are
            ops.append({"op": "reset"})
        else:
            ops.append({"op": "tick", "dt": rng.choice([0.5, 1.0, 2.0])})
    return {"id": f"lazy{seed}", "num_blocks": num_blocks, "block_size": bs, "ops": ops}


# -- running vLLM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver_out(tmp_path_factory) -> dict:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("plugin")
    inp, out = tmp / "in.json", tmp / "out.json"
    sequences = [generate_retention(s) for s in SEEDS]
    compacting = [{**seq, "id": f"{seq['id']}-compacting", "compacting": True} for seq in sequences]
    lazy = [generate_lazy(s) for s in SEEDS]
    lazy_compacting = [{**seq, "id": f"{seq['id']}-compacting", "compacting": True} for seq in lazy]
    inp.write_text(json.dumps({"retention": sequences + compacting + lazy + lazy_compacting}))
    proc = subprocess.run([str(python), str(DRIVER), str(inp), "-o", str(out)], cwd=ROOT,
                          env=vllm_env(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["vllm_version"].startswith("0.32.")
    return data


def _sluice_decode(ev: dict):
    """One event's wire bytes through Sluice's decoder (wrapped in a batch)."""
    batch = msgspec.msgpack.encode([0.0, [msgspec.msgpack.decode(bytes.fromhex(ev["wire"]))], 0])
    return EventBatchDecoder().decode(batch).events[0]


# -- V1a ----------------------------------------------------------------------------------------


def test_v1a_full_reused_partial_stores_carry_continuation(driver_out):
    sc = driver_out["scenarios"]["v1a"]
    [full] = sc["full"]
    assert full["fields"]["continuation_id"] == "c1"
    assert full["fields"]["session_id"] == "s1"
    assert list(full["fields"])[-1] == "continuation_id"      # vLLM's map + one trailing key
    assert full["fields"]["block_hashes"] == sc["hashes_r1"][:2]
    # r2 reuses r1's 2 blocks in full report mode: one store from block 0 labelled with r2's id
    assert sc["hits"] == 2
    reused = [e for e in sc["reused"] if e["fields"]["parent_block_hash"] is None]
    assert len(reused) == 1 and reused[0]["fields"]["continuation_id"] == "c2"
    assert reused[0]["fields"]["block_hashes"] == sc["hashes_r1"][:2]
    assert all(e["fields"]["continuation_id"] == "c2" for e in sc["reused"])
    [partial] = sc["partial"]
    assert partial["fields"]["continuation_id"] == "c3" and partial["fields"]["block_size"] == 4
    # without a continuation id the key is omitted: byte-identical to vLLM's own event
    [plain] = sc["unlabelled"]
    assert "continuation_id" not in plain["fields"]
    for ev in (full, partial):
        decoded = _sluice_decode(ev)
        assert isinstance(decoded, BlockStored) and decoded.continuation_id == ev["fields"]["continuation_id"]


# -- V1b ----------------------------------------------------------------------------------------


def test_v1b_first_admitter_after_sharing_and_duplicates(driver_out):
    sc = driver_out["scenarios"]["v1b"]
    h = sc["hashes"]                       # r1's prefix: 2 full blocks (+ 2 tokens)
    h2 = sc["hashes_r2"]                   # r2 shares 2 blocks, admits a third
    stores = [e["fields"] for e in sc["stores"]]
    assert [s["continuation_id"] for s in stores] == ["c1", "c2", "c2", "c3"]
    # side map: each hash with its first admitter and prefix length
    assert sc["side_before"] == [["c1", 4], ["c1", 8], ["c2", 12]]
    removed = [e["fields"] for e in sc["removed"]]
    # every removal is labelled, the duplicates' final ones included
    by_hash: dict = {}
    for ev in removed:
        [bh] = ev["block_hashes"]
        by_hash.setdefault(bh, []).append((ev["continuation_id"], ev["num_tokens"]))
    assert by_hash[h[0]] == [("c1", 4), ("c1", 4)]      # r1's copy and r3's duplicate
    assert by_hash[h[1]] == [("c1", 8), ("c1", 8)]
    assert by_hash[h2[2]] == [("c2", 12)]
    assert sc["side_after"] == 0
    again = [e["fields"] for e in sc["removed_again"]]
    assert {(e["block_hashes"][0], e["continuation_id"], e["num_tokens"]) for e in again} == {
        (h[0], "c4", 4), (h[1], "c4", 8)}
    for ev in sc["removed"]:
        decoded = _sluice_decode(ev)
        assert isinstance(decoded, BlockRemoved)
        assert (decoded.continuation_id, decoded.num_tokens) == (
            ev["fields"]["continuation_id"], ev["fields"]["num_tokens"])


def test_move_and_evict_keeps_attribution(driver_out):
    sc = driver_out["scenarios"]["move"]
    assert [e["fields"]["type"] for e in sc["moved_events"]] == ["BlockStored"]   # move: no events
    got = {(e["fields"]["block_hashes"][0], e["fields"]["continuation_id"], e["fields"]["num_tokens"])
           for e in sc["removed"]}
    assert got == {(sc["hashes"][0], "cm", 4), (sc["hashes"][1], "cm", 8)}
    assert sc["side_after"] == 0


def test_reset_clears_side_map(driver_out):
    sc = driver_out["scenarios"]["reset"]
    assert sc["side_before"] == 2
    assert sc["failed"] is False and sc["side_after_fail"] == 2
    assert sc["ok"] is True and sc["side_after"] == 0
    assert sc["events"][-1]["fields"] == {"type": "AllBlocksCleared"}
    assert {e["fields"]["continuation_id"] for e in sc["removed"]} == {"cr2"}


def test_events_off_keeps_nothing(driver_out):
    sc = driver_out["scenarios"]["events_off"]
    assert sc == {"kept": 0, "kept_after": 0, "events": [], "queue": 0}


def test_labels_do_not_change_hashes(driver_out):
    sc = driver_out["scenarios"]["hashes"]
    assert sc["a"] == sc["b"] == sc["n"]
    # rb shares ra's blocks (its last, block-aligned block is recomputed, as vLLM caps the hit)
    assert sc["hits_b"] == sc["ba"][:2]
    first = sc["stores"][0]["fields"]
    assert first["continuation_id"] == "label-a" and first["block_hashes"] == sc["a"]
    assert len([s for s in sc["stores"] if s["fields"]["parent_block_hash"] is None]) == 1


def test_old_consumer_decodes_labelled_events(driver_out):
    sc = driver_out["scenarios"]["old_consumer"]
    # vLLM's own decoder (KVEventBatch) reads the labelled batch into its plain structs
    assert [d["cls"] for d in sc["decoded"]] == ["BlockStored", "BlockRemoved", "BlockRemoved"]
    assert all(d["module"] == "vllm.distributed.kv_events" for d in sc["decoded"])
    assert [d["hashes"] for d in sc["decoded"]] == [o["hashes"] for o in sc["orig"]]
    assert sc["decoded"][0]["session_id"] == "s1"
    # and Sluice's decoder reads the extra keys
    batch = EventBatchDecoder().decode(bytes.fromhex(sc["payload"]))
    assert batch.events[0].continuation_id == "c-old"
    assert [(e.continuation_id, e.num_tokens) for e in batch.events[1:]] == [("c-old", 8), ("c-old", 4)]


# -- retention: vLLM + plugin vs sim ------------------------------------------------------------


@pytest.mark.parametrize("compacting", [False, True], ids=["", "compacting"])
@pytest.mark.parametrize("seed", SEEDS)
def test_retention_and_removal_attribution_match_sim(driver_out, seed, compacting):
    """Same hits, block ids, evictions (with their attribution) and free-queue order after every
    op; ``compacting`` runs the plugin with its free-queue compaction and ownership-log sweeps
    at their most frequent, which must not change a thing."""
    seq = generate_retention(seed)
    run_id = f"seed{seed}-compacting" if compacting else f"seed{seed}"
    retained, attributed = _replay_on_sim(seq, driver_out, run_id)
    assert retained > 0 and attributed > 0


@pytest.mark.parametrize("compacting", [False, True], ids=["", "compacting"])
@pytest.mark.parametrize("seed", SEEDS)
def test_lazy_reclassing_matches_eager_sim(driver_out, seed, compacting):
    """The plugin re-classes a session's free blocks lazily; ``sim/block_pool.py`` moves them
    eagerly, block by block. Directives that override and expire one another, sessions whose
    calls re-free blocks they own, frees without a session and prefix-cache resets must leave
    both with the same evictions and the same free-queue order after every op."""
    seq = generate_lazy(seed)
    run_id = f"lazy{seed}-compacting" if compacting else f"lazy{seed}"
    retained, _ = _replay_on_sim(seq, driver_out, run_id)
    assert retained > 0
    assert any(op.get("anonymous") for op in seq["ops"])


def _replay_on_sim(seq: dict, driver_out: dict, run_id: str) -> tuple[int, int]:
    """Replay ``seq`` on the sim's pool and compare every op's result with the plugin's run
    ``run_id``; the number of retains and of attributed removals."""
    [run] = [r for r in driver_out["retention"] if r["id"] == run_id]
    bs = seq["block_size"]
    sim = SimPool(seq["num_blocks"], bs, attribute_removals=True)
    now = 0.0
    live: dict[str, tuple[str, list[int]]] = {}
    retained = attributed = 0
    for i, (op, want) in enumerate(zip(seq["ops"], run["results"], strict=True)):
        got: dict = {"status": "ok"}
        kind = op["op"]
        if kind == "arrive":
            hashes = want["hashes"]
            n = len(op["tokens"])
            hits = sim.longest_hit(hashes, (n - 1) // bs)
            sim.touch(hits)
            got["hits"] = hits
            need = -(-n // bs) - len(hits)
            if need > sim.num_free:
                sim.free_blocks(reversed(hits), session_id=op["session"])
                got["status"] = "exhausted"
            else:
                new = sim.get_new_blocks(need, now)
                blocks = hits + new
                sim.cache_full_blocks(blocks, hashes, len(hits), n // bs, session_id=op["session"],
                                      continuation_id=op["continuation"])
                got["new"] = new
                live[op["rid"]] = (op["session"], blocks)
            got["hashes"] = hashes
        elif kind == "free":
            if op["rid"] in live:
                session, blocks = live.pop(op["rid"])
                sim.free_blocks(reversed(blocks),
                                session_id=None if op.get("anonymous") else session)
            else:
                got["status"] = "noop"
        elif kind == "retain":
            retained += 1
            sim.retain(op["session"], op["priority"], op["ttl"], now)
        elif kind == "demote":
            sim.demote(op["session"])
        elif kind == "release":
            sim.release(op["session"])
        elif kind == "tick":
            now += op["dt"]
        elif kind == "reset":
            got["reset"] = sim.reset_prefix_cache()
        got["removed"] = [[e.block_hashes[0], e.continuation_id, e.num_tokens]
                          for e in sim.take_events() if isinstance(e, BlockRemoved)]
        attributed += sum(1 for _, continuation, _ in got["removed"] if continuation is not None)
        got["free_queue"] = sim.free_queue_order()
        assert got == want, f"{run_id} op {i} {op}"
    return retained, attributed


# -- registration and directive robustness ------------------------------------------------------

_REGISTER_CHECK = r"""
import json, logging, multiprocessing, os
os.environ.pop("SLUICE_PLUGIN", None)
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
import vllm
import sluice_vllm_plugin as plugin
from sluice_vllm_plugin import labels, retention
from sluice_vllm_plugin.directive_envelope import (VERBS, KvDemote, KvRetain, RetainPayload,
                                                  SessionPayload)
out = {}
plugin.register()                                   # API-server-like process: not applied
out["main_process"] = labels.is_applied()
real = vllm.__version__
vllm.__version__ = "0.31.9"
records = []
class H(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("sluice.vllm_plugin").addHandler(H())
plugin._registered = False
os.environ["SLUICE_PLUGIN"] = "force"
plugin.register()
out["other_version"] = labels.is_applied()
out["log_lines"] = len(records)
vllm.__version__ = real
plugin._registered = False
os.environ.pop("SLUICE_PLUGIN")
multiprocessing.current_process().name = "EngineCore_DP1"
plugin.register()
out["engine_core"] = labels.is_applied()
plugin.register()                                   # idempotent
from vllm.v1.core.block_pool import BlockPool
pool = BlockPool(4, True, 4, enable_kv_cache_events=True)
r = retention.state(pool)
r.post(KvRetain(RetainPayload("s", "not-a-number", 1.0)))  # a struct is not checked when built
r.post("bogus")
r.post(KvDemote(SessionPayload("s")))
out["applied"] = r.drain()
out["dropped"] = r.dropped
out["alloc"] = [b.block_id for b in pool.get_new_blocks(3)]
out["verbs_not_applied"] = [v for v in VERBS if not callable(getattr(retention.Retention, v, None))]
print("RESULT" + json.dumps(out))
"""


def test_register_gating_and_malformed_directives(driver_out):
    out = run_check(_REGISTER_CHECK)
    assert out == {"main_process": False, "other_version": False, "log_lines": 1,
                   "engine_core": True, "applied": 1, "dropped": 2, "alloc": [1, 2, 3],
                   "verbs_not_applied": []}


_DIRECTIVE_CHECK = r"""
import json, sys, time
import msgspec, zmq
from sluice_vllm_plugin import directives, retention
from vllm.v1.core.block_pool import BlockPool
retention.apply()
pool = BlockPool(6, True, 4, enable_kv_cache_events=True)
endpoint = "ipc://" + sys.argv[1]
server = directives.DirectiveServer(endpoint)
push = zmq.Context.instance().socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 1000)
push.connect(endpoint)
def env(*actions, pv=1):
    return {"protocol_version": pv, "message_id": "m", "actions": [
        {"action_id": f"a{i}", "action_type": t, "action_version": 1, "payload": p}
        for i, (t, p) in enumerate(actions)]}
push.send(json.dumps(env(("kv.retain", {"session_id": "s1", "continuation_id": "c",
                                         "priority": 90, "ttl_s": 30}))).encode())
push.send(msgspec.msgpack.encode(env(("kv.demote", {"session_id": "s2"}),
                                     ("kv.release", {"session_id": "s3"}))))
push.send(b"\xc1garbage")
push.send(json.dumps(env(("kv.retain", {"session_id": "s1", "priority": 101, "ttl_s": 1}))).encode())
push.send(json.dumps(env(("kv.retain", {"session_id": "s1", "priority": 5, "ttl_s": 1}), pv=9)).encode())
push.send(json.dumps(env(("kv.evict", {"session_id": "s1"}))).encode())
push.send(json.dumps([1, 2]).encode())
deadline = time.time() + 20
while server.received < 7 and time.time() < deadline:
    time.sleep(0.02)
r = retention.state(pool)
pool.get_new_blocks(1)        # drains the inbox on the scheduler's side
out = {"received": server.received, "applied": server.applied, "dropped": server.dropped,
       "classes": {s: r.class_of(s) for s in ("s1", "s2", "s3")},
       "offset_tcp": directives.resolve_endpoint("tcp://*:5590", 2),
       "offset_ipc": directives.resolve_endpoint("inproc://d", 1),
       "rank0": directives.resolve_endpoint("tcp://*:5590", 0)}
server.close()
print("RESULT" + json.dumps(out))
"""


def test_directive_socket(tmp_path):
    out = run_check(_DIRECTIVE_CHECK, str(tmp_path / "d.sock"))
    assert out == {"received": 7, "applied": 3, "dropped": 5,
                   "classes": {"s1": 90, "s2": 0, "s3": 50},
                   "offset_tcp": "tcp://*:5592", "offset_ipc": "inproc://d_dp1",
                   "rank0": "tcp://*:5590"}
