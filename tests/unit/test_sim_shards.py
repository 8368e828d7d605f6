"""Sharded gateways in the simulator (sim/shards.py): the rendezvous hash, the partition of
workers and programs, and a run in which no decision crosses a shard."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler.actions import Admit
from scheduler.calls import CallRequest
from scheduler.config import ProgramAwareConfig
from scheduler.policies import make_policy
from scheduler.rendezvous import rendezvous_shard
from sim.feeds import ClosedLoop
from sim.runs import run_policies, workload_feed
from sim.shards import ShardedPolicy
from tests.unit.test_simulation import program, simulation

ROOTS = [f"root-{i}" for i in range(4000)]


def test_rendezvous_spreads_roots_evenly_and_is_stable():
    owners = Counter(rendezvous_shard(root, 4) for root in ROOTS)
    assert set(owners) == {0, 1, 2, 3}
    assert all(0.22 <= n / len(ROOTS) <= 0.28 for n in owners.values()), owners
    assert [rendezvous_shard(root, 4) for root in ROOTS[:50]] == [rendezvous_shard(root, 4) for root in ROOTS[:50]]
    assert all(rendezvous_shard(root, 1) == 0 for root in ROOTS[:50])


def test_a_shard_added_takes_its_share_and_no_root_moves_between_the_others():
    before = {root: rendezvous_shard(root, 4) for root in ROOTS}
    after = {root: rendezvous_shard(root, 5) for root in ROOTS}
    moved = [root for root in ROOTS if before[root] != after[root]]
    assert all(after[root] == 4 for root in moved)
    assert 0.17 <= len(moved) / len(ROOTS) <= 0.23, len(moved)


def test_no_shards_is_refused():
    with pytest.raises(ValueError, match="shards must be ≥ 1"):
        rendezvous_shard("x", 0)
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedPolicy([])


def two_shards(workers: int = 4) -> ShardedPolicy:
    sharded = ShardedPolicy([make_policy(name="least_loaded"), make_policy(name="least_loaded")])
    for i in range(workers):
        sharded.add_worker(f"w{i}", 1_000)
    return sharded


def shard_workers(sharded: ShardedPolicy, shard: int) -> set[str]:
    return {w.name for w in sharded.shards[shard].snapshot(with_programs=False).workers}


def test_workers_go_to_shards_in_turn_and_the_snapshot_shows_them_all():
    sharded = two_shards()
    assert shard_workers(sharded, 0) == {"w0", "w2"} and shard_workers(sharded, 1) == {"w1", "w3"}
    assert [w.name for w in sharded.snapshot(with_programs=False).workers] == ["w0", "w2", "w1", "w3"]


def test_a_sub_agent_follows_its_parent_and_a_group_its_task():
    sharded = two_shards()
    parent = "parent-0"
    home = rendezvous_shard(parent, 2)
    # a child whose own id hashes to the other shard still lands on its parent's
    child = next(f"child-{i}" for i in range(100) if rendezvous_shard(f"child-{i}", 2) != home)
    decided = sharded.on_arrival(CallRequest("r1", parent, 100), now=0.0)
    assert isinstance(decided, Admit) and decided.worker in shard_workers(sharded, home)
    decided = sharded.on_arrival(CallRequest("r2", child, 100, parent_session_id=parent), now=0.1)
    assert isinstance(decided, Admit) and decided.worker in shard_workers(sharded, home)
    assert sharded.programs_per_shard()[home] == 2
    # GRPO samples of one task: all on the task's shard, whatever their own ids hash to
    task = "task-7"
    for i in range(8):
        sharded.on_arrival(CallRequest(f"g{i}", f"sample-{i}", 100, group_id=task), now=0.2)
        assert sharded.shard_of(CallRequest("again", f"sample-{i}", 100)) == rendezvous_shard(task, 2)


def test_in_a_run_every_decision_stays_on_its_programs_shard():
    """A closed loop on 4 workers split between 2 program_aware gateways: every Admit any
    shard returns names one of that shard's workers, for a program that shard owns."""
    config = ProgramAwareConfig(idle_release_s=5.0)
    sharded = ShardedPolicy([make_policy(config), make_policy(config)])
    admitted: list[tuple[int, Admit]] = []

    def recording(shard: int, method):
        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            decisions = result if isinstance(result, list) else [result]
            admitted.extend((shard, d) for d in decisions if isinstance(d, Admit))
            return result
        return call

    for shard, policy in enumerate(sharded.shards):
        for name in ("on_arrival", "on_complete", "tick"):
            setattr(policy, name, recording(shard, getattr(policy, name)))
    feed = ClosedLoop(lambda i: program(i, turns=4, first_prompt=30), concurrency=12, ramp_s=1.0)
    result = simulation(sharded, feed, workers=4, num_blocks=32, duration_s=40.0).run()
    assert result.calls_completed > 50
    assert {shard for shard, _ in admitted} == {0, 1}
    owners: dict[str, int] = {}
    for shard, admit in admitted:
        assert admit.worker in shard_workers(sharded, shard), (shard, admit)
        assert owners.setdefault(admit.session_id, shard) == shard, admit.session_id
    assert all(owners[s] == rendezvous_shard(s, 2) for s in owners)


def test_a_sharded_run_needs_a_worker_per_shard_and_runs_beside_its_ceiling():
    with pytest.raises(ValueError, match="need at least as many workers"):
        run_policies(["least_loaded"], lambda: workload_feed("swebench", 8, 7), workers=2,
                     preset="llama3.1-8b-h100", duration_s=10.0, shards=3, show_progress=False)
    sharded, ceiling = run_policies(["least_loaded"], lambda: workload_feed("swebench", 16, 7), workers=4,
                                    preset="llama3.1-8b-h100", duration_s=120.0, shards=2,
                                    ceiling=True, show_progress=False)
    assert sharded.calls_completed > 0 and ceiling.calls_completed > 0
