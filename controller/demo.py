"""The scripted demo behind ``sluice demo`` (until the simulator lands).

Twelve SWE-bench-like programs share a system prompt and grow their context call by call,
with tool gaps between calls. They run against two toy workers of 20,000 tokens of KV each,
in virtual time, driven by a small deterministic event loop. The same script (drawn once
from a seeded RNG) is run under each policy asked for; everything printed is what the
policy decided and what the toy workers did.

The toy worker is deliberately simple and says so:
- a block pool of ``capacity // 16`` blocks with prefix caching: a call's prompt reuses the
  longest prefix of its blocks still resident; blocks it computes are stored (a
  ``BlockStored`` per contiguous run, labelled with the session, parent-chained); full
  output blocks are stored when the call completes; when room is needed the least recently
  used blocks no running call holds are evicted (one ``BlockRemoved`` per hash, as vLLM
  0.32 sends them). A prefix-cache hit is reported as a ``BlockStored`` of the reused
  prefix, as vLLM does for a request with ``kv_cache_report_mode: "full"``; a finished
  call's blocks are freed tail first, as vLLM frees them;
- a call starts only when all the blocks it needs (prompt + output) fit, in the priority
  order of the :class:`Admit` that sent it (lower first, then arrival), head of line;
- prefill is one resource per worker: a call's uncached prompt tokens are prefilled at
  ``prefill_tokens_per_s`` after the prefills queued before it; then it decodes its output
  at ``decode_tokens_per_s`` (no slowdown with batch size);
- retention directives (Retain/Demote/Release) are printed but not acted on: eviction is
  plain LRU (the engine plugin that honours them is upcoming).

Every event batch goes through the msgpack wire format (encoded, then decoded) before
``policy.observe_kv`` sees it, as a live subscriber would.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler.actions import Action, Admit, Demote, Hold, Mark, Pause, Release, Resume, Retain
from scheduler.calls import CallRequest, Usage
from scheduler.config import PolicyConfig
from scheduler.coordinates import SessionId, mint_chain
from scheduler.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventBatchDecoder,
    EventBatchEncoder,
)
from scheduler.policies import make_policy
from scheduler.policies.base import Policy

BLOCK_SIZE = 16
MODEL = "demo-model"
TOOLS = [{"name": "bash"}, {"name": "str_replace_editor"}, {"name": "submit"}]
DEFAULT_POLICIES = ("program_aware", "kv_aware")
MEDIUM = "GPU"
VOCAB = 50_000


@dataclass(frozen=True)
class Scenario:
    """The knobs of the scripted workload (all counts in tokens, times in seconds)."""

    seed: int = 7
    workers: int = 2
    capacity_tokens: int = 20_000
    programs: int = 12
    tools_tokens: int = 800          # the tool schemas (continuation root c0)
    system_tokens: int = 1_200       # the system prompt every program shares
    max_context_tokens: int = 14_000  # a program ends before its prompt would pass this
    start_spread_s: float = 4.0      # programs start uniformly within this window
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 40.0

    @property
    def shared_tokens(self) -> int:
        return self.tools_tokens + self.system_tokens


@dataclass(frozen=True)
class Step:
    output_tokens: int
    tool_tokens: int      # the tool result appended after the output
    tool_time_s: float    # the tool gap before the next call


@dataclass(frozen=True)
class ProgramScript:
    session_id: str
    start_s: float
    task_tokens: int
    steps: tuple[Step, ...]  # one per call; the last call's tool fields are unused


def make_script(scenario: Scenario) -> list[ProgramScript]:
    """Draw every program's calls from the seeded RNG (the same script for each policy)."""
    rng = np.random.default_rng(scenario.seed)
    scripts = []
    for i in range(scenario.programs):
        start = float(rng.uniform(0.0, scenario.start_spread_s))
        task = int(rng.integers(300, 1_200))
        context = scenario.shared_tokens + task
        steps: list[Step] = []
        while True:
            out = int(np.clip(rng.lognormal(math.log(250), 0.5), 60, 800))
            tool = int(np.clip(rng.lognormal(math.log(700), 0.7), 80, 2_500))
            gap = float(np.clip(rng.lognormal(math.log(3.0), 0.9), 0.3, 60.0))
            steps.append(Step(out, tool, round(gap, 3)))
            context += out + tool
            if context > scenario.max_context_tokens or len(steps) >= 14:
                break
        scripts.append(ProgramScript(f"swe-{i:02d}", round(start, 3), task, tuple(steps)))
    return scripts


# -- the program side: transcripts, chains and block hashes ----------------------------


def _h64(*parts: object) -> int:
    digest = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # keep it a positive int64


def _token_ids(hashes: list[int]) -> list[int]:
    """Placeholder token ids for full blocks (the index only counts them)."""
    out: list[int] = []
    for block_hash in hashes:
        base = block_hash % VOCAB
        out.extend((base + j) % VOCAB for j in range(BLOCK_SIZE))
    return out


class Transcript:
    """One program's growing, append-only conversation and the ids the shells would mint."""

    def __init__(self, scenario: Scenario, script: ProgramScript) -> None:
        self.scenario = scenario
        self.script = script
        self.messages: list[Any] = [
            {"role": "system", "content": "You are a software engineering agent."},
            {"role": "user", "content": f"Resolve issue {script.session_id}."},
        ]
        self.chain_tokens: list[int] = [
            scenario.tools_tokens,
            scenario.shared_tokens,
            scenario.shared_tokens + script.task_tokens,
        ]
        self.tokens = self.chain_tokens[-1]
        self._hashes: list[int] = []

    def block_hash(self, k: int) -> int:
        """Full block ``k`` of the transcript; the shared prompt's blocks are everyone's."""
        if (k + 1) * BLOCK_SIZE <= self.scenario.shared_tokens:
            return _h64("shared", k)
        return _h64(self.script.session_id, k)

    def block_hashes(self, tokens: int) -> list[int]:
        """Hashes of the full blocks covering the first ``tokens`` tokens."""
        n = tokens // BLOCK_SIZE
        while len(self._hashes) < n:
            self._hashes.append(self.block_hash(len(self._hashes)))
        return self._hashes[:n]

    def request(self, step: int) -> CallRequest:
        chain = mint_chain(MODEL, None, TOOLS, self.messages)
        last = step == len(self.script.steps) - 1
        return CallRequest(
            request_id=f"{self.script.session_id}/{step}",
            session_id=SessionId(self.script.session_id),
            prompt_tokens=self.tokens,
            max_output_tokens=1_024,
            chain=chain,
            chain_tokens=tuple(self.chain_tokens),
            block_hashes=tuple(self.block_hashes(self.tokens)),
            final=last,
        )

    def append_output(self, step: int, output_tokens: int) -> None:
        self.messages.append({"role": "assistant", "content": f"step {step}: run a command"})
        self.tokens += output_tokens
        self.chain_tokens.append(self.tokens)

    def append_tool_result(self, step: int, tool_tokens: int) -> None:
        self.messages.append({"role": "tool", "content": f"step {step}: command output"})
        self.tokens += tool_tokens
        self.chain_tokens.append(self.tokens)


# -- the toy worker ----------------------------------------------------------------------


@dataclass
class RunningCall:
    request: CallRequest
    output_tokens: int
    held: list[int]        # cached block hashes this call references
    scratch_blocks: int    # blocks it holds that are not (yet) cached
    cached_tokens: int
    started_at: float


@dataclass(order=True)
class _Queued:
    priority: float
    seq: int
    request: CallRequest = field(compare=False)
    output_tokens: int = field(compare=False)
    transcript: Transcript = field(compare=False)


class ToyWorker:
    """A prefix-caching block pool with an LRU of free blocks and a priority queue of calls."""

    def __init__(self, name: str, capacity_tokens: int, scenario: Scenario) -> None:
        self.name = name
        self.capacity_blocks = capacity_tokens // BLOCK_SIZE
        self.scenario = scenario
        # every cached block, least recently used first; ``refs`` counts running users
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.refs: dict[int, int] = {}
        self.scratch = 0
        self.queue: list[_Queued] = []
        self.running: dict[str, RunningCall] = {}
        self.ever_stored: set[int] = set()
        self.pending_events: list[BlockStored | BlockRemoved] = []
        # measures
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.reprefill_tokens = 0
        self.evicted_blocks = 0
        self.peak_in_use_blocks = 0
        self.prefill_free_at = 0.0
        self.prefill_busy_s = 0.0

    @property
    def used_blocks(self) -> int:
        """Blocks holding KV: cached ones (in use or free for reuse) and scratch."""
        return len(self.cached) + self.scratch

    @property
    def in_use_blocks(self) -> int:
        """Blocks that running calls hold (cannot be evicted)."""
        return len(self.refs) + self.scratch

    def enqueue(self, request: CallRequest, priority: float, seq: int, output_tokens: int,
                transcript: Transcript) -> None:
        heapq.heappush(self.queue, _Queued(priority, seq, request, output_tokens, transcript))

    def try_start(self, now: float) -> list[tuple[RunningCall, float]]:
        """Start queued calls, best priority first, while the head's blocks fit."""
        started = []
        while self.queue:
            head = self.queue[0]
            call = self._allocate(head.request, head.output_tokens, now)
            if call is None:
                break
            heapq.heappop(self.queue)
            self.running[head.request.request_id] = call
            # prefill is one shared resource per worker (calls prefill one after another);
            # decode runs alongside everything else at a fixed per-sequence rate
            uncached = head.request.prompt_tokens - call.cached_tokens
            prefill_start = max(now, self.prefill_free_at)
            self.prefill_free_at = prefill_start + uncached / self.scenario.prefill_tokens_per_s
            self.prefill_busy_s += self.prefill_free_at - prefill_start
            duration = (self.prefill_free_at - now
                        + head.output_tokens / self.scenario.decode_tokens_per_s)
            started.append((call, duration))
        return started

    def _allocate(self, request: CallRequest, output_tokens: int, now: float) -> RunningCall | None:
        prompt_hashes = list(request.block_hashes or ())
        hit = 0
        for block_hash in prompt_hashes:
            if block_hash not in self.cached:
                break
            hit += 1
        # blocks after the first miss that are still resident are reused, but recomputed
        reused_later = [h for h in prompt_hashes[hit:] if h in self.cached]
        total_blocks = math.ceil((request.prompt_tokens + output_tokens) / BLOCK_SIZE)
        new_blocks = total_blocks - hit - len(reused_later)
        keep = set(prompt_hashes[:hit]) | set(reused_later)
        evictable = sum(1 for h in self.cached if self.refs.get(h, 0) == 0 and h not in keep)
        free = self.capacity_blocks - self.used_blocks
        if new_blocks > free + evictable:
            return None
        self._evict(new_blocks - free, keep)
        for block_hash in keep:
            self.refs[block_hash] = self.refs.get(block_hash, 0) + 1
        # the gateway asks for kv_cache_report_mode "full": vLLM then reports the reused
        # prefix as a BlockStored from block 0, labelled with this request's session
        self._emit_stored(prompt_hashes[:hit], None, request.session_id)
        # store the prompt's missing full blocks: one parent-chained event per contiguous run
        run: list[int] = []
        run_parent: int | None = None
        for k in range(hit, len(prompt_hashes)):
            block_hash = prompt_hashes[k]
            if block_hash in self.ever_stored:
                self.reprefill_tokens += BLOCK_SIZE  # computed here before, evicted since
            if block_hash in keep:
                self._emit_stored(run, run_parent, request.session_id)
                run = []
                continue
            if not run:
                run_parent = prompt_hashes[k - 1] if k else None
            self.cached[block_hash] = None
            self.refs[block_hash] = 1
            self.ever_stored.add(block_hash)
            run.append(block_hash)
        self._emit_stored(run, run_parent, request.session_id)
        scratch = total_blocks - len(prompt_hashes)
        self.scratch += scratch
        cached_tokens = hit * BLOCK_SIZE
        self.prompt_tokens += request.prompt_tokens
        self.cached_tokens += cached_tokens
        self.peak_in_use_blocks = max(self.peak_in_use_blocks, self.in_use_blocks)
        return RunningCall(request, output_tokens, prompt_hashes, scratch, cached_tokens, now)

    def _evict(self, blocks: int, keep: set[int]) -> None:
        if blocks <= 0:
            return
        removed = []
        for block_hash in self.cached:
            if len(removed) >= blocks:
                break
            if self.refs.get(block_hash, 0) == 0 and block_hash not in keep:
                removed.append(block_hash)
        for block_hash in removed:
            del self.cached[block_hash]
            self.refs.pop(block_hash, None)
        self.evicted_blocks += len(removed)
        # vLLM 0.32 sends one BlockRemoved per evicted hash
        self.pending_events.extend(
            BlockRemoved(block_hashes=[h], medium=MEDIUM, group_idx=0) for h in removed
        )

    def finish(self, request_id: str, transcript: Transcript) -> RunningCall:
        """The call completed: store its full output blocks, free the rest, tail first."""
        call = self.running.pop(request_id)
        self.scratch -= call.scratch_blocks
        total = call.request.prompt_tokens + call.output_tokens
        all_hashes = transcript.block_hashes(total)
        new = [h for h in all_hashes[len(call.held):] if h not in self.cached]
        for block_hash in new:
            self.cached[block_hash] = None
            self.ever_stored.add(block_hash)
        self._emit_stored(new, call.held[-1] if call.held else None, call.request.session_id)
        # free them as vLLM does, tail first: the tail is evicted before the head, and all
        # of them after blocks freed earlier
        for block_hash in reversed(call.held):
            left = self.refs.get(block_hash, 0) - 1
            if left > 0:
                self.refs[block_hash] = left
            else:
                self.refs.pop(block_hash, None)
        for block_hash in reversed(call.held + new):
            self.cached.move_to_end(block_hash)
        return call

    def _emit_stored(self, hashes: list[int], parent: int | None, session: str) -> None:
        if hashes:
            self.pending_events.append(BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=_token_ids(hashes),
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                group_idx=0,
                session_id=session,
            ))

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.pending_events = self.pending_events, []
        return events


# -- the event loop ------------------------------------------------------------------------


@dataclass
class _CallInfo:
    request: CallRequest
    transcript: Transcript
    step: int
    output_tokens: int
    arrived_at: float
    worker: str | None = None


@dataclass
class PolicyRun:
    """What one policy did with the script, as measured in the demo."""

    policy: str
    calls_total: int
    calls_completed: int = 0
    programs_completed: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    peak_utilization: dict[str, float] = field(default_factory=dict)
    peak_kv_in_use: dict[str, float] = field(default_factory=dict)
    prefill_busy_s: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reprefill_tokens: int = 0
    evicted_blocks: int = 0
    kv_batches: int = 0
    kv_hashes: int = 0
    makespan_s: float = 0.0
    completion_times_s: dict[str, float] = field(default_factory=dict)
    call_latency_s: list[float] = field(default_factory=list)
    stopped_early: bool = False

    def summary(self) -> dict[str, Any]:
        times = list(self.completion_times_s.values())
        lat = self.call_latency_s
        return {
            "policy": self.policy,
            "calls_completed": self.calls_completed,
            "calls_total": self.calls_total,
            "programs_completed": self.programs_completed,
            "pauses": self.counts.get("pause", 0),
            "resumes": self.counts.get("resume", 0),
            "marks": self.counts.get("mark", 0),
            "holds": self.counts.get("hold", 0),
            "decisions": dict(sorted(self.counts.items())),
            "peak_utilization": {k: round(v, 4) for k, v in self.peak_utilization.items()},
            "peak_kv_in_use": {k: round(v, 4) for k, v in self.peak_kv_in_use.items()},
            "prefill_busy_s": {k: round(v, 3) for k, v in self.prefill_busy_s.items()},
            "prefix_hit_rate": round(self.cached_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "reprefill_tokens": self.reprefill_tokens,
            "evicted_blocks": self.evicted_blocks,
            "kv_event_batches": self.kv_batches,
            "kv_event_hashes": self.kv_hashes,
            "time_to_complete_all_s": round(self.makespan_s, 3),
            "program_time_to_complete_s": {
                "mean": round(sum(times) / len(times), 3) if times else None,
                "max": round(max(times), 3) if times else None,
            },
            "call_latency_s": {
                "p50": round(float(np.percentile(lat, 50)), 3) if lat else None,
                "p99": round(float(np.percentile(lat, 99)), 3) if lat else None,
            },
            "stopped_early": self.stopped_early,
        }


def _fmt_u(u: float | None) -> str:
    if u is None:
        return "-"
    return "inf" if math.isinf(u) else f"{u:.2f}"


class DemoRun:
    """Drives one policy through the script with the toy workers, in virtual time."""

    # a guard against a scenario that cannot finish (it never triggers on the default one)
    MAX_VIRTUAL_S = 6 * 3600.0

    def __init__(self, policy_name: str, scenario: Scenario, scripts: list[ProgramScript],
                 emit: Callable[[str], None] | None = None,
                 config: PolicyConfig | None = None) -> None:
        self.scenario = scenario
        self.scripts = scripts
        self.emit = emit
        self.policy: Policy = make_policy(config or PolicyConfig(), name=policy_name)
        self.workers: dict[str, ToyWorker] = {}
        for i in range(scenario.workers):
            name = f"w{i}"
            self.policy.add_worker(name, scenario.capacity_tokens)
            self.workers[name] = ToyWorker(name, scenario.capacity_tokens, scenario)
        self.transcripts = {s.session_id: Transcript(scenario, s) for s in scripts}
        self.calls: dict[str, _CallInfo] = {}
        self._heap: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self._encoder = EventBatchEncoder()
        self._decoder = EventBatchDecoder()
        self._started: dict[str, float] = {}
        self._unfinished = len(scripts)
        self.run = PolicyRun(policy_name, calls_total=sum(len(s.steps) for s in scripts))
        self.run.peak_utilization = {name: 0.0 for name in self.workers}
        self.run.peak_kv_in_use = {name: 0.0 for name in self.workers}

    # -- plumbing ----------------------------------------------------------------------

    def _push(self, at: float, kind: str, *payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def _u(self, worker: str | None) -> float | None:
        return None if worker is None else self.policy.ledger.utilization(worker)

    def _log(self, now: float, action: str, session: str, worker: str | None, note: str = "") -> None:
        self.run.counts[action] = self.run.counts.get(action, 0) + 1
        if self.emit is not None:
            line = f"  {now:8.2f}  {action:<7} {session:<7} {worker or '-':<6} {_fmt_u(self._u(worker)):>7}"
            self.emit(line + (f"  {note}" if note else ""))

    def _sample(self) -> None:
        for name, worker in self.workers.items():
            u = self.policy.ledger.utilization(name)
            if u > self.run.peak_utilization[name]:
                self.run.peak_utilization[name] = u
            self.run.peak_kv_in_use[name] = worker.peak_in_use_blocks / worker.capacity_blocks

    def _publish(self, now: float) -> None:
        """Send each worker's pending KV events through the wire format to the policy."""
        for name, worker in self.workers.items():
            events = worker.take_events()
            if not events:
                continue
            payload = self._encoder.encode(EventBatch(ts=now, events=events))
            self.run.kv_hashes += self.policy.observe_kv(name, self._decoder.decode(payload))
            self.run.kv_batches += 1

    def _start_calls(self, now: float) -> None:
        for worker in self.workers.values():
            for call, duration in worker.try_start(now):
                self._push(now + duration, "finish", worker.name, call.request.request_id)
        self._publish(now)

    # -- decisions ---------------------------------------------------------------------

    def _carry_out(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, Admit):
                info = self.calls[action.request_id]
                info.worker = action.worker
                self.workers[action.worker].enqueue(
                    info.request, action.priority, next(self._seq), info.output_tokens, info.transcript)
                note = "resumed, priority boosted" if action.resumed else ""
                self._log(now, "admit", action.session_id, action.worker,
                          f"call {info.step} (held since {info.arrived_at:.2f})" + (f", {note}" if note else ""))
            elif isinstance(action, Pause):
                self._log(now, "pause", action.session_id, action.worker)
            elif isinstance(action, Mark):
                self._log(now, "mark", action.session_id, action.worker, "pause after its call")
            elif isinstance(action, Resume):
                self._log(now, "resume", action.session_id, action.worker,
                          "forced" if action.forced else "")
            elif isinstance(action, Retain):
                self._log(now, "retain", action.session_id, action.worker,
                          f"priority {action.priority}, ttl {action.ttl_s:g}s")
            elif isinstance(action, Demote):
                self._log(now, "demote", action.session_id, action.worker)
            elif isinstance(action, Release):
                self._log(now, "release", action.session_id, action.worker, action.reason)
            else:  # pragma: no cover - Hold only comes from on_arrival
                self._log(now, type(action).__name__.lower(), action.session_id, None)

    def _arrive(self, now: float, session: str, step: int) -> None:
        transcript = self.transcripts[session]
        if step > 0:
            transcript.append_tool_result(step - 1, transcript.script.steps[step - 1].tool_tokens)
        else:
            self._started[session] = now
        request = transcript.request(step)
        info = _CallInfo(request, transcript, step, transcript.script.steps[step].output_tokens, now)
        self.calls[request.request_id] = info
        decision = self.policy.on_arrival(request, now)
        if isinstance(decision, Admit):
            info.worker = decision.worker
            self.workers[decision.worker].enqueue(
                request, decision.priority, next(self._seq), info.output_tokens, transcript)
            self._log(now, "admit", session, decision.worker,
                      f"call {step}, prompt {request.prompt_tokens} tokens")
        else:
            assert isinstance(decision, Hold)
            self._log(now, "hold", session, None, f"call {step}: {decision.reason}")
        self._start_calls(now)

    def _finish(self, now: float, worker_name: str, request_id: str) -> None:
        info = self.calls.pop(request_id)
        transcript = info.transcript
        call = self.workers[worker_name].finish(request_id, transcript)
        self._publish(now)
        usage = Usage(call.request.prompt_tokens, info.output_tokens, call.cached_tokens)
        actions = self.policy.on_complete(request_id, usage, now)
        self.run.calls_completed += 1
        self.run.call_latency_s.append(now - info.arrived_at)
        transcript.append_output(info.step, info.output_tokens)
        session = transcript.script.session_id
        if call.request.final:
            self.run.programs_completed += 1
            self.run.completion_times_s[session] = now - self._started[session]
            self.run.makespan_s = now
            self._unfinished -= 1
        else:
            gap = transcript.script.steps[info.step].tool_time_s
            self._push(now + gap, "arrive", session, info.step + 1)
        self._carry_out(actions, now)
        self._carry_out(self.policy.tick(now), now)
        self._start_calls(now)

    def _tick(self, now: float) -> None:
        self._carry_out(self.policy.tick(now), now)
        self._start_calls(now)
        if self._unfinished:
            self._push(now + self.policy.tick_interval_s, "tick")

    def execute(self) -> PolicyRun:
        for script in self.scripts:
            self._push(script.start_s, "arrive", script.session_id, 0)
        self._push(self.policy.tick_interval_s, "tick")
        while self._heap and self._unfinished:
            now, _, kind, payload = heapq.heappop(self._heap)
            if now > self.MAX_VIRTUAL_S:
                self.run.stopped_early = True
                break
            if kind == "arrive":
                self._arrive(now, *payload)  # type: ignore[arg-type]
            elif kind == "finish":
                self._finish(now, *payload)  # type: ignore[arg-type]
            else:
                self._tick(now)
            self._sample()
        for worker in self.workers.values():
            self.run.prompt_tokens += worker.prompt_tokens
            self.run.cached_tokens += worker.cached_tokens
            self.run.reprefill_tokens += worker.reprefill_tokens
            self.run.evicted_blocks += worker.evicted_blocks
            self.run.prefill_busy_s[worker.name] = worker.prefill_busy_s
        return self.run


def run_demo(policies: tuple[str, ...] = DEFAULT_POLICIES, scenario: Scenario | None = None,
             emit: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the script under each policy; returns the JSON-ready summary."""
    scenario = scenario or Scenario()
    scripts = make_script(scenario)
    results = {}
    for name in policies:
        if emit is not None:
            emit(f"\n== {name} ==")
            emit(f"  {'t (s)':>8}  {'action':<7} {'session':<7} {'worker':<6} {'U after':>7}  note")
        results[name] = DemoRun(name, scenario, scripts, emit).execute().summary()
    return {
        "scenario": {
            **scenario.__dict__,
            "calls": sum(len(s.steps) for s in scripts),
            "final_context_tokens": {
                s.session_id: scenario.shared_tokens + s.task_tokens
                + sum(st.output_tokens + st.tool_tokens for st in s.steps[:-1])
                + s.steps[-1].output_tokens
                for s in scripts
            },
        },
        "policies": results,
    }


def format_summary(result: dict[str, Any]) -> list[str]:
    """The per-policy comparison table printed after the decisions."""
    policies = result["policies"]
    names = list(policies)
    sc = result["scenario"]
    width = max(14, *(len(n) for n in names))
    lines = [
        "",
        f"summary: {sc['programs']} programs, {sc['calls']} calls, {sc['workers']} toy workers "
        f"x {sc['capacity_tokens']:,} tokens (virtual time, seed {sc['seed']})",
        f"  {'':<34}" + "".join(f"{n:>{width + 2}}" for n in names),
    ]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"  {label:<34}" + "".join(f"{v:>{width + 2}}" for v in values))

    row("calls completed", [f"{p['calls_completed']}/{p['calls_total']}" for p in policies.values()])
    row("programs completed", [str(p["programs_completed"]) for p in policies.values()])
    row("holds (on arrival)", [str(p["holds"]) for p in policies.values()])
    row("pauses", [str(p["pauses"]) for p in policies.values()])
    row("resumes", [str(p["resumes"]) for p in policies.values()])
    row("marks", [str(p["marks"]) for p in policies.values()])
    for worker in next(iter(policies.values()))["peak_utilization"]:
        row(f"peak U {worker} (ledger)", [_fmt_u(p["peak_utilization"][worker]) for p in policies.values()])
    for worker in next(iter(policies.values()))["peak_kv_in_use"]:
        row(f"peak KV held by running calls {worker}",
            [f"{p['peak_kv_in_use'][worker]:.0%}" for p in policies.values()])
    row("prefix-cache hit rate", [f"{p['prefix_hit_rate']:.1%}" for p in policies.values()])
    row("re-prefilled tokens", [f"{p['reprefill_tokens']:,}" for p in policies.values()])
    row("prefill busy, all workers (s)",
        [f"{sum(p['prefill_busy_s'].values()):.1f}" for p in policies.values()])
    row("time to complete all (s)", [f"{p['time_to_complete_all_s']:.1f}" for p in policies.values()])
    row("program time to complete, mean (s)",
        [f"{p['program_time_to_complete_s']['mean']:.1f}" for p in policies.values()])
    row("program time to complete, max (s)",
        [f"{p['program_time_to_complete_s']['max']:.1f}" for p in policies.values()])
    row("call latency p50 / p99 (s)",
        [f"{p['call_latency_s']['p50']:.1f} / {p['call_latency_s']['p99']:.1f}" for p in policies.values()])
    if any(p["stopped_early"] for p in policies.values()):
        lines.append("  (a run was stopped at the virtual-time guard before every program finished)")
    lines += [
        "",
        "  Times come from the toy cost model (serial prefill per worker, fixed decode rate, no",
        "  batching slowdown, plain LRU eviction); they show how the policies differ on this",
        "  script, not what a GPU would do. The simulator (upcoming) models the engine.",
    ]
    return lines
