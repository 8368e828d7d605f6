"""One simulated vLLM engine: continuous batching over a :class:`BlockPool`.

It follows vLLM v1's scheduler where it matters for caching and throughput:
- every iteration first serves running requests in order (a decode is one token; a
  request mid-prefill gets the next chunk), then admits waiting ones in queue order
  while the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and free blocks
  allow; long prompts are prefilled in chunks (chunked prefill);
- the queue order is vLLM's ``--scheduling-policy``: ``"priority"`` orders waiting requests
  by ``(priority, arrival)`` and preempts the running request with the largest
  ``(priority, arrival)``; ``"fcfs"`` (vLLM's default) ignores ``priority``: waiting requests
  go by arrival at the engine and the last request admitted is preempted first
  (``vllm/v1/core/sched/scheduler.py``, 0.32);
- an admitted request reuses its longest cached prefix (capped one token short of the
  sequence, as vLLM does), touching those blocks, and allocates the rest;
- when a running request needs a block and none is free, a running request (the policy's
  victim, above) is preempted by recompute (its blocks freed, back to the waiting queue), and
  no waiting request is admitted in that iteration;
- blocks become cached as soon as the tokens that fill them are scheduled;
- a token is sampled when a request's computed tokens reach the end of its sequence;
  a finished request frees its blocks in reverse order.

Speed: an iteration is computed one at a time only when the batch composition can change.
While every running request is decoding and nothing waiting can be admitted, the next
``k`` iterations are identical but for growing contexts, so they are taken as one *decode
run* whose duration has a closed form; blocks are allocated and cached when the run ends,
replayed in the order single iterations would take them (no block is freed during it, so
each request gets the same blocks, the same blocks are evicted in the same order and the
KV events are the same). An arrival truncates the run at the first iteration boundary
after it.

For the simworker (simworker/engine_driver.py), which runs this model in scaled real time
behind an HTTP API: ``start`` can cap a decode run (so streamed tokens flow in small chunks), a
request can carry its token ids (put on ``BlockStored`` events as vLLM does) and ask for
``kv_cache_report_mode: "full"`` on its own, and ``abort`` drops a call whose client went
away. None of these changes anything for callers that do not use them.

Host KV tier (vLLM's native CPU offloading; only when the model has ``kv_offload_gib > 0``,
through the engine's connector, sim/offloading.py, to sim/host_tier.py; docs/design-notes.md
"Host KV tier"): every step offers the prompt
blocks its tokens complete to the tier, copied GPU→host after the step; a waiting request whose
prefix continues in the tier past its GPU hit gets blocks for it and waits, outside the batch,
for the host→GPU copy, then runs with those tokens computed. Copies overlap compute.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from scheduler.kv_events import KVEvent
from sim.block_pool import BlockPool
from sim.engine_request import EngineRequest
from sim.host_tier import HostTier
from sim.offloading import OffloadingConnector
from sim.step_time import StepTimeModel


@dataclass(slots=True)
class _DecodeRun:
    requests: list[EngineRequest]
    start: float
    steps: int
    context_tokens: int


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    decode_runs: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    reprefill_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    busy_s: float = 0.0


# vLLM's --scheduling-policy values (vllm/config/scheduler.py, 0.32).
SCHEDULING_POLICIES = ("fcfs", "priority")


class Engine:
    def __init__(self, name: str, model: StepTimeModel, *, num_blocks: int | None = None,
                 block_size: int | None = None, report_reuse: bool = False,
                 enable_events: bool = True, scheduling_policy: str = "priority") -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {scheduling_policy!r}")
        # vLLM's --scheduling-policy: whether a request's priority orders the queue at all
        self.scheduling_policy = scheduling_policy
        self._by_priority = scheduling_policy == "priority"
        # The engine model is vLLM with the Sluice plugin: its removals carry attribution.
        self.name = name
        self.model = model
        self.block_size = block_size or model.block_size
        if num_blocks is None:
            num_blocks = model.kv_capacity_tokens // self.block_size + 1
        self.pool = BlockPool(num_blocks, self.block_size, enable_events=enable_events,
                              attribute_removals=True)
        self.report_reuse = report_reuse
        self.max_num_seqs = model.max_num_seqs
        self.max_num_batched_tokens = model.max_num_batched_tokens
        self.waiting: list[tuple[float, int, EngineRequest]] = []
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()
        self.busy_until: float | None = None
        self._step: list[tuple[EngineRequest, int]] | None = None
        self._step_start = 0.0
        self._run: _DecodeRun | None = None
        self._order = 0
        # (request, limit, pool version, hit, hit as an array): _admission_cost's last lookup
        self._hit_memo: tuple[EngineRequest, int, int, list[int], np.ndarray] | None = None
        self.finished: list[EngineRequest] = []
        # the host KV tier's connector, when the model has one
        self.offloading = (OffloadingConnector(self.pool, model, enable_events=enable_events)
                           if model.kv_offload_gib > 0 else None)

    def _queue_key(self, request: EngineRequest) -> float:
        """What orders the waiting queue before arrival: the priority, under vLLM's priority
        scheduling; nothing (arrival alone) under FCFS."""
        return request.priority if self._by_priority else 0.0

    def _victim(self) -> EngineRequest:
        """The running request preempted when a block is needed and none is free."""
        if self._by_priority:
            return max(self.running, key=lambda r: (r.priority, r.order))
        return self.running[-1]

    @property
    def host_tier(self) -> HostTier | None:
        return None if self.offloading is None else self.offloading.tier

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    @property
    def idle(self) -> bool:
        return self.busy_until is None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting
                    or (self.offloading is not None and self.offloading.busy))

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call: the GPU pool's, then the host tier's (medium
        ``"CPU"``)."""
        events = self.pool.take_events()
        if self.offloading is not None:
            events += self.offloading.take_events()
        return events

    # -- arrivals ---------------------------------------------------------------------

    def add_request(self, request: EngineRequest, now: float) -> None:
        """Queue a call; if a decode run is under way, cut it at the next step boundary."""
        need = request.prompt_tokens + request.output_tokens
        if need > self.capacity_tokens:
            raise ValueError(
                f"{self.name}: request {request.request_id} needs {need} tokens of KV, "
                f"more than the whole pool ({self.capacity_tokens})"
            )
        self._order += 1
        request.order = self._order
        heapq.heappush(self.waiting, (self._queue_key(request), request.order, request))
        if self._run is not None:
            self._truncate_run(now)

    def _truncate_run(self, now: float) -> None:
        run = self._run
        assert run is not None
        seqs = len(run.requests)
        steps = self.model.decode_steps_within(seqs, run.context_tokens, now - run.start)
        if steps < run.steps:
            run.steps = steps
            self.busy_until = run.start + self.model.decode_run_s(seqs, run.context_tokens, steps)

    # -- stepping ---------------------------------------------------------------------

    def start(self, now: float, *, max_run_steps: int | None = None,
              max_run_s: float | None = None) -> float | None:
        """Begin the next iteration (or decode run) at ``now``; returns when it ends.

        ``max_run_steps`` / ``max_run_s`` cap a decode run (a run cut to one step is taken
        as a plain iteration); the time cap is reached, not undercut, by the last step."""
        if self.busy_until is not None:
            raise RuntimeError(f"{self.name}: start() while busy until {self.busy_until}")
        if self.offloading is not None:
            self.offloading.progress(now)
        if not self.has_work():
            return None
        run_steps, context = self._decode_run_length()
        if run_steps >= 2:
            first_done = None if self.offloading is None else self.offloading.first_load_done()
            if first_done is not None:
                # the scheduler admits a loaded request at the first step after its load
                run_steps = min(run_steps, self.model.decode_steps_within(len(self.running), context,
                                                                          first_done - now))
            if max_run_steps is not None:
                run_steps = min(run_steps, max_run_steps)
            if max_run_s is not None:
                run_steps = min(run_steps, self.model.decode_steps_within(len(self.running), context,
                                                                          max_run_s))
        if run_steps >= 2:
            self._run = _DecodeRun(list(self.running), now, run_steps, context)
            self.busy_until = now + self.model.decode_run_s(len(self.running), context, run_steps)
            self.stats.decode_runs += 1
            return self.busy_until
        scheduled = self._schedule(now)
        if not scheduled:
            first_done = None if self.offloading is None else self.offloading.first_load_done()
            if first_done is not None:
                # nothing to compute until a load lands: wait for it (an empty step)
                self._step = []
                self._step_start = now
                self.busy_until = max(now, first_done)
                return self.busy_until
            return None
        prefill = 0
        context = 0
        pairs = 0.0  # prefill attention: each new token over the context before it
        for request, n in scheduled:
            context += request.num_computed + n
            if n > 1 or request.num_computed + n < request.seq_len:
                prefill += n
                pairs += n * (request.num_computed + n / 2)
        self._step = scheduled
        self._step_start = now
        self.busy_until = now + self.model.step_s(prefill, len(scheduled), context, prefill_pairs=pairs)
        if self.offloading is not None:
            self.offloading.offer(scheduled, self.busy_until)
        return self.busy_until

    def complete(self) -> list[EngineRequest]:
        """Finish the iteration or run in progress; returns the requests that finished."""
        end = self.busy_until
        if end is None:
            raise RuntimeError(f"{self.name}: complete() while idle")
        done: list[EngineRequest] = []
        if self._run is not None:
            done = self._complete_run(self._run, end)
            self._run = None
        elif self._step:
            self.stats.steps += 1
            self.stats.busy_s += end - self._step_start
            for request, n in self._step:
                computed = request.num_computed + n
                request.num_computed = computed
                if computed >= request.prompt_tokens + request.num_output:
                    self._sample(request, end, 1, done)
            self._step = None
        else:
            assert self._step is not None  # the empty step of a wait for a load
            self._step = None
        self.busy_until = None
        for request in done:
            self._finish(request, end)
        if self.offloading is not None:
            self.offloading.progress(end)
        return done

    def _complete_run(self, run: _DecodeRun, end: float) -> list[EngineRequest]:
        steps = run.steps
        self.stats.steps += steps
        self.stats.busy_s += end - run.start
        bs = self.block_size
        pool = self.pool
        requests = run.requests
        # Replay the run's block allocations and cachings in the order single iterations
        # make them (step by step, running order within a step), so each request gets the
        # same block ids and the KV events come out the same as without the run. Only the
        # steps where a request crosses a block boundary are visited (no per-token work).
        starts = [r.num_computed for r in requests]
        points: list[tuple[int, int]] = []
        for i, c0 in enumerate(starts):
            # the steps whose token starts a new block, and those whose token fills one
            first = (1 - c0) % bs or bs
            points += [(s, i) for s in range(first, steps + 1, bs)]
            if bs > 1:
                first = (-c0) % bs or bs
                points += [(s, i) for s in range(first, steps + 1, bs)]
        points.sort()
        # decode_run_s(seqs, run.context_tokens, s) term by term, for the allocations' times
        model = self.model
        seqs = len(requests)
        per_step = model.base_s + model.seq_s * seqs + model.context_token_s * run.context_tokens
        growth = model.context_token_s * seqs
        start = run.start
        for s, i in points:
            request = requests[i]
            computed = starts[i] + s
            block_ids = request.block_ids
            need = -(-computed // bs) - len(block_ids)
            if need > 0:
                k = s - 1  # the steps before this one
                at = start + (k * per_step + growth * k * (k - 1) / 2.0)
                block_ids += pool.get_new_blocks(need, at)
            hashes = request.hashes
            num_full = min(computed // bs, len(hashes))
            if num_full > request.num_cached_blocks:
                tokens = request.token_ids
                pool.cache_full_blocks(block_ids, hashes, request.num_cached_blocks,
                                       num_full, session_id=request.session_id,
                                       continuation_id=request.continuation_id,
                                       token_ids=None if tokens is None
                                       else tokens[request.num_cached_blocks * bs:num_full * bs])
                request.num_cached_blocks = num_full
        done: list[EngineRequest] = []
        for request, c0 in zip(requests, starts):
            request.num_computed = c0 + steps
            if request.num_output == 0:
                # a prefill chunk ended one token short: the run's first step samples the
                # first token
                request.first_token_at = run.start + self.model.decode_run_s(seqs, run.context_tokens, 1)
            elif request.first_token_at is None:
                request.first_token_at = end
            request.num_output += steps
            if request.num_output >= request.output_tokens:
                done.append(request)
        self.stats.output_tokens += steps * seqs
        return done

    def _sample(self, request: EngineRequest, now: float, tokens: int, done: list[EngineRequest]) -> None:
        if request.first_token_at is None:
            request.first_token_at = now
        request.num_output += tokens
        self.stats.output_tokens += tokens
        if request.num_output >= request.output_tokens:
            done.append(request)

    def _finish(self, request: EngineRequest, now: float) -> None:
        request.finished_at = now
        self.running.remove(request)
        self.pool.free_blocks(request.block_ids[::-1], request.session_id)
        request.block_ids = []
        if self.offloading is not None:
            self.offloading.request_finished(request.request_id)
        self.stats.finished += 1
        self.finished.append(request)

    def _decode_run_length(self) -> tuple[int, int]:
        """How many identical pure-decode iterations can run from here (0 if not a run), and
        the batch's context tokens in the first of them."""
        running = self.running
        if not running or (self.offloading is not None and self.offloading.loaded):
            return 0, 0
        steps = running[0].output_tokens - running[0].num_output
        context = 0
        for request in running:
            computed = request.num_computed
            if request.prompt_tokens + request.num_output - computed != 1:
                return 0, 0
            context += computed + 1
            left = request.output_tokens - request.num_output
            if left < steps:
                steps = left
        if len(running) > self.max_num_batched_tokens or steps < 2:
            return 0, 0
        if self.waiting and self._could_admit_head():
            return 0, 0
        free = self.pool.num_free
        bs = self.block_size
        if len(running) * -(-steps // bs) <= free:
            return steps, context  # room for a whole block more per request and step run
        # a request needs a block at each step that takes it past the blocks it holds
        slack = [len(r.block_ids) * bs - r.num_computed for r in running]
        if self._blocks_for(slack, steps) <= free:
            return steps, context
        lo, hi = 0, steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._blocks_for(slack, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo, context

    def _blocks_for(self, slack: list[int], steps: int) -> int:
        """Blocks the running requests need for ``steps`` more tokens each (``slack``: room left)."""
        bs = self.block_size
        return sum(-(-(steps - room) // bs) for room in slack if room < steps)

    def _could_admit_head(self) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        if self.max_num_batched_tokens - len(self.running) <= 0:
            return False
        request = self.waiting[0][2]
        new_blocks, free_hits, _, _ = self._admission_cost(request, self.max_num_batched_tokens - len(self.running))
        return new_blocks + free_hits <= self.pool.num_free

    def _admission_cost(self, request: EngineRequest, budget: int) -> tuple[int, int, list[int], np.ndarray]:
        bs = self.block_size
        seq_len = request.seq_len
        limit = (seq_len - 1) // bs
        # the waiting head is looked up at every step: keep its hit while the hash map stands
        memo = self._hit_memo
        version = self.pool.version
        if memo is not None and memo[0] is request and memo[1] == limit and memo[2] == version:
            hit, hit_ids = memo[3], memo[4]
        else:
            hit = self.pool.longest_hit(request.hashes, limit)
            hit_ids = np.asarray(hit, dtype=np.intp)
            self._hit_memo = (request, limit, version, hit, hit_ids)
        hit_tokens = len(hit) * bs
        n = min(seq_len - hit_tokens, budget)
        new_blocks = -(-(hit_tokens + n) // bs) - len(hit)
        # hit blocks nobody references sit in the free queue: taking them costs free blocks
        free_hits = self.pool.count_free(hit_ids)
        return new_blocks, free_hits, hit, hit_ids

    def _schedule(self, now: float) -> list[tuple[EngineRequest, int]]:
        pool = self.pool
        bs = self.block_size
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        preempted = False
        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed
            n = min(request.prompt_tokens + request.num_output - computed, budget)
            need = -(-(computed + n) // bs) - len(request.block_ids)
            while need > pool.num_free:
                victim = self._victim()
                victim_index = self.running.index(victim)
                for k, (done, tokens) in enumerate(scheduled):
                    if done is victim:
                        del scheduled[k]
                        budget += tokens
                        break
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
            if preempted and request not in self.running:
                break  # the request itself was preempted: nothing more runs this step
            if need > 0:
                request.block_ids += pool.get_new_blocks(need, now)
            if (computed + n) // bs > request.num_cached_blocks:  # else _cache has nothing to do
                self._cache(request, computed + n)
            scheduled.append((request, n))
            budget -= n
            index += 1
        if preempted:
            return scheduled
        if self.offloading is not None and self.offloading.loaded:
            budget = self._admit_loaded(self.offloading.loaded, scheduled, budget, now)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][2]
            new_blocks, free_hits, hit, hit_ids = self._admission_cost(request, budget)
            if self.offloading is not None and self.offloading.start_load(request, hit, now):
                heapq.heappop(self.waiting)  # it waits for the load outside the queue
                continue
            if new_blocks + free_hits > pool.num_free:
                break
            heapq.heappop(self.waiting)
            hit_tokens = len(hit) * bs
            pool.touch(hit_ids)
            if (self.report_reuse or request.report_reuse) and hit:
                tokens = request.token_ids
                pool.emit_cached_block_events(request.hashes, len(hit), session_id=request.session_id,
                                              continuation_id=request.continuation_id,
                                              token_ids=None if tokens is None else tokens[:hit_tokens])
            request.block_ids = hit + pool.get_new_blocks(new_blocks, now)
            request.num_cached_blocks = len(hit)
            request.num_computed = hit_tokens
            n = min(request.seq_len - hit_tokens, budget)
            self._account_admission(request, hit_tokens, now)
            self._cache(request, hit_tokens + n)
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        return scheduled

    # -- Sluice's host-tier directives ------------------------------------------------------

    def offload(self, session_id: str) -> None:
        """``kv.offload`` as the plugin runs it: park the session's blocks the tier holds,
        demote it on the GPU. Without a tier it is a demotion."""
        if self.offloading is not None:
            self.offloading.park(session_id)
        self.pool.demote(session_id)

    def prefetch(self, session_id: str, priority: int, deadline_s: float | None, now: float) -> None:
        """``kv.prefetch``: favour the session's parked blocks in the tier until the deadline
        and undo its demotion."""
        if self.offloading is not None:
            self.offloading.favour(session_id, priority, deadline_s, now)
        self.pool.release(session_id)

    def release_session(self, session_id: str) -> None:
        """``kv.release``: forget the session's bias on the GPU and in the tier."""
        if self.offloading is not None:
            self.offloading.unfavour(session_id)
        self.pool.release(session_id)

    def _admit_loaded(self, loaded: list[EngineRequest], scheduled: list[tuple[EngineRequest, int]],
                      budget: int, now: float) -> int:
        """Admit requests whose host load is done, best priority first, while the budget,
        the sequence limit and free blocks allow; returns the budget left."""
        pool = self.pool
        bs = self.block_size
        loaded.sort(key=lambda r: (self._queue_key(r), r.order))
        while loaded and budget > 0 and len(self.running) < self.max_num_seqs:
            request = loaded[0]
            n = min(request.seq_len - request.num_computed, budget)
            need = -(-(request.num_computed + n) // bs) - len(request.block_ids)
            if need > pool.num_free:
                break
            loaded.pop(0)
            if need > 0:
                request.block_ids.extend(pool.get_new_blocks(need, now))
            self._account_admission(request, request.num_computed, now)
            self._cache(request, request.num_computed + n)
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        return budget

    def _account_admission(self, request: EngineRequest, hit_tokens: int, now: float) -> None:
        """Hit rate counts the first admission; re-prefill counts every recomputed token
        that this session had computed before (evicted prefix, or lost to preemption)."""
        to_compute = request.seq_len - hit_tokens
        reprefill = max(0, min(request.known_prefix_tokens, request.seq_len) - hit_tokens)
        request.reprefill_tokens += reprefill
        self.stats.reprefill_tokens += reprefill
        self.stats.computed_prefill_tokens += to_compute
        if request.first_scheduled_at is None:
            request.first_scheduled_at = now
            request.cached_tokens = hit_tokens
            self.stats.prompt_tokens += request.prompt_tokens
            self.stats.cached_tokens += min(hit_tokens, request.prompt_tokens)

    def _cache(self, request: EngineRequest, computed_after: int) -> None:
        bs = self.block_size
        num_full = min(computed_after // bs, len(request.hashes), request.seq_len // bs)
        if num_full > request.num_cached_blocks:
            tokens = request.token_ids
            self.pool.cache_full_blocks(request.block_ids, request.hashes, request.num_cached_blocks,
                                        num_full, session_id=request.session_id,
                                        continuation_id=request.continuation_id,
                                        token_ids=None if tokens is None
                                        else tokens[request.num_cached_blocks * bs:num_full * bs])
            request.num_cached_blocks = num_full

    def abort(self, request_id: str) -> EngineRequest | None:
        """Drop a call that is no longer wanted (its client went away), as vLLM's abort does:
        out of the waiting queue, or out of the batch and any iteration or decode run in
        progress (which still ends when planned); its blocks are freed in reverse order and
        the cached ones stay cached. Nothing is sampled for it afterwards and it does not
        count as finished. Returns the request, or None if the engine does not hold it
        (finished or unknown)."""
        for index, (_, _, request) in enumerate(self.waiting):
            if request.request_id == request_id:
                self.waiting[index] = self.waiting[-1]
                self.waiting.pop()
                heapq.heapify(self.waiting)
                return request  # a waiting request holds no blocks (preemption freed them)
        if self.offloading is not None:
            loading = self.offloading.abort(request_id)
            if loading is not None:
                return loading
        for request in self.running:
            if request.request_id == request_id:
                break
        else:
            return None
        self.running.remove(request)
        if self._step is not None:
            self._step = [(r, n) for r, n in self._step if r is not request]
        if self._run is not None:
            self._run.requests = [r for r in self._run.requests if r is not request]
        self.pool.free_blocks(reversed(request.block_ids), request.session_id)
        request.block_ids = []
        return request

    def _preempt(self, request: EngineRequest) -> None:
        # what it had computed is lost (the tokens scheduled in this iteration never ran)
        request.known_prefix_tokens = max(request.known_prefix_tokens, request.num_computed)
        self.running.remove(request)
        self.pool.free_blocks(reversed(request.block_ids), request.session_id)
        request.block_ids = []
        request.num_computed = 0
        request.num_cached_blocks = 0
        request.preemptions += 1
        self.stats.preemptions += 1
        # vLLM puts a preempted request back in its queue (priority) or at its front (FCFS)
        key = self._queue_key(request) if self._by_priority else -1.0
        heapq.heappush(self.waiting, (key, request.order, request))
