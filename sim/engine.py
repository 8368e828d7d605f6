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
after it. (Runs live in sim/decode_runs.py.) A waiting request's prefix lookup starts from the
blocks its session's previous call left here, and is kept while none of its blocks is
evicted (sim/pool_bulk.py): the answer is the full lookup's, for a fraction of the cost.

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.kv_events import BlockHash, KVEvent
from sim.block_pool import BlockPool
from sim.decode_runs import DecodeRun, DecodeRuns
from sim.engine_request import EngineRequest
from sim.host_tier import HostTier
from sim.offloading import OffloadingConnector
from sim.step_time import StepTimeModel


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


@dataclass(slots=True)
class _Lookup:
    """A waiting request's prefix lookup (at most ``limit`` blocks): its hit, current at pool
    ``version`` and standing while no hit block is evicted after ``mark``; and how many of the
    hit blocks were free when the pool's reference counts were at ``refs``."""

    request: EngineRequest
    limit: int
    version: int
    hit: list[int]
    hit_ids: np.ndarray
    mark: int
    free_hits: int = 0
    refs: int = -1


# vLLM's --scheduling-policy values (vllm/config/scheduler.py, 0.32).
SCHEDULING_POLICIES = ("fcfs", "priority")


class Engine(DecodeRuns):
    def __init__(self, name: str, model: StepTimeModel, *, num_blocks: int | None = None,
                 block_size: int | None = None, report_reuse: bool = False,
                 enable_events: bool = True, scheduling_policy: str = "priority",
                 coalesce_removals: bool = False) -> None:
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
                              attribute_removals=True, coalesce_removals=coalesce_removals)
        self.report_reuse = report_reuse
        self.max_num_seqs = model.max_num_seqs
        self.max_num_batched_tokens = model.max_num_batched_tokens
        self.waiting: list[tuple[float, int, EngineRequest]] = []
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()
        self.busy_until: float | None = None
        self._step: list[tuple[EngineRequest, int]] | None = None
        self._step_start = 0.0
        self._run: DecodeRun | None = None
        self._order = 0
        self._hit_memo: _Lookup | None = None  # _admission_cost's last lookup
        # session -> (hashes, blocks that held them, eviction mark) its last finished call left
        # here: its next prompt starts with that sequence, so its lookup starts from them
        self._left: dict[str, tuple[Sequence[BlockHash], np.ndarray, int]] = {}
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
            self._run = DecodeRun(list(self.running), now, run_steps, context)
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
            computed = request.num_computed
            context += computed + n
            if n > 1 or computed + n < request.prompt_tokens + request.num_output:  # seq_len
                prefill += n
                pairs += n * (computed + n / 2)
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
            sampled = 0
            for request, n in self._step:
                computed = request.num_computed + n
                request.num_computed = computed
                if computed >= request.prompt_tokens + request.num_output:
                    # _sample of one token, inlined (every request of every step comes here)
                    if request.first_token_at is None:
                        request.first_token_at = end
                    request.num_output += 1
                    sampled += 1
                    if request.num_output >= request.output_tokens:
                        done.append(request)
            self.stats.output_tokens += sampled
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

    def _finish(self, request: EngineRequest, now: float) -> None:
        request.finished_at = now
        self.running.remove(request)
        # its blocks as an array for the pool: those it was admitted with are one already
        blocks = request.block_ids
        head = request.block_head
        request.block_head = None
        if head is not None and head[0] is blocks:
            ids = head[1] if len(head[1]) == len(blocks) else np.concatenate(
                [head[1], np.asarray(blocks[len(head[1]):], dtype=np.intp)])
        else:
            ids = np.asarray(blocks, dtype=np.intp)
        self.pool.free_blocks(ids[::-1], request.session_id)
        session = request.session_id
        if session is not None and request.num_cached_blocks:
            left = self._left
            left.pop(session, None)
            left[session] = (request.hashes, ids[:request.num_cached_blocks], self.pool.eviction_mark())
            if len(left) > self.max_num_seqs:  # sessions whose next call went elsewhere, oldest first
                del left[next(iter(left))]
        request.block_ids = []
        if self.offloading is not None:
            self.offloading.request_finished(request.request_id)
        self.stats.finished += 1
        self.finished.append(request)

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
        # the waiting head is looked up at every step: keep its hit while its blocks stand
        pool = self.pool
        memo = self._hit_memo
        version = pool.version
        if memo is not None and memo.request is request and memo.limit == limit and (
                memo.version == version or pool.hit_holds(memo.hit_ids, memo.mark)):
            if memo.version != version:
                hit = memo.hit
                if len(hit) < limit and pool.is_cached(request.hashes[len(hit)]):
                    # cached further since: the hit runs on past its old end
                    more = pool.longest_hit(request.hashes[len(hit):limit])
                    memo.hit = hit + more
                    memo.hit_ids = np.concatenate([memo.hit_ids, np.asarray(more, dtype=np.intp)])
                    memo.refs = -1
                memo.version = version
        else:
            mark = pool.eviction_mark()
            left = self._left.get(request.session_id) if request.session_id is not None else None
            if left is not None:
                hit, hit_ids = pool.longest_hit_from(request.hashes, limit, *left)
            else:
                hit = pool.longest_hit(request.hashes, limit)
                hit_ids = np.asarray(hit, dtype=np.intp)
            memo = self._hit_memo = _Lookup(request, limit, version, hit, hit_ids, mark)
        hit, hit_ids = memo.hit, memo.hit_ids
        hit_tokens = len(hit) * bs
        n = min(seq_len - hit_tokens, budget)
        new_blocks = -(-(hit_tokens + n) // bs) - len(hit)
        # hit blocks nobody references sit in the free queue: taking them costs free blocks
        if memo.refs != pool.refs:
            memo.free_hits = pool.count_free(hit_ids)
            memo.refs = pool.refs
        free_hits = memo.free_hits
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
            n = request.prompt_tokens + request.num_output - computed
            if n > budget:
                n = budget
            need = -(-(computed + n) // bs) - len(request.block_ids)
            if need > 0:
                if need > pool.num_free:
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
                    if request not in self.running:
                        break  # the request itself was preempted: nothing more runs this step
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
            if request.session_id is not None:
                self._left.pop(request.session_id, None)  # its blocks are this request's now
            hit_tokens = len(hit) * bs
            pool.touch(hit_ids)
            if (self.report_reuse or request.report_reuse) and hit:
                tokens = request.token_ids
                pool.emit_cached_block_events(request.hashes, len(hit), session_id=request.session_id,
                                              continuation_id=request.continuation_id,
                                              token_ids=None if tokens is None else tokens[:hit_tokens])
            request.block_ids = hit + pool.get_new_blocks(new_blocks, now)
            request.block_head = (request.block_ids, hit_ids)
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
