"""K gateways, each with its own policy and workers, as one policy for the simulator.

What sharded gateways do (docs/architecture.md §8): the fleet's workers are split into K
disjoint sets, each behind a gateway with a policy of its own, and an ingress (nginx, a
router) sends every call of a program to the gateway that owns it, by a hash of its root
session. Nothing is shared between shards: a shard can pause programs while another has
room. :class:`ShardedPolicy` is that partition, seen by :class:`~sim.simulation.Simulation`
as one policy, so that ``sluice sim --shards K`` measures what the partition costs against one
gateway over the same programs.

The owner of a program is chosen by rendezvous hashing of its root session
(scheduler/rendezvous.py, the function the Ray Serve ingress routes by: a K that changes
moves only the programs whose winner changed). A sub-agent goes where its parent went, as the proxy's shard key sends it
(ops/nginx/sluice-shard-key.conf), and a GRPO group's samples where their task hashes
(behind nginx: the task sent as ``x-parent-session-id``); a program the simulator starts later (a closed loop's
next one) is hashed like any other, so a shard's share of the live programs drifts as it
does behind a real proxy. Workers go to shards in turn as they are added: worker i to shard
i mod K.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.actions import Action, Decision
from scheduler.calls import CallRequest, Usage
from scheduler.kv_events import EventBatch
from scheduler.policies.base import Policy
from scheduler.rendezvous import rendezvous_shard
from scheduler.snapshot import PolicySnapshot


class ShardedPolicy:
    """``policies[j]`` decides for shard j's workers and programs; nothing crosses shards."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        if not policies:
            raise ValueError("a sharded policy needs at least one shard")
        self.shards = list(policies)
        self.name = self.shards[0].name
        self._worker_shard: dict[str, int] = {}
        # every session seen, to its shard: a sub-agent looks its parent up here. One int per
        # session the run started (bounded by the run's programs; the simulator only).
        self._session_shard: dict[str, int] = {}
        self._call_shard: dict[str, int] = {}

    # -- what the simulator asks of a policy -------------------------------------------

    @property
    def tick_interval_s(self) -> float:
        return self.shards[0].tick_interval_s

    @property
    def ticks_after_completion(self) -> bool:
        return self.shards[0].ticks_after_completion

    def add_worker(self, name: str, capacity_tokens: int | None = None) -> None:
        shard = len(self._worker_shard) % len(self.shards)
        self._worker_shard[name] = shard
        self.shards[shard].add_worker(name, capacity_tokens)

    def shard_of(self, request: CallRequest) -> int:
        """The shard of the request's program: its parent's, else the one its root hashes
        to (the group, a GRPO task, else the parent, else the session itself)."""
        session = str(request.session_id)
        shard = self._session_shard.get(session)
        if shard is None:
            parent = request.parent_session_id
            shard = self._session_shard.get(str(parent)) if parent is not None else None
            if shard is None:
                root = request.group_id or parent or request.session_id
                shard = rendezvous_shard(str(root), len(self.shards))
            self._session_shard[session] = shard
        return shard

    def on_arrival(self, request: CallRequest, now: float) -> Decision:
        shard = self.shard_of(request)
        self._call_shard[request.request_id] = shard
        return self.shards[shard].on_arrival(request, now)

    def on_complete(self, request_id: str, usage: Usage, now: float) -> list[Action]:
        return self.shards[self._call_shard.pop(request_id)].on_complete(request_id, usage, now)

    def observe_kv(self, worker: str, batch: EventBatch) -> int:
        return self.shards[self._worker_shard[worker]].observe_kv(worker, batch)

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for policy in self.shards:
            actions += policy.tick(now)
        return actions

    def snapshot(self, with_programs: bool = True) -> PolicySnapshot:
        """The shards' snapshots as one: their programs and workers, their stats summed."""
        parts = [policy.snapshot(with_programs) for policy in self.shards]
        stats: dict[str, int] = {}
        for part in parts:
            for key, value in part.stats.items():
                stats[key] = stats.get(key, 0) + value
        return PolicySnapshot(name=self.name,
                              programs=tuple(p for part in parts for p in part.programs),
                              workers=tuple(w for part in parts for w in part.workers),
                              stats=stats)

    def programs_per_shard(self) -> list[int]:
        return [policy.program_count() for policy in self.shards]
