"""The engine plugin's directive receiver, in vLLM's environment, on vLLM's real ``BlockPool``:
it survives any input, counts and logs it without a line per message, cuts off frames over
its size limit, and bounds what directives may do (the limits of
sluice_vllm_plugin/directive_limits.py, set by ``SLUICE_DIRECTIVE_<FIELD>`` variables; the
simworker applies the same ones: tests/integration/test_directive_limits.py)."""

from __future__ import annotations

from tests.support.vllm_venv import run_check

_SURVIVES_CHECK = r"""
import json, logging, sys, time
import msgspec, zmq
from zmq.utils.monitor import recv_monitor_message
from sluice_vllm_plugin import directives, retention
from vllm.v1.core.block_pool import BlockPool

lines = []
class Lines(logging.Handler):
    def emit(self, record): lines.append(record.getMessage())
logging.getLogger("sluice.vllm_plugin.directives").addHandler(Lines())

retention.apply()
pool = BlockPool(8, True, 4, enable_kv_cache_events=True)
endpoint = "ipc://" + sys.argv[1]
server = directives.DirectiveServer(endpoint)
ctx = zmq.Context.instance()

def env(*actions):
    return {"protocol_version": 1, "message_id": "m", "actions": [
        {"action_id": f"a{i}", "action_type": t, "action_version": 1, "payload": p}
        for i, (t, p) in enumerate(actions)]}
depth = 20_000                      # 40 KB: under the size limit, so it reaches the handler
deep_json = (b'{"protocol_version":1,"message_id":"m","junk":' + b"[" * depth + b"]" * depth
             + b',"actions":[]}')
head = msgspec.msgpack.encode({"protocol_version": 1, "message_id": "m", "actions": []})
deep_msgpack = b"\x84" + head[1:] + b"\xa4junk" + b"\x91" * depth + b"\xc0"
hostile = [deep_json, deep_msgpack, b"\xc1garbage", b"", b"{not json", json.dumps([1, 2]).encode(),
           json.dumps(env(("kv.retain", {"session_id": ["s"], "priority": "hi", "ttl_s": "x"}))).encode(),
           msgspec.msgpack.encode(env(("kv.retain", {"session_id": "s", "priority": 90,
                                                       "ttl_s": float("nan")})))] * 5

def wait(cond):
    deadline = time.time() + 120
    while not cond() and time.time() < deadline:
        time.sleep(0.02)

push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 5000)
push.connect(endpoint)
for message in hostile:
    push.send(message)
push.send_multipart([b"{", b"two frames"])
push.send(json.dumps(env(("kv.retain", {"session_id": "s1", "priority": 90, "ttl_s": 30}))).encode())
push.close()
wait(lambda: server.applied == 1)

# a frame over the limit: the receiver cuts the sender off before reading it
big = ctx.socket(zmq.PUSH)
big.setsockopt(zmq.LINGER, 0)
monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
big.connect(endpoint)
big.send(b"{" + b" " * (2 * server.limits.max_message_bytes))
disconnected = bool(monitor.poll(120_000)) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
big.disable_monitor(); monitor.close(0); big.close(0)

push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 5000)
push.connect(endpoint)
push.send(json.dumps(env(("kv.demote", {"session_id": "s2"}))).encode())
push.close()
wait(lambda: server.applied == 2)
r = retention.state(pool)
pool.get_new_blocks(1)        # drains the inbox on the scheduler's side
out = {"received": server.received, "applied": server.applied, "drops": dict(server.drops),
       "classes": {s: r.class_of(s) for s in ("s1", "s2")},
       "maxmsgsize": server._sock.getsockopt(zmq.MAXMSGSIZE), "disconnected": disconnected,
       "thread_alive": server._thread.is_alive(), "log_lines": len(lines),
       "first_line": lines[0] if lines else ""}
server.close()
print("RESULT" + json.dumps(out))
"""


def test_the_plugins_directive_socket_survives_any_input_and_cuts_off_large_frames(tmp_path):
    out = run_check(_SURVIVES_CHECK, str(tmp_path / "d.sock"))
    first_line = out.pop("first_line")
    # 40 hostile messages, one multipart, two valid; the large frame never arrives
    assert out == {"received": 43, "applied": 2, "drops": {"malformed": 40, "multipart": 1},
                   "classes": {"s1": 90, "s2": 0}, "maxmsgsize": 65_536, "disconnected": True,
                   "thread_alive": True, "log_lines": out["log_lines"]}
    # the first at once, with its context; then at most one line per 10 s
    assert 1 <= out["log_lines"] < 10
    assert "malformed" in first_line and "RecursionError" in first_line and "d.sock" in first_line


_BOUNDS_CHECK = r"""
import json, os
os.environ.update({"SLUICE_DIRECTIVE_MAX_SESSIONS": "100", "SLUICE_DIRECTIVE_MAX_TTL_S": "60",
                   "SLUICE_DIRECTIVE_FORGET_AFTER_S": "120", "SLUICE_DIRECTIVE_PRIORITY_MAX": "80",
                   "SLUICE_DIRECTIVE_MAX_QUEUED": "500",
                   "SLUICE_DIRECTIVE_MAX_SESSION_RETAINED_BLOCKS": "4",
                   "SLUICE_DIRECTIVE_MAX_RETAINED_BLOCKS": "6"})
from tests.fidelity.vllm_plugin_driver import admit, mkreq
from sluice_vllm_plugin import retention
from sluice_vllm_plugin.directive_envelope import (KvPrefetch, KvRelease, KvRetain, PrefetchPayload,
                                                  RetainPayload, SessionPayload)
from vllm.v1.core.block_pool import BlockPool

retention.apply()
pool = BlockPool(64, True, 4, enable_kv_cache_events=True)
r = retention.state(pool)
now = [0.0]
r.clock = lambda: now[0]
out = {"limits": [r.governor.limits.max_sessions, r.governor.limits.max_ttl_s]}

# forged never-expiring retains, each for a new session: at most max_sessions are taken
for i in range(400):
    r.post(KvRetain(RetainPayload(f"forged-{i}", 100, float("inf"))))
r.drain()
out["sessions"] = r.governor.sessions
out["session_class"] = len(r._session_class)
out["refused"] = dict(r.governor.refused)
out["class_and_expiry"] = sorted({list(v) == [80, 60.0] for v in r._session_class.values()})
out["prefetch_clamped"] = r.governor.admit(
    KvPrefetch(PrefetchPayload("forged-1", priority=99, deadline_s=1e9)), 0.0).payload.deadline_s
# one session retained over and over: one live expiry, the stale ones compacted away
for _ in range(500):
    r.post(KvRetain(RetainPayload("forged-0", 90, 30.0)))
    r.drain()
out["heap_bounded"] = len(r._expiries) <= 2 * len(r._session_class) + 64
# an action made in process is not decoded: NaN refused here
r.post(KvRetain(RetainPayload("forged-0", 90, float("nan"))))
r.drain()
# the inbox of an engine that allocates nothing holds at most max_queued
for i in range(600):
    r.post(KvRelease(SessionPayload(f"q-{i}")))
out["queued"] = r.inbox.qsize()
r.drain()
out["refused_more"] = dict(r.governor.refused)
# forget_after_s after their latest directive, sessions are released and forgotten, here and
# in the free queue
now[0] = 121.0
r.drain()
out["after_forget"] = [r.governor.sessions, len(r._session_class), len(r.queue._sessions),
                       r.governor.forgotten]

# retained-block budgets, on sessions whose requests cached blocks
def own(session, blocks, first_token):
    req = mkreq(f"r-{session}", list(range(first_token, first_token + 4 * blocks)), 4, session=session)
    _, got = admit(pool, req, 4, lookup=False)
    with retention.freeing(pool, session):
        pool.free_blocks(reversed(got))
own("big", 5, 1000); own("a", 4, 2000); own("b", 3, 3000)
for session in ("big", "a", "b"):
    r.post(KvRetain(RetainPayload(session, 90, 30.0)))
r.drain()
out["budget_classes"] = [r.class_of(s) for s in ("big", "a", "b")]     # 90 clamped to 80
out["retained_blocks"] = r.governor.retained_blocks
out["refused_budget"] = {k: v for k, v in r.governor.refused.items() if k.endswith("blocks")}
print("RESULT" + json.dumps(out))
"""


def test_the_plugin_bounds_what_directives_may_do():
    out = run_check(_BOUNDS_CHECK)
    assert out == {
        "limits": [100, 60.0],
        "sessions": 100, "session_class": 100, "refused": {"sessions": 300},
        "class_and_expiry": [True], "prefetch_clamped": 60.0, "heap_bounded": True,
        "queued": 500, "refused_more": {"sessions": 300, "invalid": 1, "queued": 100},
        "after_forget": [0, 0, 0, 100],
        "budget_classes": [50, 80, 50], "retained_blocks": 4,
        "refused_budget": {"session_blocks": 1, "retained_blocks": 1},
    }
