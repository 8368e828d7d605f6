"""Sharded gateways on Ray Serve (ray_fleet/serve_shards.py), on a local Ray on loopback.

Two gateway replicas behind Serve's proxy and :class:`ShardRouter`, four simworkers (each
replica owns two), the 64 programs of the nginx tier (tests/support/shard_fleet.py). Every
call of a program must reach the replica that owns it — the shard the simulator's rendezvous
hash gives its root — and no other; a replica killed under calls loses only the calls in
flight on it, and its programs continue on their next call, on the replica Serve starts in
its place. Skipped, saying why, when Ray Serve cannot be imported (the ``ray`` extra).
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None
    or importlib.util.find_spec("fastapi") is None,
    reason="cannot import ray.serve: install the ray extra (pip install -e '.[ray]') to run the Ray tier")

from controller.identity import shard_key  # noqa: E402
from ray_fleet.rollout import gateway_counts  # noqa: E402
from scheduler.rendezvous import rendezvous_shard  # noqa: E402
from tests.support.gateway_harness import ADMIN_TOKEN  # noqa: E402
from tests.support.shard_fleet import (  # noqa: E402
    ROOTS,
    assert_held_by_owners,
    call,
    free_port,
    program_headers,
    root_headers,
    send_every_call,
    simworker_entries,
)


SHARDS = 2
# Long enough that a call of LONG_TOKENS is in flight for seconds, short enough that the
# 4-token calls of the placement test take milliseconds.
TIME_SCALE = 0.2
LONG_TOKENS = 2000



def admin(shard: int) -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_TOKEN}", "x-sluice-shard": str(shard)}


@pytest.fixture(scope="module")
def serve_url() -> Iterator[str]:
    import ray
    from ray import serve

    from ray_fleet.serve_shards import sharded_gateway

    with ExitStack() as stack:
        entries = simworker_entries(stack, [f"w{i}" for i in range(4)], time_scale=TIME_SCALE)
        ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
                 log_to_driver=False)
        stack.callback(ray.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        config = {"admin_token": ADMIN_TOKEN, "admin_token_env": None, "capacity_retry_s": 0.1}
        serve.run(sharded_gateway(config, entries, SHARDS, num_cpus=0.5), name="sluice",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"


def programs_on(client: httpx.Client, shard: int) -> set[str]:
    answer = client.get("/sluice/programs", headers=admin(shard))
    answer.raise_for_status()
    return {program["session_id"] for program in answer.json()["programs"]}


def chats_on(client: httpx.Client, shard: int) -> float:
    answer = client.get("/metrics", headers={"x-sluice-shard": str(shard)})
    answer.raise_for_status()
    return gateway_counts(answer.text)["chat_ok"]


def test_every_call_of_a_program_reaches_the_replica_that_owns_it(serve_url):
    calls = program_headers()
    owner = {key: rendezvous_shard(shard_key(headers[0]), SHARDS) for key, headers in calls.items()}
    with httpx.Client(base_url=serve_url, timeout=60, trust_env=False) as client:
        before = [chats_on(client, shard) for shard in range(SHARDS)]
        send_every_call(client, calls)

        # each replica answered exactly the calls of the programs it owns
        expected = [sum(len(calls[key]) for key in calls if owner[key] == shard) for shard in range(SHARDS)]
        expected[owner[ROOTS[0]]] += 1  # the streamed call
        counted = [chats_on(client, shard) - before[shard] for shard in range(SHARDS)]
        assert counted == expected, (counted, expected)
        assert min(expected) >= 12, expected  # both shards take programs

        # and holds those programs only, a sub-agent with its parent, over its own workers
        assert_held_by_owners([programs_on(client, shard) for shard in range(SHARDS)], owner)
        for shard in range(SHARDS):
            workers = client.get("/sluice/workers", headers=admin(shard)).json()["workers"]
            names = sorted(worker["name"] for worker in workers)
            assert names == [f"w{i}" for i in range(4) if i % SHARDS == shard], (shard, names)


def test_a_call_goes_to_its_program_s_shard_or_the_one_it_names():
    from ray_fleet.serve_shards import call_shard, shard_workers

    headers = {"x-session-id": "child", "x-parent-session-id": "parent"}
    assert call_shard(headers, None, 4) == rendezvous_shard("parent", 4)
    # Serve's own session header, for a call made through a handle, when no header names one
    assert call_shard({}, "handle-session", 4) == rendezvous_shard("handle-session", 4)
    assert call_shard({}, None, 4) == rendezvous_shard("", 4)
    assert call_shard({**headers, "x-sluice-shard": "3"}, None, 4) == 3
    for bad in ("4", "-1", "one"):  # no such shard: shard 0's gateway answers for itself
        assert call_shard({"x-sluice-shard": bad}, None, 4) == 0
    assert [w["name"] for w in shard_workers([{"name": f"w{i}"} for i in range(5)], 1, 2)] == ["w1", "w3"]
    with pytest.raises(ValueError, match="owns no worker"):
        shard_workers([{"name": "w0"}], 1, 2)


def _long_call(url: str, headers: dict[str, str], outcome: dict[str, object], key: str) -> None:
    try:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            outcome[key] = call(client, headers, max_tokens=LONG_TOKENS).status_code
    except httpx.HTTPError as err:
        outcome[key] = type(err).__name__


def test_a_killed_replica_loses_only_its_calls_in_flight_and_its_programs_continue(serve_url):
    import ray

    headers = root_headers()
    owner = {root: rendezvous_shard(shard_key(h), SHARDS) for root, h in headers.items()}
    # two programs of each shard make a long call, in flight when a replica is killed
    in_flight = [root for shard in range(SHARDS) for root in [r for r in ROOTS if owner[r] == shard][:2]]
    outcome: dict[str, object] = {}
    threads = [threading.Thread(target=_long_call, args=(serve_url, headers[root], outcome, root))
               for root in in_flight]
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=serve_url, timeout=60, trust_env=False) as client:
        deadline = time.monotonic() + 30
        while sum(len(programs_on(client, shard) & set(in_flight)) for shard in range(SHARDS)) < len(in_flight):
            assert time.monotonic() < deadline, "the long calls did not all reach their replicas"
            time.sleep(0.1)
    time.sleep(0.5)

    replicas = sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                      if actor["name"].startswith("SERVE_REPLICA::") and "GatewayShard" in actor["name"])
    assert len(replicas) == SHARDS, replicas
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(120)
    assert len(outcome) == len(in_flight), outcome

    # exactly the killed replica's calls failed; the other's ran to the end
    failed = {owner[root] for root in in_flight if outcome[root] != 200}
    assert len(failed) == 1, outcome
    killed = failed.pop()
    for root in in_flight:
        assert (outcome[root] == 200) == (owner[root] != killed), (root, owner[root], outcome)

    # every program's next call is answered: the killed shard's once Serve has replaced the
    # replica (the call waits in the router meanwhile), on the same workers
    with httpx.Client(base_url=serve_url, timeout=120, trust_env=False) as client:
        for root, h in headers.items():
            answer = call(client, h)
            assert answer.status_code == 200, (root, answer.status_code, answer.text[:300])
        replaced = programs_on(client, killed)
        assert {root for root in headers if owner[root] == killed} <= replaced
        workers = client.get("/sluice/workers", headers=admin(killed)).json()["workers"]
        assert sorted(w["name"] for w in workers) == [f"w{i}" for i in range(4) if i % SHARDS == killed]
