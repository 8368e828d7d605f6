"""Tick latency of the program-aware policy on a large, busy fleet.

Setup (not timed), all through the policy's public interface so the state is one the policy
itself built: 64 workers, 10,000 SWE-bench-like programs with contexts drawn log-uniformly
from 2k–60k tokens, four scaffolds whose 1,536-token system prompt + tools their programs
share. Worker capacity is sized so that about 80 % of the programs' tokens fit; the rest queue.
Every admitted call's blocks are reported to the KV index as a worker would (the shared
prompt re-reported as a prefix hit, the program's own blocks stored with its session and
continuation ids, output blocks stored at completion); a paused program's own blocks are
evicted most of the time, and a released program's always.

Warm-up rounds of arrivals, completions (contexts grow) and ticks bring the fleet to a
steady mix — about half the programs ACTIVE+ACTING, some REASONING, some PAUSED with a
call waiting, some new ones queued. Then each worker's capacity is set (``set_capacity``,
as the shell does from ``/metrics``) so its U lies just under the pause threshold: a few
arrivals push a worker over, and the timed ticks run real pause passes and the resume
passes that follow them (stderr shows how many ticks did).

Measured: ``policy.tick(now)`` alone, over ``ticks`` ticks; between two ticks a few calls
complete and a few arrive (and now and then a program finishes and a new one starts), as
when completions trigger ticks. The actions each tick returns are carried out (outside the
timer) so the next tick sees their effects.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.common import percentile, progress, result
from scheduler.actions import Action, Admit, Mark, Pause, Release, Resume
from scheduler.calls import CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import (
    ContinuationChain,
    ContinuationId,
    SessionId,
    next_continuation,
    root_continuation,
)
from scheduler.kv_events import BlockRemoved, BlockStored, EventBatch
from scheduler.policies import make_policy

BLOCK = 16
SCAFFOLDS = 4
TOOLS_TOKENS = 512
SYSTEM_TOKENS = 1_024
SHARED_TOKENS = TOOLS_TOKENS + SYSTEM_TOKENS  # 96 blocks
MODEL = "bench-model"
# share of the programs' tokens that fit below the pause threshold at the start
FIT_FRACTION = 0.8
_MASK64 = (1 << 64) - 1


def _own_hash(pid: int, k: int) -> int:
    return ((pid + 1) << 24 | k) & _MASK64


def _shared_hash(scaffold: int, k: int) -> int:
    return (1 << 62) | (scaffold << 16) | k


@dataclass
class BenchProgram:
    pid: int
    session: SessionId
    scaffold: int
    context: int                      # prompt tokens of the next call
    steps_left: int
    chain: list[ContinuationId] = field(default_factory=list)
    chain_tokens: list[int] = field(default_factory=list)
    in_flight: str | None = None      # request id while a call runs
    waiting: str | None = None        # request id while a call is held
    calls: int = 0
    resident_worker: str | None = None
    resident_blocks: int = 0          # own blocks (beyond the shared prompt) in the index


class Fleet:
    """Drives a program-aware policy the way a shell would, with a synthetic workload."""

    def __init__(self, rng: random.Random, workers: int, programs: int) -> None:
        self.rng = rng
        self.policy = make_policy(ProgramAwareConfig(), name="program_aware")
        self.now = 0.0
        self.programs: dict[SessionId, BenchProgram] = {}
        self.requests: dict[str, tuple[BenchProgram, CallRequest]] = {}
        self.next_pid = 0
        self.actions = Counter()
        self.kv_hashes = 0
        self.roots = [root_continuation(MODEL, None, [{"scaffold": s, "tools": "bash,edit"}])
                      for s in range(SCAFFOLDS)]
        self.system_ids = [next_continuation(self.roots[s], {"role": "system", "scaffold": s})
                           for s in range(SCAFFOLDS)]
        self.workers = [f"gpu-{i:02d}" for i in range(workers)]
        contexts = [self._draw_context() for _ in range(programs)]
        capacity = int(sum(contexts) * FIT_FRACTION / workers / self.policy.config.pause_threshold)
        self.capacity = capacity
        for name in self.workers:
            self.policy.add_worker(name, capacity)
        self._initial_contexts = contexts

    # -- workload --------------------------------------------------------------------

    def _draw_context(self) -> int:
        return int(math.exp(self.rng.uniform(math.log(2_000), math.log(60_000))))

    def new_program(self, context: int) -> BenchProgram:
        pid = self.next_pid
        self.next_pid += 1
        scaffold = pid % SCAFFOLDS
        program = BenchProgram(pid, SessionId(f"swe-{pid:06d}"), scaffold, context,
                               steps_left=self.rng.randint(5, 60))
        program.chain = [self.roots[scaffold], self.system_ids[scaffold]]
        program.chain_tokens = [TOOLS_TOKENS, SHARED_TOKENS]
        # the history so far as messages of ~1,500 tokens
        tokens = SHARED_TOKENS
        while tokens < context:
            step = min(1_500, context - tokens)
            tokens += step
            program.chain.append(next_continuation(program.chain[-1], {"p": pid, "m": len(program.chain)}))
            program.chain_tokens.append(tokens)
        self.programs[program.session] = program
        return program

    def arrive(self, program: BenchProgram) -> None:
        """The program's next call arrives (admitted or held by the policy)."""
        program.calls += 1
        request_id = f"{program.session}/{program.calls}"
        final = program.steps_left <= 1
        request = CallRequest(
            request_id=request_id, session_id=program.session, prompt_tokens=program.context,
            chain=ContinuationChain(tuple(program.chain)),
            chain_tokens=tuple(program.chain_tokens), final=final,
        )
        self.requests[request_id] = (program, request)
        decision = self.policy.on_arrival(request, self.now)
        if isinstance(decision, Admit):
            self._admitted(program, request_id, decision.worker)
        else:
            program.waiting = request_id
            self.actions["hold"] += 1

    def complete(self, program: BenchProgram) -> None:
        request_id = program.in_flight
        assert request_id is not None
        _, request = self.requests.pop(request_id)
        output = int(min(2_000, max(30, self.rng.lognormvariate(math.log(300), 0.8))))
        program.in_flight = None
        worker = program.resident_worker
        total = request.prompt_tokens + output
        if worker is not None:
            self._store_own(program, worker, total // BLOCK, request.chain.head if request.chain else None)
        actions = self.policy.on_complete(request_id, Usage(request.prompt_tokens, output), self.now)
        program.steps_left -= 1
        tool = int(min(8_000, max(50, self.rng.lognormvariate(math.log(600), 1.0))))
        program.context = total + tool
        program.chain.append(next_continuation(program.chain[-1], {"role": "assistant", "n": program.calls}))
        program.chain_tokens.append(total)
        program.chain.append(next_continuation(program.chain[-1], {"role": "tool", "n": program.calls}))
        program.chain_tokens.append(program.context)
        self.carry_out(actions)

    # -- the shell side ----------------------------------------------------------------

    def _kv(self, worker: str, events: list) -> None:
        if events:
            self.kv_hashes += self.policy.observe_kv(worker, EventBatch(ts=self.now, events=events))

    def _store_own(self, program: BenchProgram, worker: str, upto_blocks: int, continuation: str | None) -> None:
        first_own = SHARED_TOKENS // BLOCK
        start = first_own + program.resident_blocks
        if upto_blocks <= start:
            return
        hashes = [_own_hash(program.pid, k) for k in range(start, upto_blocks)]
        parent = (_own_hash(program.pid, start - 1) if start > first_own
                  else _shared_hash(program.scaffold, first_own - 1))
        self._kv(worker, [BlockStored(hashes, parent, [], BLOCK, None, "GPU", None,
                                      session_id=program.session, continuation_id=continuation)])
        program.resident_blocks = upto_blocks - first_own

    def _evict_own(self, program: BenchProgram) -> None:
        if program.resident_worker is None or not program.resident_blocks:
            program.resident_worker, program.resident_blocks = None, 0
            return
        first_own = SHARED_TOKENS // BLOCK
        hashes = [_own_hash(program.pid, k) for k in range(first_own, first_own + program.resident_blocks)]
        self._kv(program.resident_worker, [BlockRemoved(hashes, "GPU")])
        program.resident_worker, program.resident_blocks = None, 0

    def _admitted(self, program: BenchProgram, request_id: str, worker: str) -> None:
        _, request = self.requests[request_id]
        program.in_flight = request_id
        program.waiting = None
        self.actions["admit"] += 1
        if program.resident_worker not in (None, worker):
            self._evict_own(program)
        program.resident_worker = worker
        n_shared = SHARED_TOKENS // BLOCK
        shared = [_shared_hash(program.scaffold, k) for k in range(n_shared)]
        # the shared prompt: stored by the first program on this worker, then reported as a
        # prefix hit (kv_cache_report_mode "full") for everyone after it
        self._kv(worker, [BlockStored(shared, None, [], BLOCK, None, "GPU", None,
                                      session_id=program.session,
                                      continuation_id=program.chain[1])])
        self._store_own(program, worker, request.prompt_tokens // BLOCK,
                        request.chain.head if request.chain else None)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Admit):
                program, _ = self.requests[action.request_id]
                self._admitted(program, action.request_id, action.worker)
            elif isinstance(action, Pause):
                self.actions["pause"] += 1
                program = self.programs[action.session_id]
                if self.rng.random() < 0.7:  # the engine evicted the demoted KV under pressure
                    self._evict_own(program)
            elif isinstance(action, Release):
                self.actions["release"] += 1
                program = self.programs.pop(action.session_id, None)
                if program is not None:
                    self._evict_own(program)
                    if program.waiting:
                        self.requests.pop(program.waiting, None)
            elif isinstance(action, Resume):
                self.actions["resume"] += 1
            elif isinstance(action, Mark):
                self.actions["mark"] += 1
            else:
                self.actions[type(action).__name__.lower()] += 1

    # -- views ---------------------------------------------------------------------------

    def mix(self) -> Counter:
        counts: Counter = Counter()
        for program in self.policy.programs.values():
            if program.active:
                counts["ACTIVE+" + program.phase.name] += 1
            elif program.paused:
                counts["PAUSED+waiting" if program.waiting else "PAUSED+idle"] += 1
            else:
                counts["PENDING+waiting" if program.waiting else "PENDING"] += 1
        counts["marked"] = sum(1 for p in self.policy.programs.values() if p.marked)
        return counts

    def utilizations(self) -> list[float]:
        return sorted(self.policy.ledger.utilization(w) for w in self.workers)

    def describe(self, label: str) -> None:
        mix = self.mix()
        u = self.utilizations()
        total = sum(v for k, v in mix.items() if k != "marked")
        parts = ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
        progress(f"tick: {label}: {total:,} programs ({parts})")
        blocks = sum(len(self.policy.index.worker(w).blocks) for w in self.workers)
        progress(f"tick: {label}: U over workers min {u[0]:.3f} / median {u[len(u) // 2]:.3f} / "
                 f"max {u[-1]:.3f}; KV index {blocks:,} blocks")

    # -- between ticks -----------------------------------------------------------------

    def in_flight(self) -> list[BenchProgram]:
        return [p for p in self.programs.values() if p.in_flight is not None]

    def acting(self) -> list[BenchProgram]:
        return [p for p in self.programs.values()
                if p.in_flight is None and p.waiting is None
                and p.session in self.policy.programs]

    def churn(self, completions: int, arrivals: int, in_flight: list[BenchProgram],
              acting: list[BenchProgram]) -> None:
        """A few completions and arrivals (picked from the given pools)."""
        rng = self.rng
        for program in rng.sample(in_flight, min(completions, len(in_flight))):
            if program.in_flight is not None and program.session in self.programs:
                self.complete(program)
        for program in rng.sample(acting, min(arrivals, len(acting))):
            if (program.in_flight is None and program.waiting is None
                    and program.session in self.policy.programs):
                self.arrive(program)
        # keep the population: a finished program is replaced by a new, small one
        while len(self.programs) < self.target_programs:
            self.arrive(self.new_program(int(math.exp(rng.uniform(math.log(2_000), math.log(8_000))))))

    def build(self, rounds: int, preload_u: float) -> None:
        self.target_programs = len(self._initial_contexts)
        for context in self._initial_contexts:
            self.now += 0.0005
            self.arrive(self.new_program(context))
        self.describe("after first arrivals")
        for r in range(rounds):
            self.now += 1.0
            busy = self.in_flight()
            self.churn(int(len(busy) * 0.75), 0, busy, [])
            self.now += 0.5
            self.carry_out(self.policy.tick(self.now))
            idle = self.acting()
            self.churn(0, int(len(idle) * 0.2), [], idle)
            self.now += 0.5
            self.carry_out(self.policy.tick(self.now))
            self.describe(f"warm-up round {r + 1}/{rounds}")
        # Put every worker just under the pause threshold by setting its capacity (as the
        # shell does once it reads num_gpu_blocks from /metrics; real workers differ by a
        # few percent): a few arrivals push a worker over, so the timed ticks run real
        # pause passes, and the resume passes that follow them.
        threshold = self.policy.config.pause_threshold
        for worker in self.workers:
            goal = self.rng.uniform(preload_u, threshold - 0.002)
            load = self.policy.ledger.load_tokens(worker)
            self.policy.set_capacity(worker, max(1, math.ceil(load / goal)))
        self.now += 1.0
        self.carry_out(self.policy.tick(self.now))
        self.describe("after setting capacities near the threshold")


def run(seed: int = 5, workers: int = 64, programs: int = 10_000, ticks: int = 200,
        warmup_ticks: int = 10, changes: int = 4, tick_step_s: float = 0.25,
        rounds: int = 4, preload_u: float = 0.93, profile: bool = False) -> dict[str, float]:
    progress(f"tick: building {programs:,} programs on {workers} workers (not timed)")
    t0 = time.perf_counter()
    fleet = Fleet(random.Random(seed), workers, programs)
    fleet.build(rounds, preload_u)
    caps = sorted(load.capacity_tokens or 0 for load in fleet.policy.ledger.workers())
    progress(f"tick: fleet built in {time.perf_counter() - t0:.1f}s (capacity "
             f"{caps[0]:,}–{caps[-1]:,} tokens/worker, {fleet.kv_hashes:,} KV hashes fed)")
    before = Counter(fleet.actions)
    samples: list[float] = []
    cpu_samples: list[float] = []
    per_tick = Counter()
    slowest: list[tuple[float, int, Counter]] = []  # (ms, tick, actions it returned)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    for i in range(warmup_ticks + ticks):
        in_flight, acting = fleet.in_flight(), fleet.acting()
        fleet.churn(changes, changes, in_flight, acting)
        fleet.now += tick_step_s
        if profiler is not None and i >= warmup_ticks:
            profiler.enable()
        start, cpu_start = time.perf_counter(), time.process_time()
        actions = fleet.policy.tick(fleet.now)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if profiler is not None and i >= warmup_ticks:
            profiler.disable()
        if i >= warmup_ticks:
            samples.append(elapsed * 1e3)
            cpu_samples.append(cpu * 1e3)
            kinds = {type(a).__name__ for a in actions}
            per_tick.update(type(a).__name__ for a in actions)
            if kinds & {"Pause", "Mark"}:
                per_tick["ticks with a pause pass"] += 1
            if "Resume" in kinds:
                per_tick["ticks with a resume"] += 1
            slowest.append((elapsed * 1e3, i - warmup_ticks, Counter(type(a).__name__ for a in actions)))
            slowest = sorted(slowest, key=lambda s: -s[0])[:5]
        fleet.carry_out(actions)
    fleet.describe(f"after {ticks} timed ticks")
    done = Counter(fleet.actions)
    done.subtract(before)
    progress("tick: actions returned by the timed ticks: "
             + (", ".join(f"{k} {v}" for k, v in sorted(per_tick.items())) or "none"))
    progress(f"tick: tick time ms: min {min(samples):.3f}, p50 {percentile(samples, 50):.3f}, "
             f"p90 {percentile(samples, 90):.3f}, p99 {percentile(samples, 99):.3f}, max {max(samples):.3f}")
    progress(f"tick: CPU time per tick ms (process_time, coarse): p50 {percentile(cpu_samples, 50):.3f}, "
             f"p99 {percentile(cpu_samples, 99):.3f}")
    for ms, index, kinds in slowest:
        progress(f"tick: slow tick #{index}: {ms:.3f} ms, returned "
                 + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "nothing"))
    if profiler is not None:
        import io
        import pstats
        import sys

        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue(), file=sys.stderr)
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    result("tick_p50_ms", p50, "ms")
    result("tick_p99_ms", p99, "ms")
    return {"tick_p50_ms": p50, "tick_p99_ms": p99}
