"""New-program placement skips the prefix read of a worker whose score could not beat the best
even with the whole prompt resident (scheduler/policies/program_aware/placement.py): on random
fleets, loads, KV contents and soft bands it places every program where the unpruned rule, a
copy of it kept here, places it."""

from __future__ import annotations

import types

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.calls import CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.kv_events import BlockStored, EventBatch
from scheduler.policies import make_policy
from scheduler.policies.base import calls_per_worker

WORKERS = ("w0", "w1", "w2", "w3")


def _unpruned(self, program, call, soft_band):
    """The rule before the bound: every fitting worker's prefix credit read."""
    request = call.request
    demand = max(program.demand_tokens(),
                 request.prompt_tokens + request.growth_reserve(self.config.growth_reserve_tokens))
    self.capacity.recount(self._programs.values())
    if program.parent_session_id is not None:
        parent = self._programs.get(program.parent_session_id)
        if parent is not None and parent.home_worker is not None:
            home = parent.home_worker
            if self.reservations.open_to(home, program) and self.fits(
                    home, demand, self.capacity.threshold(home, demand)):
                return home
    in_flight = None
    best, best_score = None, None
    for load in self._ledger.workers():
        if not load.accepts_programs or not self.reservations.open_to(load.name, program):
            continue
        u_after = self._ledger.utilization_with(load.name, demand)
        if u_after > self.capacity.threshold(load.name, demand):
            continue
        if self.capacity.runs_all(load.name, demand):
            if in_flight is None:
                in_flight = calls_per_worker(self._calls.values())
            score = (1, -in_flight.get(load.name, 0), -self._ledger.utilization(load.name))
        else:
            credit = self.prefix_credit(load.name, call) - self._ledger.utilization(load.name)
            if load.name in soft_band:
                credit -= self.config.soft_band_delay_s
            score = (0, credit)
        if best_score is None or score > best_score:
            best, best_score = load.name, score
    return best


def _policy(caps, host_tier):
    config = ProgramAwareConfig(buffer_per_program=10, growth_reserve_tokens=0,
                                soft_band_delay_s=0.05, max_wait_s=None, dormant_quantile=None)
    if host_tier:
        config = config.for_host_tier()
    policy = make_policy(config)
    for name, cap in zip(WORKERS, caps):
        policy.add_worker(name, cap)
    return policy


op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 29), st.integers(1, 64), st.integers(0, 20)),
    st.tuples(st.just("finish"), st.integers(0, 29), st.integers(1, 900)),
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.integers(1, 20), st.integers(0, 2)),
    st.tuples(st.just("tick"),),
)


@settings(max_examples=200, deadline=None)
@given(caps=st.lists(st.sampled_from([400, 1000, 3000]), min_size=4, max_size=4),
       host_tier=st.booleans(), history=st.lists(op, max_size=60))
def test_pruned_placement_places_as_the_unpruned_rule(caps, host_tier, history):
    pruned, plain = _policy(caps, host_tier), _policy(caps, host_tier)
    plain._placement.new_program_worker = types.MethodType(_unpruned, plain._placement)
    calls = {}
    for step, o in enumerate(history):
        now = float(step)
        answers = []
        for policy in (pruned, plain):
            if o[0] == "arrive":
                _, who, extra, depth = o
                prompt = 16 * depth + extra  # mostly the hashed blocks: credits that count
                rid = f"s{who}#{step}"
                if any(c.startswith(f"s{who}#") for c in calls.get(id(policy), ())):
                    continue  # one call at a time
                request = CallRequest(rid, SessionId(f"s{who}"), prompt,
                                      block_hashes=tuple(range(100, 100 + depth)))
                decision = policy.on_arrival(request, now)
                answers.append((type(decision).__name__, getattr(decision, "worker", None)))
                if hasattr(decision, "worker"):
                    calls.setdefault(id(policy), set()).add(rid)
            elif o[0] == "finish":
                mine = sorted(c for c in calls.get(id(policy), ()) if c.startswith(f"s{o[1]}#"))
                if mine:
                    calls[id(policy)].discard(mine[0])
                    answers.append(len(policy.on_complete(mine[0], Usage(o[2], 5), now)))
            elif o[0] == "store":
                _, worker, depth, skip = o
                hashes = list(range(100 + skip, 100 + skip + depth))
                policy.observe_kv(worker, EventBatch(ts=now, events=[BlockStored(
                    block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * depth)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None, session_id=None)]))
            else:
                answers.append(repr(policy.tick(now)))
        if len(answers) == 2:
            assert answers[0] == answers[1], (step, o)
