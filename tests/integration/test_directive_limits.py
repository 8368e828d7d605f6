"""A simworker's directive socket survives any input and bounds what a directive may do.

Real ZMQ sockets on 127.0.0.1: a whole simworker (its app served by uvicorn) for the socket
surviving hostile input, and the worker's :class:`DirectiveSocket` on a real engine, served on
its own event loop with a clock the test moves, for the limits (sluice_vllm_plugin's
directive_limits, the same the engine plugin applies: tests/fidelity/
test_vllm_plugin_directive_limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import msgspec
import pytest
import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from sim.engine import Engine
from sim.step_time import DEFAULT_PRESET, preset
from simworker.config import SimWorkerConfig
from simworker.directive_socket import DirectiveSocket
from sluice_vllm_plugin.directive_envelope import KvRetain, RetainPayload
from sluice_vllm_plugin.directive_limits import (DirectiveGovernor, DirectiveLimits,
                                                 limits_from_environment)
from tests.integration.test_simworker import serve

WAIT_S = 60.0   # generous: the machine may be loaded


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not met in {timeout} s"
        time.sleep(0.02)


def envelope(*actions: tuple[str, dict], message_id: str = "m") -> dict:
    return {"protocol_version": 1, "message_id": message_id,
            "actions": [{"action_id": f"a{i}", "action_type": kind, "action_version": 1, "payload": payload}
                        for i, (kind, payload) in enumerate(actions)]}


def as_json(*actions: tuple[str, dict]) -> bytes:
    return json.dumps(envelope(*actions)).encode()


def as_msgpack(*actions: tuple[str, dict]) -> bytes:
    # msgpack carries inf and NaN, which JSON cannot
    return msgspec.msgpack.encode(envelope(*actions))


def retain(session: str, priority: int = 90, ttl_s: float = 30.0) -> tuple[str, dict]:
    return ("kv.retain", {"session_id": session, "priority": priority, "ttl_s": ttl_s})


def deeply_nested_json(depth: int = 20_000) -> bytes:
    # an unknown key is skipped by the decoder, recursively: a RecursionError (40 KB, under
    # the default size limit, so it reaches the handler)
    return (b'{"protocol_version":1,"message_id":"m","junk":' + b"[" * depth + b"]" * depth
            + b',"actions":[]}')


def deeply_nested_msgpack(depth: int = 20_000) -> bytes:
    head = msgspec.msgpack.encode({"protocol_version": 1, "message_id": "m", "actions": []})
    # one more key than encoded (0x84 for a 4-key map), whose value is a list in a list ...
    return b"\x84" + head[1:] + b"\xa4junk" + b"\x91" * depth + b"\xc0"


HOSTILE = [
    deeply_nested_json(),
    deeply_nested_msgpack(),
    b"\xc1\xff\x00garbage",
    b"",
    b"{not json",
    "naïve".encode("latin-1"),
    json.dumps([1, 2]).encode(),
    json.dumps({"protocol_version": "1", "message_id": 5, "actions": {}}).encode(),
    as_json(("kv.retain", {"session_id": ["s"], "priority": "high", "ttl_s": "forever"})),
    as_msgpack(retain("s", ttl_s=math.nan)),
    as_msgpack(retain("s", ttl_s=-1.0)),
    as_json(("kv.evict", {"session_id": "s"})),
    as_json(retain("x" * 257)),                  # longer than any session id the gateway takes
]


# -- a whole simworker ---------------------------------------------------------------------

@contextlib.contextmanager
def simworker(**overrides) -> Iterator[tuple[str, object]]:
    """A whole simworker with a directive socket (test_simworker's ``serve``): its URL and it."""
    settings = dict(name="d0", num_blocks=256, block_size=16, kv_events=None, replay=None,
                    directives="tcp://127.0.0.1:*", time_scale=0.05)
    settings.update(overrides)
    with serve(**settings) as running:
        yield running.url, running.worker


def metric(text: str, name: str, **labels: str) -> float:
    wanted = "".join(f'(?=[^}}]*{key}="{re.escape(value)}")' for key, value in labels.items())
    match = re.search(rf"^{re.escape(name)}\{{{wanted}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def disconnected_after_sending(endpoint: str, message: bytes, zctx: zmq.Context) -> bool:
    """Send one message from a fresh PUSH; whether the receiver cut the connection (waits
    up to WAIT_S for it)."""
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    monitor = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        push.connect(endpoint)
        push.send(message)
        return bool(monitor.poll(int(WAIT_S * 1000))) and \
            recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        push.disable_monitor()
        monitor.close(0)
        push.close(0)


def test_no_input_stops_the_simworkers_directive_socket():
    """Before: a deeply nested envelope raised RecursionError out of the handler, the socket's
    task ended and no directive was applied again, while /health stayed 200."""
    with simworker() as (url, worker), zmq.Context() as zctx:
        directives = worker.directives
        endpoint = directives.bound_endpoint
        body = {"model": "sluice-sim", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Keep my cache. " * 40}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": "keeper"},
                       timeout=60)
        assert r.status_code == 200, r.text
        pool = worker.engine.pool
        wait_for(lambda: pool.session_block_count("keeper") > 0, "the keeper's blocks are freed")

        push = zctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(endpoint)
        for message in HOSTILE:
            push.send(message)
        push.send_multipart([b"{", b"two frames"])
        push.send(as_json(retain("keeper")))          # in order, behind all of the above
        push.close()
        wait_for(lambda: directives.applied == 1, "a valid retain is applied after the bad input")
        assert pool._class_of("keeper") == 90
        assert directives.received == len(HOSTILE) + 2
        assert directives.drops == {"malformed": len(HOSTILE), "multipart": 1}

        # a frame over the size limit: ZMQ cuts the sender off before anything is read
        assert directives._socket.getsockopt(zmq.MAXMSGSIZE) == directives.limits.max_message_bytes
        assert disconnected_after_sending(endpoint, b"{" + b" " * (2 * directives.limits.max_message_bytes),
                                          zctx)
        with zctx.socket(zmq.PUSH) as push:
            push.setsockopt(zmq.LINGER, 5000)
            push.connect(endpoint)
            push.send(as_json(("kv.demote", {"session_id": "keeper"})))
        wait_for(lambda: directives.applied == 2, "the socket serves on after a frame too large")
        assert pool._class_of("keeper") == 0
        assert directives.received == len(HOSTILE) + 3      # the large frame never arrived

        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric(text, "sluice_simworker:directive_drops_total", reason="malformed") == len(HOSTILE)
        assert metric(text, "sluice_simworker:directive_drops_total", reason="multipart") == 1
        assert metric(text, "sluice_simworker:directives_dropped_total") == len(HOSTILE) + 1
        assert metric(text, "sluice_simworker:directives_applied_total") == 2
        assert metric(text, "sluice_simworker:directive_sessions") == 1


# -- the directive socket on a real engine, on a clock the test moves -----------------------------

class Receiver:
    """A DirectiveSocket on a real engine, served on an event loop of its own, at
    tcp://127.0.0.1; ``now`` is its clock (virtual seconds)."""

    def __init__(self, limits: DirectiveLimits, num_blocks: int = 64) -> None:
        self.engine = Engine("d0", preset(DEFAULT_PRESET), num_blocks=num_blocks, block_size=4)
        self.pool = self.engine.pool
        self.now = 0.0
        self.socket = DirectiveSocket("tcp://127.0.0.1:*", self.engine, lambda: self.now, limits)
        self.governor = self.socket.governor
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._zctx = zmq.Context()
        self._push: zmq.Socket | None = None

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.socket.open()
        self._task = asyncio.current_task()
        self._ready.set()
        try:
            await self.socket.serve()
        except asyncio.CancelledError:
            pass
        finally:
            self.socket.close()

    def __enter__(self) -> "Receiver":
        self._thread.start()
        assert self._ready.wait(WAIT_S), "the directive socket did not open"
        self._push = self._zctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.socket.bound_endpoint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._push is not None:
            self._push.close(0)
        self._zctx.term()
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(WAIT_S)

    def send(self, *messages: bytes) -> None:
        """Send, in order, and wait until the socket has handled every one."""
        target = self.socket.received + len(messages)
        for message in messages:
            self._push.send(message)
        wait_for(lambda: self.socket.received >= target, f"{len(messages)} messages received")
        self.sync()

    def sync(self) -> None:
        """Wait until the loop is between messages: handling one never awaits, so once the
        loop runs something else the message being handled is done."""
        async def between_messages() -> None:
            pass
        asyncio.run_coroutine_threadsafe(between_messages(), self._loop).result(WAIT_S)

    def own(self, session: str, blocks: int, first_hash: int) -> None:
        """The session's request cached ``blocks`` blocks and ended (before serving starts)."""
        ids = self.pool.get_new_blocks(blocks)
        self.pool.cache_full_blocks(ids, list(range(first_hash, first_hash + blocks)), 0, blocks,
                                    session_id=session)
        self.pool.free_blocks(reversed(ids), session_id=session)


def test_bad_input_is_counted_and_logged_once_with_context_not_once_each():
    with structlog.testing.capture_logs() as logs, Receiver(DirectiveLimits()) as rx:
        rx.send(*[b"\xc1garbage"] * 40, deeply_nested_json())
        # and whatever a caller hands the handler itself: it must not raise
        for thing in ("text", None, 12, 3.5, [b"x"], bytearray(b"{"), memoryview(b"\x00")):
            rx.socket.handle(thing)
    assert rx.socket.drops == {"malformed": 48}
    dropped = [entry for entry in logs if entry["event"] == "directive dropped"]
    # the first at once; then at most one line per 10 s, however many arrive
    assert 1 <= len(dropped) < 10, dropped
    first = dropped[0]
    assert first["log_level"] == "warning" and first["reason"] == "malformed"
    assert first["size"] == len(b"\xc1garbage") and first["problem"] and first["endpoint"]


def test_forged_retains_cannot_grow_a_workers_directive_state_without_bound():
    """Before: every forged retain added state for good (200,000 took a worker from 74 to
    149 MB): a session per retain, and an expiry per retain, even of one session."""
    limits = DirectiveLimits(max_sessions=100, max_ttl_s=60.0, forget_after_s=120.0)
    with Receiver(limits) as rx:
        rx.send(*[as_msgpack(retain(f"forged-{i}", ttl_s=math.inf)) for i in range(400)])
        assert rx.governor.sessions == 100 and rx.governor.refused == {"sessions": 300}
        assert len(rx.pool._session_class) == 100
        # inf clamped: every retain that was taken ends within max_ttl_s
        assert {expires for _, expires in rx.pool._session_class.values()} == {60.0}

        rx.send(*[as_msgpack(retain("forged-0", ttl_s=math.inf)) for _ in range(500)])
        assert len(rx.pool._session_class) == 100
        assert len(rx.pool._expiries) <= 2 * 100 + 64

        # forget_after_s later the state is gone (released: blocks back to plain LRU), and
        # new sessions are taken again
        rx.now = 121.0
        wait_for(lambda: rx.governor.sessions == 0, "lapsed sessions forgotten while idle")
        rx.sync()
        assert rx.pool._session_class == {} and rx.governor.forgotten == 100
        rx.send(as_json(retain("legit")))
        assert rx.governor.sessions == 1 and rx.pool._class_of("legit") == 90


def test_ttl_and_priority_are_clamped_to_the_receivers_limits():
    limits = DirectiveLimits(max_ttl_s=60.0, forget_after_s=600.0, priority_min=10, priority_max=80)
    with Receiver(limits) as rx:
        rx.now = 5.0
        rx.send(as_msgpack(retain("high", priority=100, ttl_s=math.inf)),
                as_json(retain("low", priority=0, ttl_s=1e9)),
                as_json(retain("plain", priority=70, ttl_s=20.0)),
                as_json(("kv.prefetch", {"session_id": "soon", "priority": 99, "deadline_s": 1e6})))
        assert rx.pool._session_class["high"] == (80, 65.0)
        assert rx.pool._session_class["low"] == (10, 65.0)
        assert rx.pool._session_class["plain"] == (70, 25.0)
        assert rx.governor.clamped == 3 and rx.socket.applied == 4
    # an action made in process is not decoded: the governor refuses what the envelope would
    governor = DirectiveGovernor(limits)
    for ttl in (math.nan, -1.0):
        assert governor.admit(KvRetain(RetainPayload("s", 90, ttl)), 0.0) is None
    assert governor.refused == {"invalid": 2} and governor.sessions == 0


def test_retains_beyond_the_retained_block_budgets_are_refused():
    limits = DirectiveLimits(max_session_retained_blocks=4, max_retained_blocks=6)
    with Receiver(limits, num_blocks=64) as rx:
        rx.own("big", 5, 1000)
        rx.own("a", 4, 2000)
        rx.own("b", 3, 3000)
        rx.send(as_json(retain("big", ttl_s=30.0)), as_json(retain("a", ttl_s=30.0)),
                as_json(retain("b", ttl_s=30.0)))
        assert rx.governor.refused == {"session_blocks": 1, "retained_blocks": 1}
        assert [rx.pool._class_of(s) for s in ("big", "a", "b")] == [50, 90, 50]
        assert rx.governor.retained_blocks == 4
        # below the normal class a retain holds nothing back: not counted
        rx.send(as_json(retain("big", priority=40, ttl_s=30.0)))
        assert rx.pool._class_of("big") == 40 and rx.governor.retained_blocks == 4
        # once a's retain has ended its blocks stop counting, and b's fits
        rx.now = 31.0
        rx.send(as_json(retain("b", ttl_s=30.0)))
        assert rx.pool._class_of("b") == 90 and rx.governor.retained_blocks == 3
        # a demoted session holds nothing back either
        rx.send(as_json(("kv.demote", {"session_id": "b"})), as_json(retain("a", ttl_s=30.0)))
        assert rx.pool._class_of("a") == 90 and rx.governor.retained_blocks == 4


def test_oversize_and_multipart_messages_are_dropped_by_the_handler_too():
    # where ZMQ does not apply MAXMSGSIZE (inproc), the handler does
    with Receiver(DirectiveLimits(max_message_bytes=1024)) as rx:
        assert rx.socket._socket.getsockopt(zmq.MAXMSGSIZE) == 1024
        rx.socket.handle(as_json(retain("x" * 2000)))
        rx._push.send_multipart([as_json(retain("s")), as_json(retain("t"))])
        wait_for(lambda: rx.socket.drops["multipart"] == 1, "a multipart message dropped")
        rx.sync()
        rx.send(as_json(retain("s")))
        assert rx.socket.drops == {"oversize": 1, "multipart": 1} and rx.socket.applied == 1


def test_the_limits_are_checked_when_configured():
    for bad in (dict(directive_max_ttl_s=math.inf), dict(directive_max_ttl_s=math.nan),
                dict(directive_forget_after_s=10.0, directive_max_ttl_s=60.0),
                dict(directive_priority_min=60, directive_priority_max=40),
                dict(directive_priority_max=101), dict(directive_max_sessions=0),
                dict(directive_max_message_bytes=0), dict(directive_max_retained_blocks=-1)):
        with pytest.raises(ValueError, match="directive limits"):
            SimWorkerConfig(**bad)
    config = SimWorkerConfig(directive_max_ttl_s=30.0, directive_max_retained_blocks=100)
    assert config.directive_limits == DirectiveLimits(max_ttl_s=30.0, max_retained_blocks=100)
    # and a simworker's directive socket runs on them
    with simworker(directive_max_ttl_s=30.0, directive_max_retained_blocks=100) as (_, worker):
        assert worker.directives.limits == DirectiveLimits(max_ttl_s=30.0, max_retained_blocks=100)


def test_the_plugins_limits_come_from_the_environment_and_a_bad_value_keeps_its_default():
    limits, problems = limits_from_environment({
        "SLUICE_DIRECTIVE_MAX_TTL_S": "90", "SLUICE_DIRECTIVE_MAX_SESSIONS": "12",
        "SLUICE_DIRECTIVE_MAX_RETAINED_BLOCKS": "none", "SLUICE_DIRECTIVE_MAX_QUEUED": "lots"})
    assert limits == DirectiveLimits(max_ttl_s=90.0, max_sessions=12)
    assert problems == ["SLUICE_DIRECTIVE_MAX_QUEUED='lots' is not a number; default kept"]
    limits, problems = limits_from_environment({"SLUICE_DIRECTIVE_MAX_TTL_S": "inf"})
    assert limits == DirectiveLimits() and "every default kept" in problems[0]


def _retention_trace(seed: int) -> list:
    """What a block pool does under a random run of frees, retains (many of one session),
    demotions, releases, allocations and time: hand-out order and events after each step."""
    from sim.block_pool import BlockPool
    rng = random.Random(seed)
    pool = BlockPool(48, 4)
    sessions = [f"s{i}" for i in range(6)]
    held: list[tuple[str, list[int]]] = []
    now, next_hash, trace = 0.0, 1, []
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and pool.num_free >= 3:
            session, n = rng.choice(sessions), rng.randint(1, 3)
            ids = pool.get_new_blocks(n, now)
            pool.cache_full_blocks(ids, list(range(next_hash, next_hash + n)), 0, n, session_id=session)
            next_hash += n
            held.append((session, ids))
        elif op < 0.5 and held:
            session, ids = held.pop(rng.randrange(len(held)))
            pool.free_blocks(reversed(ids), session_id=session)
        elif op < 0.8:
            pool.retain(rng.choice(sessions), rng.choice([10, 60, 90]), rng.choice([0.5, 2.0, 8.0]), now)
        elif op < 0.85:
            pool.demote(rng.choice(sessions))
        elif op < 0.9:
            pool.release(rng.choice(sessions))
        else:
            now += rng.choice([0.25, 1.0, 3.0])
        trace.append((pool.free_queue_order(), [type(e).__name__ for e in pool.take_events()]))
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_the_block_pools_expiry_compaction_changes_nothing_it_does(seed, monkeypatch):
    # simulations must give the same results: compacting the expiry heap at every retain
    # hands out the same blocks, in the same order, with the same events, as never compacting
    import sim.block_pool
    monkeypatch.setattr(sim.block_pool, "EXPIRY_SLACK", 10**9)
    never = _retention_trace(seed)
    monkeypatch.setattr(sim.block_pool, "EXPIRY_SLACK", -10**9)
    always = _retention_trace(seed)
    assert always == never
