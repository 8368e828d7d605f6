"""The offline shell: a fleet of simulated engines driven by the *same* policy objects the
gateway runs, in virtual time (architecture.md §1, §5.6).

The driver only feeds the policy observations (arrivals, completions with usage, KV event
batches from the engines, ticks) and carries out its decisions: an ``Admit`` queues the
call on that engine with :func:`scheduler.actions.engine_priority` of its priority, the
integer the gateway sends a live engine (it orders the engine's queue only under
``scheduling_policy="priority"``, as vLLM's ``--scheduling-policy``; under ``"fcfs"`` the
engines ignore it), a ``Hold`` keeps it until a later ``Admit``, ``Retain`` / ``Demote`` /
``Release`` bias the engine's eviction order, and ``Offload`` / ``Prefetch`` do the same in its
host tier (the engine plugin's semantics). It never decides anything itself, and it reads the
policy as the gateway's metrics and admin API do: through the policy's interface and its
snapshot (scheduler/snapshot.py), never its insides.

Which programs start when is the feed's (sim/feeds.py); the result of a run is a
:class:`SimResult`, whose ``summary`` is a row of ``sluice sim --json`` (sim/report.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import assert_never

import numpy as np

from scheduler.actions import (
    Action,
    Admit,
    Demote,
    Hold,
    Mark,
    Offload,
    Pause,
    Prefetch,
    Release,
    Resume,
    Retain,
    engine_priority,
)
from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import ContinuationChain, ContinuationId, SessionId
from scheduler.kv_events import EventBatch
from scheduler.policies.base import Policy
from sim.engine import Engine
from sim.engine_request import EngineRequest
from sim.feeds import ProgramFeed
from sim.programs import ProgramSpec
from sim.step_time import StepTimeModel

_ENGINE, _CALL, _TICK, _START = 0, 1, 2, 3


@dataclass(slots=True)
class _Running:
    spec: ProgramSpec
    next_call: int = 0
    started_at: float = 0.0
    previous_sequence_tokens: int = 0
    # sessions its next call still waits for (``ProgramSpec.waits_for``)
    waiting_on: int = 0
    # its continuation chain so far, one entry per turn (Simulation._chain)
    chain_ids: list[ContinuationId] = field(default_factory=list)
    chain_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Call:
    program: _Running
    index: int
    request: CallRequest
    engine_request: EngineRequest
    arrived_at: float


@dataclass(slots=True)
class SimResult:
    policy: str
    duration_s: float
    output_tokens: int
    calls_completed: int
    prompt_tokens: int
    cached_tokens: int
    reprefill_tokens: int
    preemptions: int
    call_latencies_s: list[float]
    programs_completed: int
    program_times_s: list[float]
    pauses: int
    resumes: int
    marks: int
    forced_resumes: int
    utilization: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # RL rollouts: each finished batch's makespan (empty for other feeds)
    batch_makespans_s: list[float] = field(default_factory=list)
    # host KV tier (None: the workers have none): prompt tokens loaded back from it, and
    # blocks it evicted to make room
    # feeds that report them (a burst): per program, its first prompt's tokens and the seconds
    # from its first call's arrival to its dispatch (to the run's end for one never started)
    start_waits: list[tuple[int, float]] = field(default_factory=list)
    host_loaded_tokens: int | None = None
    host_evicted_blocks: int | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def steps_per_min(self) -> float:
        return self.calls_completed / (self.duration_s / 60.0)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def latency_quantile(self, q: float) -> float:
        if not self.call_latencies_s:
            return float("nan")
        return float(np.quantile(np.asarray(self.call_latencies_s), q))

    def makespan_quantile(self, q: float) -> float:
        if not self.batch_makespans_s:
            return float("nan")
        return float(np.quantile(np.asarray(self.batch_makespans_s), q))

    def summary(self) -> dict[str, float | int | str]:
        """The row of the report schema (``sluice sim --json``); batch makespans only for
        feeds with batches (RL rollouts)."""
        row = self._summary()
        if self.batch_makespans_s:
            row["batches"] = len(self.batch_makespans_s)
            row["p50_makespan_s"] = round(self.makespan_quantile(0.5), 2)
            row["p99_makespan_s"] = round(self.makespan_quantile(0.99), 2)
        if self.start_waits:
            row.update(start_wait_by_size(self.start_waits))
        if self.host_loaded_tokens is not None:
            row["host_loaded_tokens"] = self.host_loaded_tokens
            row["host_evicted_blocks"] = self.host_evicted_blocks
        return row

    def _summary(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "steps_per_min": round(self.steps_per_min, 2),
            "hit_rate": round(self.hit_rate, 4),
            "reprefill_tokens": self.reprefill_tokens,
            "p50_call_s": round(self.latency_quantile(0.5), 3),
            "p99_call_s": round(self.latency_quantile(0.99), 3),
            "pauses": self.pauses,
            "resumes": self.resumes,
        }


def start_wait_by_size(start_waits: list[tuple[int, float]]) -> dict[str, float]:
    """p99 of the start waits of all programs, of the smallest tenth by first prompt and of the
    largest tenth (each tenth at least one program)."""
    by_size = sorted(start_waits)
    tenth = max(1, len(by_size) // 10)

    def p99(part: list[tuple[int, float]]) -> float:
        return round(float(np.quantile(np.asarray([wait for _, wait in part]), 0.99)), 2)

    return {"p99_start_wait_s": p99(by_size), "p99_start_wait_smallest_tenth_s": p99(by_size[:tenth]),
            "p99_start_wait_largest_tenth_s": p99(by_size[-tenth:])}


class Simulation:
    def __init__(self, policy: Policy, feed: ProgramFeed, *, workers: int, model: StepTimeModel,
                 duration_s: float, block_size: int | None = None,
                 num_blocks: int | None = None, report_reuse: bool = False,
                 apply_retention: bool = True,
                 progress: Callable[[float], None] | None = None,  # given the fraction done
                 sample_every_s: float = 10.0, stop_when_done: bool = False,
                 on_sample: Callable[[float, Simulation], None] | None = None,
                 scheduling_policy: str = "priority") -> None:
        if workers <= 0:
            raise ValueError(f"workers must be > 0, got {workers}")
        if duration_s <= 0:
            raise ValueError(f"duration must be > 0 s, got {duration_s}")
        self.policy = policy
        self.feed = feed
        self.duration_s = duration_s
        self.engines = [
            Engine(f"w{i}", model, num_blocks=num_blocks, block_size=block_size,
                   report_reuse=report_reuse, scheduling_policy=scheduling_policy,
                   coalesce_removals=True)  # the policy's index alone reads the events
            for i in range(workers)
        ]
        self._by_name = {engine.name: engine for engine in self.engines}
        for engine in self.engines:
            policy.add_worker(engine.name, engine.capacity_tokens)
        self.block_size = self.engines[0].block_size
        self.apply_retention = apply_retention
        self._progress = progress
        self._on_sample = on_sample
        self._sample_every_s = sample_every_s
        self._heap: list[tuple[float, int, int, object, int]] = []
        self._seq = itertools.count()
        self._versions = [0] * workers
        self._engine_index = {engine.name: i for i, engine in enumerate(self.engines)}
        self._calls: dict[str, _Call] = {}
        self._now = 0.0
        self._latencies: list[float] = []
        self._program_times: list[float] = []
        self._calls_completed = 0
        self._programs_completed = 0
        # first calls not yet dispatched (request id → first prompt tokens, arrival), and the
        # start waits of those dispatched, when the feed reports them
        self._unstarted: dict[str, tuple[int, float]] | None = {} if feed.reports_start_waits else None
        self._start_waits: list[tuple[int, float]] = []
        self._utilization: dict[str, list[tuple[float, float]]] = {e.name: [] for e in self.engines}
        self._next_sample = 0.0
        # open-loop replays end when every program has ended, not at ``duration_s``
        self._stop_when_done = stop_when_done
        self._programs_live = 0
        # sub-agents (``spawn_after_calls``, ``waits_for``)
        self._live: dict[str, _Running] = {}
        self._ended: set[str] = set()
        self._spawns: dict[tuple[str, int], list[ProgramSpec]] = {}  # (parent, calls done)
        self._waiters: dict[str, list[_Running]] = {}  # session → programs waiting for it

    # -- the event loop --------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: object, version: int = 0) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload, version))

    def run(self) -> SimResult:
        for spec in self.feed.initial():
            self._add_program(spec, 0.0)
        self._push(0.0, _TICK, None)
        heap = self._heap
        end = self.duration_s
        next_report = 0.0
        # a run without an end in time (a closed-loop replay) reports every sampling period
        report_every = end / 100.0 if math.isfinite(end) else self._sample_every_s
        while heap:
            at, _, kind, payload, version = heapq.heappop(heap)
            if at > end:
                break
            if self._stop_when_done and kind == _TICK and not self._calls and not self._has_pending():
                self._check_nothing_stuck()
                break
            self._now = at
            if kind == _ENGINE:
                index = payload  # type: ignore[assignment]
                if version != self._versions[index]:
                    continue
                self._on_engine_done(index, at)
            elif kind == _CALL:
                self._on_call(payload, at)  # type: ignore[arg-type]
            elif kind == _TICK:
                self._apply(self.policy.tick(at), at)
                self._sample(at)
                self._push(at + self.policy.tick_interval_s, _TICK, None)
            else:
                self._start_program(payload, at)  # type: ignore[arg-type]
            if self._progress is not None and at >= next_report:
                self._progress(self._fraction_done(at))
                next_report = at + report_every
        if self._progress is not None:
            self._progress(self._fraction_done(self._now))
        return self._result()

    def _fraction_done(self, now: float) -> float:
        """How far the run is: the share of its duration behind it, or of its programs ended
        when its feed runs out first (a replay), whichever is further."""
        by_time = now / self.duration_s if math.isfinite(self.duration_s) else 0.0
        by_programs = self.feed.fraction_done() if self._stop_when_done else None
        return min(1.0, max(by_time, by_programs or 0.0))

    def _has_pending(self) -> bool:
        return any(kind != _TICK for _, _, kind, _, _ in self._heap)

    def _check_nothing_stuck(self) -> None:
        """No call in flight and nothing scheduled: a program still alive waits for a
        session that will never end or a parent that will never reach it."""
        if self._programs_live == 0:
            return
        waiting = sorted(self._waiters) + sorted(parent for parent, _ in self._spawns)
        raise RuntimeError(f"{self._programs_live} programs can never finish: they wait for "
                           f"sessions that never end or start ({', '.join(waiting[:5])})")

    def _add_program(self, spec: ProgramSpec, now: float) -> None:
        """Schedule a program from the feed: at its ``start_at``, or — a sub-agent — when
        its parent has completed ``spawn_after_calls`` calls."""
        self._programs_live += 1
        if spec.spawn_after_calls is None:
            self._push(max(now, spec.start_at), _START, spec)
            return
        parent = spec.parent_session_id
        assert parent is not None  # ProgramSpec checks it
        reached = self._live.get(parent)
        if parent in self._ended or (reached is not None and reached.next_call >= spec.spawn_after_calls):
            self._push(now, _START, spec)
        else:
            self._spawns.setdefault((parent, spec.spawn_after_calls), []).append(spec)

    def _release_spawns(self, session_id: str, calls_done: int, now: float) -> None:
        for child in self._spawns.pop((session_id, calls_done), ()):
            self._push(now, _START, child)

    def _start_program(self, spec: ProgramSpec, now: float) -> None:
        running = _Running(spec, 0, now)
        self._live[spec.session_id] = running
        self._release_spawns(spec.session_id, 0, now)
        self._push(now + spec.calls[0].think_s if spec.calls[0].at is None else max(now, spec.calls[0].at),
                   _CALL, running)

    def _waits(self, program: _Running) -> bool:
        """Whether the program's next call must wait for sessions still running; if so it
        is registered with them and sent when the last one ends (:meth:`_end_session`)."""
        awaited = program.spec.waits_for.get(program.next_call)
        if not awaited:
            return False
        running = [session for session in awaited if session not in self._ended]
        for session in running:
            self._waiters.setdefault(session, []).append(program)
        program.waiting_on = len(running)
        return bool(running)

    def _end_session(self, session_id: str, now: float) -> None:
        self._live.pop(session_id, None)  # a feed may reuse a session id; the latest is live
        self._ended.add(session_id)
        for waiter in self._waiters.pop(session_id, ()):
            waiter.waiting_on -= 1
            if waiter.waiting_on == 0:
                self._push(now, _CALL, waiter)

    def _on_call(self, program: _Running, now: float) -> None:
        if self._waits(program):
            return
        spec = program.spec
        k = program.next_call
        call_spec = spec.calls[k]
        bs = self.block_size
        hashes = spec.call_hashes(k, bs)
        prompt_blocks = call_spec.prompt_tokens // bs
        request_id = f"{spec.session_id}#{k}"
        final = k == len(spec.calls) - 1
        chain, chain_tokens = self._chain(program, k)
        request = CallRequest(
            request_id=request_id,
            session_id=SessionId(spec.session_id),
            prompt_tokens=call_spec.prompt_tokens,
            parent_session_id=SessionId(spec.parent_session_id) if spec.parent_session_id else None,
            chain=chain,
            chain_tokens=chain_tokens,
            block_hashes=tuple(hashes[:prompt_blocks]),
            final=final,
            group_id=SessionId(spec.task_id) if spec.task_id is not None else None,
        )
        engine_request = EngineRequest(
            request_id=request_id,
            session_id=spec.session_id,
            hashes=hashes,
            prompt_tokens=call_spec.prompt_tokens,
            output_tokens=call_spec.output_tokens,
            priority=0,  # set by the Admit that dispatches it
            arrival=now,
            known_prefix_tokens=min(program.previous_sequence_tokens, call_spec.prompt_tokens),
        )
        self._calls[request_id] = _Call(program, k, request, engine_request, now)
        if k == 0 and self._unstarted is not None:
            self._unstarted[request_id] = (call_spec.prompt_tokens, now)
        decision = self.policy.on_arrival(request, now)
        if isinstance(decision, Admit):
            self._dispatch(decision, now)

    def _chain(self, program: _Running, k: int) -> tuple[ContinuationChain, tuple[int, ...]]:
        """Continuation ids at message granularity: family prefix, task, then one per turn
        (kept on the program and extended turn by turn)."""
        spec = program.spec
        ids = program.chain_ids
        tokens = program.chain_tokens
        if not ids:
            ids += (ContinuationId(f"f{spec.family}"), ContinuationId(f"p{spec.index}"))
            tokens += (spec.shared_prefix_tokens, spec.calls[0].prompt_tokens)
        for turn in range(len(ids) - 1, k + 1):
            ids.append(ContinuationId(f"p{spec.index}.{turn}"))
            tokens.append(spec.calls[turn].prompt_tokens)
        return ContinuationChain(tuple(ids[:k + 2])), tuple(tokens[:k + 2])

    def _dispatch(self, admit: Admit, now: float) -> None:
        call = self._calls[admit.request_id]
        if self._unstarted is not None and admit.request_id in self._unstarted:
            tokens, arrived = self._unstarted.pop(admit.request_id)
            self._start_waits.append((tokens, now - arrived))
        engine_request = call.engine_request
        # what a live engine gets from the gateway: relative to this dispatch, in ms
        engine_request.priority = engine_priority(admit.priority, now)
        index = self._engine_index[admit.worker]
        engine = self.engines[index]
        was_running = engine._run is not None
        busy_until = engine.busy_until
        engine.add_request(engine_request, now)
        if engine.idle:
            self._start_engine(index, now)
        elif was_running and engine.busy_until != busy_until:
            self._versions[index] += 1
            self._push(engine.busy_until, _ENGINE, index, self._versions[index])

    def _start_engine(self, index: int, now: float) -> None:
        engine = self.engines[index]
        until = engine.start(now)
        self._publish(engine, now)
        if until is not None:
            self._versions[index] += 1
            self._push(until, _ENGINE, index, self._versions[index])

    def _publish(self, engine: Engine, now: float) -> None:
        # The GPU pool's and the host tier's (medium "CPU") events, as vLLM publishes them on
        # one stream; the index keeps the media apart.
        events = engine.take_events()
        if events:
            self.policy.observe_kv(engine.name, EventBatch(now, events, 0))

    def _on_engine_done(self, index: int, now: float) -> None:
        engine = self.engines[index]
        done = engine.complete()
        self._publish(engine, now)
        actions: list[Action] = []
        for engine_request in done:
            call = self._calls.pop(engine_request.request_id)
            usage = Usage(engine_request.prompt_tokens, engine_request.output_tokens,
                          max(0, engine_request.cached_tokens))
            self._latencies.append(now - call.arrived_at)
            self._calls_completed += 1
            actions += self.policy.on_complete(engine_request.request_id, usage, now)
            self._next_call(call, now)
        if done and self.policy.ticks_after_completion:
            actions += self.policy.tick(now)
        self._apply(actions, now)
        if engine.idle:
            self._start_engine(index, now)

    def _next_call(self, call: _Call, now: float) -> None:
        program = call.program
        spec = program.spec
        program.previous_sequence_tokens = spec.calls[call.index].prompt_tokens + spec.calls[call.index].output_tokens
        program.next_call = call.index + 1
        self._release_spawns(spec.session_id, program.next_call, now)
        if program.next_call >= len(spec.calls):
            self._programs_completed += 1
            self._programs_live -= 1
            self._program_times.append(now - program.started_at)
            self._end_session(spec.session_id, now)
            for new in self.feed.on_program_end(spec, now):
                self._add_program(new, now)
            return
        following = spec.calls[program.next_call]
        at = now + following.think_s if following.at is None else max(now, following.at)
        self._push(at, _CALL, program)

    def _apply(self, actions: list[Action], now: float) -> None:
        for action in actions:
            match action:
                case Admit():
                    self._dispatch(action, now)
                case Retain() if self.apply_retention:
                    self._by_name[action.worker].pool.retain(action.session_id, action.priority,
                                                             action.ttl_s, now)
                case Demote() if self.apply_retention:
                    self._by_name[action.worker].pool.demote(action.session_id)
                case Release() if self.apply_retention and action.worker is not None:
                    self._by_name[action.worker].release_session(action.session_id)
                case Offload() if self.apply_retention:
                    self._by_name[action.worker].offload(action.session_id)
                case Prefetch() if self.apply_retention:
                    self._by_name[action.worker].prefetch(action.session_id, action.priority,
                                                          action.deadline_s, now)
                case Retain() | Demote() | Release() | Offload() | Prefetch() | Pause() | Resume() | Mark():
                    pass  # the policy keeps its own account of these; the engines need nothing
                case Hold():
                    raise TypeError(f"a policy returned Hold as an action: {action}")
                case _:
                    assert_never(action)

    def _sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + self._sample_every_s
        # the policy as the gateway's metrics see it; U is None only while a worker's
        # capacity is unknown (infinite U), which no simulated engine's is
        workers = {view.name: view for view in self.policy.snapshot(with_programs=False).workers}
        for engine in self.engines:
            utilization = workers[engine.name].utilization
            self._utilization[engine.name].append((now, math.inf if utilization is None else utilization))
        if self._on_sample is not None:
            self._on_sample(now, self)

    def _result(self) -> SimResult:
        stats = [engine.stats for engine in self.engines]
        policy = self.policy.snapshot(with_programs=False)
        connectors = [engine.offloading for engine in self.engines if engine.offloading is not None]
        elapsed = min(self.duration_s, self._now) if self._stop_when_done else self.duration_s
        return SimResult(
            policy=policy.name,
            duration_s=max(elapsed, 1e-9),
            output_tokens=sum(s.output_tokens for s in stats),
            calls_completed=self._calls_completed,
            prompt_tokens=sum(s.prompt_tokens for s in stats),
            cached_tokens=sum(s.cached_tokens for s in stats),
            reprefill_tokens=sum(s.reprefill_tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            call_latencies_s=self._latencies,
            programs_completed=self._programs_completed,
            program_times_s=self._program_times,
            pauses=policy.stats["pauses"],
            resumes=policy.stats["resumes"],
            marks=policy.stats["marks"],
            forced_resumes=policy.stats["forced_resumes"],
            utilization=self._utilization,
            batch_makespans_s=self.feed.batch_makespans_s(),
            start_waits=self._start_waits + [(tokens, elapsed - arrived) for tokens, arrived
                                             in (self._unstarted or {}).values()],
            host_loaded_tokens=sum(c.loaded_tokens for c in connectors) if connectors else None,
            host_evicted_blocks=sum(c.evicted_blocks for c in connectors) if connectors else None,
        )
