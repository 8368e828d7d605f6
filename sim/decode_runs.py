"""Decode runs (sim/engine.py): while every running request is decoding and nothing waiting
can be admitted, the next ``k`` iterations are identical but for growing contexts, so the
engine takes them as one run whose duration has a closed form. Here: how long a run can be,
cutting it at an arrival, and replaying its block allocations and cachings when it ends, in
the order single iterations would make them (no block is freed during a run, so each request
gets the same blocks, the same blocks are evicted in the same order and the KV events are the
same)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.block_pool import BlockPool
from sim.engine_request import EngineRequest
from sim.offloading import OffloadingConnector
from sim.step_time import StepTimeModel


@dataclass(slots=True)
class DecodeRun:
    """``steps`` pure-decode iterations of ``requests`` from ``start``, the first over
    ``context_tokens`` tokens of context."""

    requests: list[EngineRequest]
    start: float
    steps: int
    context_tokens: int


class DecodeRuns:
    """Mixed into :class:`~sim.engine.Engine` (whose ``__init__`` sets these)."""

    model: StepTimeModel
    pool: BlockPool
    block_size: int
    running: list[EngineRequest]
    waiting: list
    max_num_batched_tokens: int
    busy_until: float | None
    _run: DecodeRun | None
    offloading: OffloadingConnector | None
    stats: Any  # sim.engine.EngineStats (sim/engine.py imports this module, not the reverse)

    def _could_admit_head(self) -> bool:
        raise NotImplementedError  # Engine's

    def _truncate_run(self, now: float) -> None:
        run = self._run
        assert run is not None
        seqs = len(run.requests)
        steps = self.model.decode_steps_within(seqs, run.context_tokens, now - run.start)
        if steps < run.steps:
            run.steps = steps
            self.busy_until = run.start + self.model.decode_run_s(seqs, run.context_tokens, steps)

    def _decode_run_length(self) -> tuple[int, int]:
        """How many identical pure-decode iterations can run from here (0 if not a run), and
        the batch's context tokens in the first of them."""
        running = self.running
        if not running or (self.offloading is not None and self.offloading.loaded):
            return 0, 0
        last = running[-1]  # the request admitted last, the one most likely still in prefill
        if last.prompt_tokens + last.num_output - last.num_computed != 1:
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

    def _complete_run(self, run: DecodeRun, end: float) -> list[EngineRequest]:
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
        # One pass over the requests moves each past the run (nothing below reads how far
        # they are) and notes where it crosses block boundaries.
        seqs = len(requests)
        done: list[EngineRequest] = []
        points: list[tuple[int, int, int]] = []
        for i, request in enumerate(requests):
            c0 = request.num_computed
            request.num_computed = c0 + steps
            # the steps whose token starts a new block, and those whose token fills one (most
            # requests have neither in a run: no list is built for them)
            opens = (1 - c0) % bs or bs
            if opens <= steps:
                points += [(s, i, c0) for s in range(opens, steps + 1, bs)]
            fills = -c0 % bs or bs
            if bs > 1 and fills <= steps:
                points += [(s, i, c0) for s in range(fills, steps + 1, bs)]
            output = request.num_output
            if output == 0:
                # a prefill chunk ended one token short: the run's first step samples the
                # first token
                request.first_token_at = run.start + self.model.decode_run_s(seqs, run.context_tokens, 1)
            elif request.first_token_at is None:
                request.first_token_at = end
            output += steps
            request.num_output = output
            if output >= request.output_tokens:
                done.append(request)
        points.sort()  # by step, then running order: (step, request) pairs are distinct
        # decode_run_s(seqs, run.context_tokens, s) term by term, for the allocations' times
        model = self.model
        per_step = model.base_s + model.seq_s * seqs + model.context_token_s * run.context_tokens
        growth = model.context_token_s * seqs
        start = run.start
        for s, i, c0 in points:
            request = requests[i]
            computed = c0 + s
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
        self.stats.output_tokens += steps * seqs
        return done
