"""No policy keeps state that outgrows what is alive.

A driver plays a long random life against every registered policy — programs arrive, call,
finish (some with a final call), get aborted, held and released, workers fail and come
back, and time moves on for many ticks — and after every operation walks the policy's
insides: every collection it holds (lists, heaps, dicts, sets, queues), in the policy and in
the parts it is built from (ledger, KV index, resume queue, parking lot, ...). Each one must
be listed in :data:`BOUNDS` with what it is bounded by: the live programs and calls (those
the driver has seen start and not yet end), the workers, or a window the config sets. A
collection nobody listed fails the test too, so a new one has to say what bounds it.

Why: a deadline heap that only one policy drained grew without bound under the other
(thunderagent: 4,873 entries for 30 programs after 1,200 ticks).
"""

from __future__ import annotations

import enum
import fnmatch
import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from scheduler.actions import Admit, Release
from scheduler.calls import CallRequest, Usage
from scheduler.config_reading import make_policy_config
from scheduler.coordinates import SessionId
from scheduler.policies import POLICIES, make_policy
from scheduler.programs import Program

WORKERS = ("w0", "w1", "w2")
CAPACITY = 6_000
SLOTS = 10  # programs alive at once, at most
SLACK = 16  # lazily cleaned structures may run this far past 2 x live before they compact

# Attribute path (fnmatch pattern, from the policy) -> what bounds its length.
LIVE, WORKER, WINDOW = "live programs and calls", "workers", "a window the config sets"
BOUNDS: dict[str, str] = {
    # every policy (base.Policy): the program and call tables, the ledger, the KV index
    "programs": LIVE,
    "calls": LIVE,
    "groups": LIVE,  # group id -> its live programs
    "groups.values": LIVE,
    "ledger._workers": WORKER,
    "ledger._workers.values.programs": LIVE,
    "ledger._workers.values.ancestry_counts": LIVE,  # chain nodes of live programs (none here)
    "ledger._workers.values.ancestry_tokens": LIVE,
    "ledger._counted": LIVE,
    "ledger._dormant": LIVE,
    "ledger._gpu": WORKER,  # the index's ``_workers``, a view the ledger reads U through
    "index._workers": WORKER,
    # the KV mirror is bounded by the engines' blocks; this driver sends no KV events, so
    # what it holds is the sessions counted in it
    "index._workers.values.*": LIVE,
    # the host tier's mirror: bounded by the tier's chunks, and empty here for the same reason
    "index._hosts": WORKER,
    "index._hosts.values.*": LIVE,
    # each worker's bound on what its events may store, while it is in the fleet
    "index._capacity_blocks": WORKER,
    # least_loaded: VERL's sticky routing cache (an LRU of sticky_lru_size)
    "_sticky": WINDOW,
    # least_loaded, autellix, kv_aware: per-worker counters
    "_in_flight": WORKER,
    "_active_tokens": WORKER,
    # autellix: the process table
    "process_table": LIVE,
    # continuum: recent tool-call durations, evicted calls' queueing delays, live pins
    "_tool_times._recent": WINDOW,
    "_tool_times._sorted": WINDOW,
    "_queue_delays._recent": WINDOW,
    "_pinned_until": LIVE,
    # thunderagent: its parking lot and idle deadlines (scheduler/policies/parking.py)
    "_lot._since": LIVE,
    "_lot._deadlines._heap": LIVE,
    "_idle._heap._heap": LIVE,
    # program_aware, room by room (scheduler/policies/program_aware/)
    "_capacity._homed_tokens": WORKER,
    "_capacity._paused_tokens": WORKER,
    "_placement.reservations._holder": WORKER,
    "_resume.lot._since": LIVE,
    "_resume.lot._deadlines._heap": LIVE,
    "_resume._idle._heap._heap": LIVE,
    "_resume._wait_deadlines._heap": LIVE,
    "_resume._queue._keys": LIVE,
    "_resume._queue._demand": LIVE,
    "_resume._queue._order": LIVE,
    "_resume._queue._by_demand": LIVE,
    "_resume._queue._largest_waiting": LIVE,
    "_pausing.soft_band": WORKER,
    "_dormancy._tool_times._recent": WINDOW,
    "_dormancy._tool_times._sorted": WINDOW,
    "_dormancy._checks._heap": LIVE,
    "_dormancy._predicted_ends._heap": LIVE,
    "_keep._retained_until": LIVE,
    "_keep._due": LIVE,
    "_keep._held": LIVE,  # paused sessions whose call was held since the last tick
    "_keep._refresh._heap": LIVE,
    # mori: each program's idleness window, and each worker's host-tier book
    "_windows": LIVE,
    "_windows.values.cycles": WINDOW,  # idleness_window cycles
    "_host": WORKER,
    # vllm_router: its request pool, per-program facts, acting-TTL deadlines, and each worker's
    # windows (stats_window_size samples)
    "_facts": LIVE,
    "_ttl_deadlines._heap": LIVE,
    "_factors": WORKER,
    "_factors.values._calls": WINDOW,
    "_factors.values._intervals": WINDOW,
}


def _parts(obj: object):
    """(name, value) of an object's own attributes, slots included."""
    names: list[str] = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    for name in dict.fromkeys(names):
        if name.startswith("__"):
            continue
        try:
            yield name, getattr(obj, name)
        except AttributeError:
            continue


def _is_component(value: object) -> bool:
    """A piece of policy state worth walking into (not a program, call, config or enum)."""
    module = type(value).__module__
    return (module.startswith("scheduler.") and not isinstance(value, (Program, BaseModel, enum.Enum))
            and type(value).__name__ not in {"Call", "PolicyStats", "CallRequest"})


def collections_of(obj: object, path: str = "", seen: set[int] | None = None):
    """Every collection reachable from ``obj`` through its components: (path, length); a
    component two others share (the ledger's index is the policy's) is walked once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in _parts(obj):
        here = f"{path}.{name}" if path else name
        if isinstance(value, (list, dict, set, frozenset, deque)):
            if id(value) in seen:
                continue  # a table a part shares with its owner (the program table)
            seen.add(id(value))
            yield here, len(value)
            if isinstance(value, dict):
                for item in value.values():
                    if _is_component(item):
                        yield from collections_of(item, f"{here}.values", seen)
        elif _is_component(value):
            yield from collections_of(value, here, seen)


def bound_of(path: str) -> str:
    for pattern, bound in BOUNDS.items():
        if fnmatch.fnmatchcase(path, pattern):
            return bound
    raise AssertionError(f"{path}: a collection no one said is bounded; add it to BOUNDS "
                         "with what bounds it")


@dataclass
class Life:
    """A random but reproducible life of programs, played against one policy."""

    name: str
    rng: random.Random
    now: float = 0.0
    generation: list[int] = field(default_factory=lambda: [0] * SLOTS)
    live: set[str] = field(default_factory=set)      # sessions started and not ended
    running: dict[str, str] = field(default_factory=dict)   # request id -> session
    held: dict[str, str] = field(default_factory=dict)      # request id -> session
    final_calls: set[str] = field(default_factory=set)
    seq: int = 0
    largest: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        policy, _, variant = self.name.partition("+")
        config = make_policy_config({"name": policy, "idle_release_s": 120.0}
                                    | ({"force_resume_after_s": 60.0}
                                       if policy in ("program_aware", "thunderagent", "mori") else {})
                                    | (TIERED[policy] if variant == "host_tier" else {}))
        self.policy = make_policy(config)
        for worker in WORKERS:
            self.policy.add_worker(worker, CAPACITY)
        self.window = max(getattr(self.policy.config, "sticky_lru_size", 0), 1000)

    def session(self, slot: int) -> SessionId:
        return SessionId(f"s{slot}.{self.generation[slot]}")

    def end(self, session: str) -> None:
        self.live.discard(session)
        slot, _, generation = session[1:].partition(".")
        if self.generation[int(slot)] == int(generation):
            self.generation[int(slot)] += 1  # the slot's next program is a new session

    def absorb(self, actions) -> None:
        for action in actions:
            if isinstance(action, Admit):
                self.running[action.request_id] = self.held.pop(action.request_id)
            elif isinstance(action, Release):
                for rid in [r for r, s in self.held.items() if s == action.session_id]:
                    del self.held[rid]
                self.end(action.session_id)

    def step(self) -> None:
        roll = self.rng.random()
        self.now += 0.01
        policy = self.policy
        if roll < 0.35:
            sid = self.session(self.rng.randrange(SLOTS))
            self.seq += 1
            rid = f"r{self.seq}"
            final = self.rng.random() < 0.08
            # programs come in groups of three (a GRPO group, a task's runs): the group index
            # must let go of each as it ends
            group = SessionId(f"g{int(sid[1:].partition('.')[0]) // 3}")
            request = CallRequest(rid, sid, self.rng.choice([300, 900, 1_500, 2_500]), final=final,
                                  group_id=group)
            self.live.add(sid)
            if final:
                self.final_calls.add(rid)
            decision = policy.on_arrival(request, self.now)
            (self.running if isinstance(decision, Admit) else self.held)[rid] = sid
        elif roll < 0.65 and self.running:
            rid = self.rng.choice(sorted(self.running))
            sid = self.running.pop(rid)
            actions = policy.on_complete(rid, Usage(1_000, self.rng.choice([50, 400, 900])), self.now)
            self.absorb(actions)
            if rid in self.final_calls:
                self.end(sid)
        elif roll < 0.69 and self.running:
            rid = self.rng.choice(sorted(self.running))
            del self.running[rid]
            self.absorb(policy.on_abort(rid, self.now))
        elif roll < 0.72 and self.held:
            rid = self.rng.choice(sorted(self.held))
            del self.held[rid]
            self.absorb(policy.on_abort(rid, self.now))
        elif roll < 0.74:
            sid = self.session(self.rng.randrange(SLOTS))
            self.absorb(policy.release(sid, self.now, "operator"))
            self.end(sid)
        elif roll < 0.75:
            worker = self.rng.choice(WORKERS)
            self.absorb(policy.set_worker_health(worker, self.rng.random() < 0.6, self.now))
        else:
            self.now += self.rng.choice([0.2, 1.0, 1.0, 5.0, 30.0])
            self.absorb(policy.tick(self.now))
        self.check()

    def check(self) -> None:
        calls = len(self.running) + len(self.held)
        programs = len(self.live)
        assert len(self.policy.programs) <= programs, "the policy kept a program that ended"
        limits = {LIVE: 2 * (programs + calls) + SLACK, WORKER: len(WORKERS) + 1,
                  WINDOW: self.window}
        for path, length in collections_of(self.policy):
            bound = bound_of(path)
            self.largest[path] = max(self.largest.get(path, 0), length)
            assert length <= limits[bound], (
                f"{self.name}: {path} holds {length} entries, more than its bound "
                f"({bound}: {limits[bound]}; {programs} programs and {calls} calls live, "
                f"t={self.now:.1f})")


# program_aware with a host tier and quick dormancy: offloads, predicted prefetches and
# home-anchored resumes run too
# mori with a host tier as large as the pool: offloads, promotions home and displacements run
TIERED = {"program_aware": {"retention": {"host_tier": True}, "dormant_min_s": 0.0},
          "mori": {"host_tier_tokens": CAPACITY}}
LIVES = [*sorted(POLICIES), "program_aware+host_tier", "mori+host_tier"]


def live_a_life(name: str, seed: int, steps: int) -> Life:
    life = Life(name, random.Random(seed))
    for _ in range(steps):
        life.step()
    return life


@pytest.mark.parametrize("name", LIVES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(200, 1_500))
def test_every_collection_stays_bounded_by_what_is_alive(name, seed, steps) -> None:
    live_a_life(name, seed, steps)


@pytest.mark.parametrize("name", LIVES)
def test_a_long_life_keeps_state_bounded(name) -> None:
    """Thousands of ticks, the scale the unbounded heap was found at."""
    life = live_a_life(name, 12, 6_000)
    assert life.seq > 1_000  # the life really had many calls
