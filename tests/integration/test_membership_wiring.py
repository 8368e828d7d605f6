"""A worker added at run time through the admin API is wired as a configured one is, and
removing it closes everything that was opened for it (controller/fleet.py).

Real servers and sockets on loopback: simworkers (simworker/worker.py) publish real KV
events, keep a replay buffer and apply the directives they receive; the test's own ZMQ
sockets see, through socket monitors, the gateway connect to them and go away; fake vLLM
workers count the health checks and capacity probes that reach them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

from controller.admin_client import SluiceAdmin
from entry.ports import free_port
from simworker.worker import SimWorker, SimWorkerConfig
from simworker.worker import create_app as create_simworker
from tests.support.fake_vllm import FakeState, create_fake
from tests.support.kv_streams import (
    FramePublisher,
    Workload,
    applied_through,
    baseline,
    publisher,
    replay_all,
    snapshot,
    sync,
)
from tests.support.gateway_harness import (
    ADMIN_TOKEN,
    Gateway,
    ServerThread,
    gateway,
    serve_config,
    wait_for,
)

BS = 16
# A configured worker that never takes a program (nothing answers, so its capacity stays
# unknown): every program goes to the worker a test adds.
QUIET = {"name": "quiet", "url": f"http://127.0.0.1:{free_port()}"}


# -- the simworker and what it published --------------------------------------------------------


@contextmanager
def simworker(name: str, **endpoints: str) -> Iterator[tuple[SimWorker, str]]:
    """A simworker with the given ZMQ endpoints (``kv_events``, ``replay``, ``directives``)."""
    endpoints.setdefault("kv_events", "tcp://127.0.0.1:*")
    app = create_simworker(SimWorkerConfig(name=name, num_blocks=400, block_size=BS,
                                           time_scale=0.05, **endpoints))
    server = ServerThread(app).start()
    try:
        yield app.state.worker, server.url
    finally:
        server.stop()


def call(url: str, session: str) -> None:
    """One call of ``session``, to the gateway or straight to a simworker."""
    body = {"model": "sluice-sim", "max_tokens": 4, "messages": [
        {"role": "system", "content": f"You are the engineer of {session}. " * 20},
        {"role": "user", "content": "Next step."}]}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        r = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert r.status_code == 200, r.text


def published(sim: SimWorker) -> tuple[dict, dict]:
    """The index a subscriber that never missed a batch of ``sim`` would hold."""
    return baseline(replay_all(sim.replay_endpoint))


def index_of(gw: Gateway, worker: str) -> tuple[dict, dict]:
    return snapshot(gw.parts.admission.policy.index.worker(worker))


def subscribed(gw: Gateway, worker: str, sim_url: str) -> None:
    """Until the gateway receives ``worker``'s events: calls straight to the simworker, each
    of a new session so that each publishes, until a batch reaches the gateway (a SUB misses
    what is published before it has joined; the gateway catches those up from replay)."""
    sessions = (f"warm-up-{i}" for i in itertools.count())
    wait_for(lambda: call(sim_url, next(sessions))
             or gw.parts.kv_events.stats[worker].received > 0,
             timeout=10, what=f"{worker}'s KV events to reach the gateway")


def caught_up(gw: Gateway, worker: str, sim: SimWorker) -> None:
    """Until the gateway has applied every batch ``sim`` published."""
    def applied() -> bool:
        stats = gw.parts.kv_events.stats.get(worker)
        return (stats is not None and stats.last_seq.get(0) == sim.publisher.next_seq - 1
                and gw.parts.kv_events.queue_depths().get(worker, 0) == 0)
    wait_for(applied, timeout=10, what=f"{worker}'s KV events applied")


def retained_on(sim: SimWorker, session: str) -> None:
    """Until the simworker's pool holds ``session``'s blocks in the retained class (90), as a
    ``kv.retain`` from the gateway puts them."""
    wait_for(lambda: sim.engine.pool._class_of(session) == 90, timeout=10,
             what=f"the simworker to apply the retain of {session}")


# -- looking inside the gateway --------------------------------------------------------------------


def task_names(gw: Gateway) -> list[str]:
    """The names of every task on the gateway's event loop (a worker's are named for it)."""
    async def names() -> list[str]:
        return [task.get_name() for task in asyncio.all_tasks()]
    loop = gw.server.server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(names(), loop).result(10)


def tasks_of(gw: Gateway, worker: str) -> list[str]:
    return [name for name in task_names(gw) if name.endswith(f" of {worker}")]


def failures_logged(gw: Gateway) -> list[str]:
    return [line for line in gw.log.lines()
            if "Traceback" in line or '"level": "error"' in line or '"level": "critical"' in line]


def removed_without_a_trace(gw: Gateway, admin: SluiceAdmin, worker: str) -> None:
    """Drain and remove ``worker``; then nothing of it is left in the gateway."""
    assert f'worker="{worker}"' in gw.client.get("/metrics").text
    admin.drain(worker)
    admin.wait_idle([worker], timeout_s=10)
    admin.remove(worker)
    assert worker not in admin.workers()
    assert tasks_of(gw, worker) == []
    assert worker not in gw.parts.kv_events.stats
    assert worker not in gw.parts.kv_events.queue_depths()
    assert worker not in gw.parts.admission.sink.endpoints()
    assert worker not in gw.parts.admission.policy.index.workers()
    assert worker not in gw.parts.pool.names()
    assert f'worker="{worker}"' not in gw.client.get("/metrics").text


# -- a worker added live ---------------------------------------------------------------------------


def test_a_worker_added_live_is_caught_up_from_its_replay_fed_its_events_and_sent_directives():
    with simworker("late", replay="tcp://127.0.0.1:*", directives="tcp://127.0.0.1:*") as (sim, url), \
            gateway(serve_config([QUIET])) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
        call(url, "before")  # published while no gateway listens
        published_before = sim.publisher.next_seq
        assert published_before > 0
        added = admin.add_worker("late", url, kv_events=sim.kv_endpoint, replay=sim.replay_endpoint,
                                 directives=sim.directives.bound_endpoint)
        assert added["kv_events"] == sim.kv_endpoint
        assert added["directives"] == sim.directives.bound_endpoint
        wait_for(lambda: admin.workers()["late"]["capacity_source"] == "metrics",
                 what="late's capacity read off its /metrics")
        assert admin.workers()["late"]["capacity_tokens"] == (400 - 1) * BS  # less the null block

        subscribed(gw, "late", url)
        call(gw.url, "after")
        assert admin.programs()["after"]["home_worker"] == "late"
        caught_up(gw, "late", sim)
        # exactly what the worker published, from seq 0: the batches from before it was
        # added came from its replay socket
        assert index_of(gw, "late") == published(sim)
        assert gw.parts.admission.policy.index.session_tokens("late", "before") > 0
        stats = gw.parts.kv_events.stats["late"]
        assert stats.replayed >= published_before and not stats.resets
        assert admin.workers()["late"]["utilization_source"] == "kv_index"
        # the policy's retain for the program it placed reached the worker's directive socket
        retained_on(sim, "after")
        assert sim.directives.applied >= 1 and sim.directives.dropped == 0
        assert failures_logged(gw) == []


def test_a_removed_worker_leaves_nothing_behind_and_can_be_added_again():
    with simworker("late", replay="tcp://127.0.0.1:*", directives="tcp://127.0.0.1:*") as (sim, url), \
            gateway(serve_config([QUIET])) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
        entry = {"kv_events": sim.kv_endpoint, "replay": sim.replay_endpoint,
                 "directives": sim.directives.bound_endpoint}
        admin.add_worker("late", url, **entry)
        assert {"tasks of late", "health checks of late", "KV events of late",
                "KV-event reader of late", "KV-event applier of late"} <= set(tasks_of(gw, "late"))
        subscribed(gw, "late", url)
        call(gw.url, "first")
        caught_up(gw, "late", sim)
        retained_on(sim, "first")

        removed_without_a_trace(gw, admin, "late")
        removed_at = len(gw.log.lines())
        call(url, "while-out")  # its engine goes on publishing
        assert [line for line in gw.log.lines()[removed_at:] if '"late"' in line] == []

        admin.add_worker("late", url, **entry)
        subscribed(gw, "late", url)
        call(gw.url, "again")
        caught_up(gw, "late", sim)
        # a fresh subscription, caught up from seq 0: the batches published while it was
        # out are there too, and nothing twice
        assert index_of(gw, "late") == published(sim)
        assert gw.parts.admission.policy.index.session_tokens("late", "while-out") > 0
        retained_on(sim, "again")
        assert failures_logged(gw) == []


def test_a_worker_added_live_in_the_llm_d_layout_is_fed_from_the_bound_socket_until_removed():
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = serve_config([QUIET], kv_events_bind=bind)
    with gateway(config) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin, \
            simworker("late", kv_events=bind, replay="tcp://127.0.0.1:*") as (sim, url):
        wait_for(lambda: gw.parts.kv_events.bound_endpoint, what="the bound socket")
        # its topic, kv@late, names no worker yet (calls until its PUB has joined the socket)
        ignored = gw.parts.kv_events.ignored
        sessions = (f"before-{i}" for i in itertools.count())
        wait_for(lambda: call(url, next(sessions)) or ignored["unknown_topic"] >= 1,
                 timeout=10, what="late's frames ignored before it joined")

        added = admin.add_worker("late", url, replay=sim.replay_endpoint)
        assert added["kv_events"] == "kv_events_bind"
        call(gw.url, "after")
        caught_up(gw, "late", sim)
        assert index_of(gw, "late") == published(sim)
        assert gw.parts.admission.policy.index.session_tokens("late", "before-0") > 0

        removed_without_a_trace(gw, admin, "late")
        # what it publishes now is no worker's again
        before = ignored["unknown_topic"]
        call(url, "while-out")
        wait_for(lambda: ignored["unknown_topic"] > before, what="late's frames ignored again")
        assert "late" not in gw.parts.admission.policy.index.workers()
        assert failures_logged(gw) == []


# -- a removed worker's tasks and sockets are gone --------------------------------------------------


class _Counted:
    """An ASGI app that counts the requests reaching it, by path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.hits: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.hits[scope["path"]] += 1
        await self.app(scope, receive, send)


@contextmanager
def counted_fake(name: str) -> Iterator[tuple[_Counted, str]]:
    """A fake worker whose /metrics never tells its capacity: it is probed until it leaves."""
    app = _Counted(create_fake(FakeState(name, num_gpu_blocks=None)))
    server = ServerThread(app).start()
    try:
        yield app, server.url
    finally:
        server.stop()


class _Watched:
    """A socket of the test's, bound on loopback, whose monitor sees peers come and go."""

    def __init__(self, ctx: zmq.Context, kind: int) -> None:
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def wait(self, event: int, what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.monitor.poll(left_ms), f"timed out waiting for {what}"
            if recv_monitor_message(self.monitor)["event"] == event:
                return

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


def test_removing_a_worker_stops_its_tasks_and_closes_its_sockets():
    ctx = zmq.Context()
    kv_events, directives = _Watched(ctx, zmq.PUB), _Watched(ctx, zmq.PULL)
    try:
        with counted_fake("witness") as (witness, witness_url), counted_fake("gone") as (gone, gone_url):
            config = serve_config([{"name": "witness", "url": witness_url}],
                                  health_interval_s=0.05, capacity_retry_s=0.05)
            with gateway(config) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
                def add() -> None:
                    admin.add_worker("gone", gone_url, kv_events=kv_events.endpoint,
                                     directives=directives.endpoint)
                    kv_events.wait(zmq.EVENT_ACCEPTED, "the gateway's SUB to connect")
                    directives.wait(zmq.EVENT_ACCEPTED, "the gateway's PUSH to connect")
                    seen = gone.hits.copy()
                    wait_for(lambda: gone.hits["/metrics"] > seen["/metrics"]
                             and gone.hits["/health"] > seen["/health"],
                             what="gone's capacity probes and health checks")

                add()
                removed_without_a_trace(gw, admin, "gone")
                kv_events.wait(zmq.EVENT_DISCONNECTED, "the gateway's SUB to go")
                directives.wait(zmq.EVENT_DISCONNECTED, "the gateway's PUSH to go")
                # The witness is probed and checked on the same schedule as gone was: once
                # it has been probed and checked five more times, gone would have been too.
                start = witness.hits.copy()
                wait_for(lambda: witness.hits["/metrics"] > start["/metrics"],
                         what="a probe of the witness")  # one of gone's may have been under way
                gone_then, witness_then = gone.hits.copy(), witness.hits.copy()
                wait_for(lambda: witness.hits["/metrics"] >= witness_then["/metrics"] + 5
                         and witness.hits["/health"] >= witness_then["/health"] + 5,
                         what="five more probes and checks of the witness")
                assert gone.hits == gone_then
                removed = next(i for i, line in enumerate(gw.log.lines())
                               if "worker removed" in line and '"gone"' in line)
                assert [line for line in gw.log.lines()[removed + 1:] if '"gone"' in line] == []

                add()  # the same name again, wired again
                assert failures_logged(gw) == []
    finally:
        kv_events.close()
        directives.close()
        ctx.term()


# -- a data-parallel rank's own worker joins and leaves ------------------------------------------


def _publish(*publishers: tuple[FramePublisher, Workload], batches: int = 5) -> None:
    for _ in range(batches):
        for pub, work in publishers:
            pub.publish(work.batch())


@contextmanager
def two_ranks_on_one_socket() -> Iterator[tuple[FramePublisher, FramePublisher, Gateway,
                                                 SluiceAdmin]]:
    """Ranks 0 and 1 of worker w1 publishing to the gateway's bound socket (llm-d's layout)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    with publisher(endpoint=bind, topic="kv@w1@org/model") as rank0, \
            publisher(endpoint=bind, topic="kv@w1@org/model", rank=1) as rank1:
        # w1's replay is rank 0's; vLLM's rule puts rank 1's at its port + 1, where nothing
        # listens here: rank 1 has a replay socket of its own only as worker w1#dp1
        config = serve_config([{"name": "w1", "url": QUIET["url"], "capacity_tokens": 100_000,
                                "replay": rank0.replay}], kv_events_bind=bind,
                              # short, for the replay nobody answers; long enough for the ones
                              # that are answered on a loaded machine
                              kv_replay_timeout_s=1.5)
        with gateway(config) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
            yield rank0, rank1, gw, admin


def test_a_ranks_own_worker_takes_its_blocks_when_it_joins_and_gives_them_back_when_it_leaves():
    with two_ranks_on_one_socket() as (rank0, rank1, gw, admin):
        ranks = [(rank0, Workload(1)), (rank1, Workload(2, base=100_000))]
        sync(gw, rank0, "w1")  # (the batches sync publishes are empty)
        sync(gw, rank1, "w1", rank=1)
        _publish(*ranks)
        applied_through(gw, "w1", rank1.next_seq - 1, rank=1)
        applied_through(gw, "w1", rank0.next_seq - 1)
        assert index_of(gw, "w1") == baseline(rank0.history, rank1.history)  # no w1#dp1 yet

        admin.add_worker("w1#dp1", QUIET["url"], capacity_tokens=100_000, replay=rank1.replay)
        _publish(*ranks)
        applied_through(gw, "w1#dp1", rank1.next_seq - 1, rank=1)
        applied_through(gw, "w1", rank0.next_seq - 1)
        # rank 1's stream moved to w1#dp1, caught up there from seq 0 by its replay;
        # w1's index was reset and rebuilt from rank 0's alone
        assert index_of(gw, "w1#dp1") == baseline(rank1.history)
        assert index_of(gw, "w1") == baseline(rank0.history)
        assert gw.parts.kv_events.stats["w1"].resets == {"rank_rerouted": 1}

        admin.drain("w1#dp1")
        admin.remove("w1#dp1")
        back = rank1.next_seq
        _publish(*ranks)
        applied_through(gw, "w1", rank1.next_seq - 1, rank=1)
        applied_through(gw, "w1", rank0.next_seq - 1)
        # rank 1 feeds w1 again, from the batch after the removal on (its replay is not
        # where w1's would put it, so nothing before that can be caught up)
        assert index_of(gw, "w1") == baseline(rank0.history, rank1.history[back:])
        assert "w1#dp1" not in gw.parts.admission.policy.index.workers()
        assert gw.parts.kv_events.stats["w1"].resets == {"rank_rerouted": 1}
        assert failures_logged(gw) == []


def test_a_quiet_rank_is_caught_up_again_as_soon_as_another_rank_resets_its_index():
    """Rank 0 publishes nothing after rank 1's own worker joins: the reset of w1 that rank 1's
    move causes must not leave w1 without rank 0's blocks until rank 0 publishes again."""
    with two_ranks_on_one_socket() as (rank0, rank1, gw, admin):
        sync(gw, rank0, "w1")
        sync(gw, rank1, "w1", rank=1)
        _publish((rank0, Workload(1)), (rank1, Workload(2, base=100_000)))
        applied_through(gw, "w1", rank1.next_seq - 1, rank=1)
        applied_through(gw, "w1", rank0.next_seq - 1)

        admin.add_worker("w1#dp1", QUIET["url"], capacity_tokens=100_000, replay=rank1.replay)
        _publish((rank1, Workload(3, base=200_000)))  # rank 0 stays quiet
        applied_through(gw, "w1#dp1", rank1.next_seq - 1, rank=1)
        assert gw.parts.kv_events.stats["w1"].resets == {"rank_rerouted": 1}
        assert index_of(gw, "w1") == baseline(rank0.history)
        assert failures_logged(gw) == []
