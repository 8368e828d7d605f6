"""What ``sluice calibrate`` does to a running worker: drive it with a designed set of requests,
turn what its streams show into steps of the engine model, and fit the step time.

The engine model (sim/step_time.py) prices one iteration as
``base_s + prefill_token_s·P + seq_s·S + context_token_s·C + prefill_attention_s·P·(C − P/2)``
(the last term: a prefill's new tokens each attending over the context before them). Three
kinds of request each isolate a kind of step, sent to an otherwise idle worker:

- *cold prefill*: a prompt of ``p`` tokens nobody sent before (a fresh nonce opens it, so no
  block of it is cached), ``max_tokens`` 1, alone. Its one step computes the whole prompt:
  ``P = p, S = 1, C = p``; the time to first token (TTFT) is that step.
- *cached prefill*: a prefix is sent first, then the prefix, a nonce and ``n`` new tokens. The
  worker reports how many prompt tokens it found cached (``h``), so the step is
  ``P = p − h, S = 1, C = p``: attention over the whole context, compute for the new part.
- *decode*: ``S`` prefixes of ``c`` tokens each are cached, then ``S`` streams (each its own
  prefix and a short tail, so their prefills are cheap) decode together. Each its own: agents'
  contexts are distinct, and one prefix shared by the batch is read once into a CPU's caches,
  which makes attention over it measure cheaper (on the tiny vLLM CPU model, 4 streams over
  1,536 tokens each: 9.3 ms a step over their own prefixes, 7.7 ms over a shared one). Besides
  the grid's contexts, one and two streams decode at the longest context each can hold. Once
  every stream has its first token and none has finished, each step is ``P = 0``, ``S``
  sequences, and a context growing by ``S`` tokens a step; the mean step over that window is
  the time between two token counts of a stream divided by the tokens between them
  (``continuous_usage_stats`` gives the exact count on every chunk, so tokens the worker sends
  in bursts count right).

A TTFT also holds the request's round trip (HTTP, tokenizing, detokenizing), which an
inter-token time does not. That is fitted as one more non-negative term, present only in the
TTFT samples, and removed from them before the step-time fit (``fit_with_round_trip``); the
decode steps pin ``base_s`` down, so the two are told apart. The cold prefills at several
lengths and the prefills behind a cached prefix tell ``prefill_token_s`` (linear in ``P``)
from ``prefill_attention_s`` (growing with ``P·C``).

Every point is measured in several passes over the whole grid and its shortest time kept
(``measure``): interference from other processes only ever adds time. Workers measured at once
(several ``--worker``) keep the median pass instead: there the aim is the step as each worker
makes it while the others work too, interference included.

Token counts come from the worker (``usage``), never from a tokenizer here: two probes
measure how many tokens a filler word takes, prompts are built to the grid's lengths from
that, and every sample uses the counts the worker reports for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from entry.calibration_worker import (
    CalibrationError,
    StreamResult,
    StreamsApart,
    Worker,
    WorkerInfo,
    read_worker_info,
)
from sim.calibration import (
    FitError,
    StepSample,
    StepTimeFit,
    fit_step_time,
    nonnegative_relative_fit,
)

Progress = Callable[[str], None]

# Common English words that every byte-level BPE splits predictably (most into one token);
# the exact count per word is measured, not assumed.
_FILLER = ["cache", "block", "token", "prompt", "prefix", "model", "request", "response", "worker", "batch", "sequence", "queue", "the", "a", "of", "to", "in", "and", "for", "with", "on", "at", "by", "from", "as", "is", "it", "this", "that", "which"]


@dataclass(frozen=True, slots=True)
class Grid:
    """The requests one calibration sends; lengths are fractions of the longest prompt the
    worker takes (capped at ``max_prompt_tokens``)."""

    name: str
    max_prompt_tokens: int
    cold_fractions: tuple[float, ...]
    # times each point is measured; the shortest time is kept (interference only adds)
    repeats: int
    # (prefix, new tokens) as fractions of the longest prompt
    cached: tuple[tuple[float, tuple[float, ...]], ...]
    decode_seqs: tuple[int, ...]
    decode_context_fractions: tuple[float, ...]
    decode_tokens: int


GRIDS = {
    "full": Grid("full", 4096, (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0), 3,
                 ((1 / 4, (1 / 32, 1 / 8)), (1 / 2, (1 / 32, 1 / 8))),
                 (1, 4, 16, 32), (1 / 8, 1 / 2), 48),
    "short": Grid("short", 1024, (1 / 16, 1 / 4, 1 / 2, 1.0), 9,
                  ((1 / 2, (1 / 16, 1 / 4)),),
                  (1, 4, 8, 16), (1 / 8, 1 / 2), 32),
}

# Tokens a decode stream adds after the shared prefix (its own nonce and a few words).
_TAIL_TOKENS = 16
# Share of the KV pool a decode batch may take: the rest absorbs tokenizer surprises.
_POOL_SHARE = 0.85
# Steps a decode window needs at the least for its mean to mean something.
_MIN_WINDOW_STEPS = 8


@dataclass(frozen=True, slots=True)
class Measured:
    """A step as measured; ``round_trip`` when the time is a TTFT (holds the request's
    round trip) rather than a time between tokens."""

    sample: StepSample
    round_trip: bool


class Prompts:
    """Prompts of a wanted length in tokens, none sharing a cached block with another unless
    built on the same prefix."""

    def __init__(self) -> None:
        self._run = secrets.token_hex(4)
        self._count = itertools.count()
        self.intercept = 0.0
        self.tokens_per_word = 1.0

    def nonce(self) -> str:
        # first in the prompt: the first block differs from every other prompt's
        return f"calibration {self._run} prompt {next(self._count)}:"

    @staticmethod
    def words(count: int, offset: int = 0) -> str:
        return " ".join(_FILLER[(offset + i) % len(_FILLER)] for i in range(max(0, count)))

    def words_for(self, tokens: float) -> int:
        return max(1, round(tokens / self.tokens_per_word))

    def fresh(self, tokens: int) -> str:
        return f"{self.nonce()} {self.words(self.words_for(tokens - self.intercept))}"

    def extend(self, prefix: str, tokens: int) -> str:
        return f"{prefix} {self.words(self.words_for(tokens), offset=7)}"

    async def probe(self, worker: Worker, progress: Progress) -> None:
        """Two prompts of different lengths: tokens per filler word and the nonce's share."""
        short, long = 32, 256
        first = await worker.complete(f"{self.nonce()} {self.words(short)}", 1, "probe")
        second = await worker.complete(f"{self.nonce()} {self.words(long)}", 1, "probe")
        assert first.prompt_tokens is not None and second.prompt_tokens is not None
        slope = (second.prompt_tokens - first.prompt_tokens) / (long - short)
        if not slope > 0:
            raise CalibrationError(f"a prompt of {long} words counted {second.prompt_tokens} tokens, one of "
                                   f"{short} words {first.prompt_tokens}: the worker's token counts are nonsense")
        self.tokens_per_word = slope
        self.intercept = first.prompt_tokens - slope * short
        progress(f"probe: {slope:.2f} tokens per filler word, {self.intercept:.0f} tokens of nonce and template")


@dataclass(frozen=True, slots=True)
class Plan:
    """The grid made concrete for one worker."""

    longest: int
    cold: list[int]
    cached: list[tuple[int, list[int]]]
    decode: list[tuple[int, int]]  # (streams, prefix tokens)
    skipped: list[str]
    repeats: int

    @property
    def requests(self) -> int:
        return self.repeats * (len(self.cold) + sum(1 + len(new) for _, new in self.cached)
                               + sum(2 * seqs for seqs, _ in self.decode))


def plan(grid: Grid, info: WorkerInfo, max_num_seqs: int, max_num_batched_tokens: int) -> Plan:
    """Lengths that fit the worker: a prompt and its reply within max_model_len, a prefill in
    one step (within the batched-token budget, so no chunking), a decode batch in the pool."""
    limits = [grid.max_prompt_tokens, max_num_batched_tokens, info.kv_capacity_tokens // 2]
    if info.max_model_len is not None:
        limits.append(info.max_model_len - grid.decode_tokens - 2 * _TAIL_TOKENS)
    longest = min(limits)
    if longest < 64:
        raise CalibrationError(f"the worker takes prompts of at most {longest} tokens here; calibration "
                               "needs at least 64")
    cold = [max(16, round(longest * f)) for f in grid.cold_fractions]
    cached = [(round(longest * prefix), [max(8, round(longest * n)) for n in new
                                         if (prefix + n) * longest <= longest])
              for prefix, new in grid.cached]
    decode: list[tuple[int, int]] = []
    skipped: list[str] = []
    bs = info.block_size
    pool_blocks = int((info.num_gpu_blocks - 1) * _POOL_SHARE)
    for fraction in grid.decode_context_fractions:
        context = max(16, round(longest * fraction))
        for seqs in grid.decode_seqs:
            per_stream = math.ceil((2 * _TAIL_TOKENS + grid.decode_tokens) / bs) + 1
            blocks = seqs * (math.ceil(context / bs) + per_stream)
            if seqs > max_num_seqs or blocks > pool_blocks:
                skipped.append(f"decode {seqs} × {context} tokens (needs {blocks} KV blocks of "
                               f"{pool_blocks} usable, or more than {max_num_seqs} sequences)")
                continue
            decode.append((seqs, context))
    # Agents decode behind contexts longer than any one prompt of the grid: one and two
    # streams at the longest context each can hold (twice the grid's longest prompt at most),
    # so context_token_s is measured where it matters, not extrapolated to it.
    per_stream = math.ceil((2 * _TAIL_TOKENS + grid.decode_tokens) / bs) + 1
    reach = 2 * longest
    if info.max_model_len is not None:
        reach = min(reach, info.max_model_len - grid.decode_tokens - 2 * _TAIL_TOKENS)
    longest_decoded = max((c for _, c in decode), default=0)
    for seqs in (1, 2):
        context = min(reach, (pool_blocks // seqs - per_stream) * bs)
        if context > longest_decoded and seqs <= max_num_seqs:
            decode.append((seqs, context))
    if not decode:
        raise CalibrationError("no decode batch fits the worker's KV pool: " + "; ".join(skipped))
    return Plan(longest, cold, [(p, n) for p, n in cached if n], decode, skipped, grid.repeats)


async def measure(worker: Worker, the_plan: Plan, grid: Grid, time_scale: float,
                  progress: Progress, typical: bool = False) -> list[Measured]:
    """Send the plan's requests in ``repeats`` passes over the whole grid and keep, for each
    point, its shortest time. Passes rather than back-to-back tries: a worker slowed for a
    while (on a small CPU host the engine's busy-polling processes share cores with the API
    server and this client) then slows one try of many points, not every try of one."""
    prompts = Prompts()
    await prompts.probe(worker, progress)
    done = itertools.count(1)
    total = the_plan.requests
    repeats = the_plan.repeats
    tries: dict[tuple[int, ...], list[Measured]] = {}
    lost: list[str] = []  # decode tries whose streams did not run together
    # each prefix's text is the same in every pass, so it is cached once sent
    cached_prefixes = {tokens: prompts.fresh(tokens) for tokens, _ in the_plan.cached}
    decode_prefixes = {(seqs, context): [prompts.fresh(context) for _ in range(seqs)]
                       for seqs, context in the_plan.decode}

    def keep(key: tuple[int, ...], sample: Measured, what: str, requests: int = 1) -> None:
        tries.setdefault(key, []).append(sample)
        for _ in range(requests - 1):
            next(done)
        progress(f"[{next(done)}/{total}] pass {attempt + 1}/{repeats}: {what}: {sample.sample.seconds * 1e3:.2f} ms")

    for attempt in range(repeats):
        for index, length in enumerate(the_plan.cold):
            sample = await _cold(worker, prompts.fresh(length), time_scale, "cold prefill")
            keep((0, index), sample, f"cold prefill of {sample.sample.prefill_tokens} tokens")

        for prefix_tokens, news in the_plan.cached:
            prefix = cached_prefixes[prefix_tokens]
            # sent again in every pass: a small pool may have evicted it since; not a sample
            await worker.complete(prefix, 1, f"cached prefill (its prefix of {prefix_tokens} tokens)")
            next(done)
            for new in news:
                what = f"cached prefill ({prefix_tokens} + {new} tokens)"
                # a nonce after the prefix: each try's new tokens are new, only the prefix is cached
                sample = await _cached(worker, prompts.extend(f"{prefix} {prompts.nonce()}", new), time_scale, what)
                cached = sample.sample.context_tokens - sample.sample.prefill_tokens
                keep((1, prefix_tokens, new), sample,
                     f"prefill of {sample.sample.prefill_tokens} tokens behind {cached} cached")

        for seqs, context in the_plan.decode:
            prefixes = decode_prefixes[(seqs, context)]
            # sent again in every pass (a small pool may have evicted them since); not samples
            await asyncio.gather(*(worker.complete(prefix, 1, f"decode batch (a prefix of {context} tokens)")
                                   for prefix in prefixes))
            for _ in prefixes:
                next(done)
            what = f"decode batch of {seqs} over {context} tokens each"
            tails = [prompts.extend(f"{prefix} {prompts.nonce()}", _TAIL_TOKENS // 2) for prefix in prefixes]
            results = await asyncio.gather(*(worker.complete(tail, grid.decode_tokens, what) for tail in tails))
            try:
                sample = _decode_sample(results, time_scale, what)
            except StreamsApart as apart:
                lost.append(str(apart))
                for _ in range(seqs):
                    next(done)
                progress(f"pass {attempt + 1}/{repeats}: {apart} (left to the other passes)")
                continue
            keep((2, seqs, context), sample, f"{what}: mean step over {sample.sample.context_tokens} context tokens",
                 seqs)
    missing = [f"decode batch of {seqs} over {context} tokens" for seqs, context in the_plan.decode
               if (2, seqs, context) not in tries]
    if missing:
        raise CalibrationError(f"no pass could time {', '.join(missing)}: {lost[-1]}")
    if typical:  # the median try (the lower of the two middle ones)
        return [sorted(samples, key=lambda m: m.sample.seconds)[(len(samples) - 1) // 2]
                for samples in tries.values()]
    return [min(samples, key=lambda m: m.sample.seconds) for samples in tries.values()]


async def _cached(worker: Worker, prompt: str, time_scale: float, what: str) -> Measured:
    result = await worker.complete(prompt, 1, what)
    if not result.cached_tokens:
        raise CalibrationError(f"{what}: the worker reports no cached prompt tokens after the prefix "
                               "was sent (prefix caching off, or usage without prompt_tokens_details: "
                               "vLLM needs --enable-prefix-caching and --enable-prompt-tokens-details)")
    return _ttft_sample(result, time_scale, what, "cached prefill")


async def _cold(worker: Worker, prompt: str, time_scale: float, what: str) -> Measured:
    result = await worker.complete(prompt, 1, what)
    if result.cached_tokens:
        raise CalibrationError(f"{what}: a prompt opened by a fresh nonce hit the prefix cache "
                               f"({result.cached_tokens} of {result.prompt_tokens} tokens): the worker's "
                               "cache reports cannot be trusted")
    return _ttft_sample(result, time_scale, what, "cold prefill")


def _ttft_sample(result: StreamResult, time_scale: float, what: str, kind: str) -> Measured:
    assert result.first_token_at is not None and result.prompt_tokens is not None
    seconds = (result.first_token_at - result.sent_at) / time_scale
    if not seconds > 0:
        raise CalibrationError(f"{what}: the first token came {seconds} s after the request")
    cached = result.cached_tokens or 0
    if not 0 <= cached < result.prompt_tokens:
        raise CalibrationError(f"{what}: {cached} of {result.prompt_tokens} prompt tokens reported cached")
    return Measured(StepSample(result.prompt_tokens - cached, 1, result.prompt_tokens, seconds, kind),
                    round_trip=True)


def _decode_sample(results: Sequence[StreamResult], time_scale: float, what: str) -> Measured:
    """The mean decode step while every stream decodes: from the last stream's first token
    to the first stream's last."""
    start = max(r.first_token_at for r in results if r.first_token_at is not None)
    end = min(r.points[-1][0] for r in results)
    steps: list[float] = []
    context = 0.0
    for result in results:
        inside = [(t, n) for t, n in result.points if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < _MIN_WINDOW_STEPS:
            raise StreamsApart(f"{what}: the streams decoded together for fewer than {_MIN_WINDOW_STEPS} "
                                   "steps (did the worker serve them one after another?)")
        (t1, n1), (t2, n2) = inside[0], inside[-1]
        if not t2 > t1:
            raise CalibrationError(f"{what}: {n2 - n1} tokens arrived in no time")
        steps.append((t2 - t1) / (n2 - n1))
        assert result.prompt_tokens is not None
        # the step that produces token n+1 attends over the prompt and the n tokens before it
        context += result.prompt_tokens + (n1 + n2 - 1) / 2
    seconds = float(np.mean(steps)) / time_scale
    return Measured(StepSample(0, len(results), round(context), seconds, "decode"), round_trip=False)


@dataclass(frozen=True, slots=True)
class Calibration:
    info: WorkerInfo  # the first worker's (all of them serve the same model and pool)
    plan: Plan
    measured: list[Measured]
    fit: StepTimeFit
    round_trip_s: float
    samples: list[StepSample]  # the steps fitted (TTFTs less the round trip)
    # every worker measured, and how many of ``samples`` (in order) each gave
    workers: tuple[WorkerInfo, ...] = ()
    samples_per_worker: tuple[int, ...] = ()

    def worker_samples(self) -> list[tuple[WorkerInfo, list[StepSample]]]:
        """Each worker with the fitted steps it gave."""
        out, start = [], 0
        for info, count in zip(self.workers, self.samples_per_worker):
            out.append((info, self.samples[start:start + count]))
            start += count
        return out


def fit_with_round_trip(measured: Sequence[Measured]) -> tuple[StepTimeFit, float, list[StepSample]]:
    """Fit the request round trip (a non-negative term beside the step time's, on TTFT samples
    only) with the step time, remove it from the TTFTs, and fit the step time to the steps that
    remain."""
    if not any(m.round_trip for m in measured) or all(m.round_trip for m in measured):
        raise FitError("the round trip needs both TTFT and inter-token samples")
    x = np.array([(*m.sample.features(), 1.0 if m.round_trip else 0.0) for m in measured])
    y = np.array([m.sample.seconds for m in measured])
    round_trip = float(nonnegative_relative_fit(x, y)[-1])
    shortest = min(m.sample.seconds for m in measured if m.round_trip)
    if round_trip >= shortest:
        raise FitError(f"the fitted round trip ({round_trip * 1e3:.2f} ms) is not shorter than the "
                       f"shortest TTFT ({shortest * 1e3:.2f} ms)")
    steps = [StepSample(m.sample.prefill_tokens, m.sample.seqs, m.sample.context_tokens,
                        m.sample.seconds - (round_trip if m.round_trip else 0.0), m.sample.kind)
             for m in measured]
    return fit_step_time(steps), round_trip, steps


async def calibrate(urls: str | Sequence[str], *, model: str | None, grid: Grid, time_scale: float,
                    timeout_s: float, max_num_seqs: int, max_num_batched_tokens: int,
                    progress: Progress) -> Calibration:
    """Everything but writing: read the workers, measure the plan on all of them at once, fit
    one model to every step.

    Several workers are driven together, as they run in service: where they share a host (CPU
    workers, or GPUs behind one CPU) each one's steps then carry the others' interference,
    which an idle worker's would not. They must serve the same model with the same KV pool,
    or one preset could not stand for them."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise CalibrationError("no worker to calibrate")
    urls = [url.rstrip("/") for url in urls]
    if len(set(urls)) != len(urls):
        raise CalibrationError(f"a worker is named twice: {', '.join(urls)}")
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False,
                                 limits=httpx.Limits(max_connections=256 * len(urls))) as client:
        infos = [await read_worker_info(client, url, model) for url in urls]
        for info in infos:
            progress(f"worker: {info.describe()}")
        _check_alike(infos)
        lengths = [info.max_model_len for info in infos if info.max_model_len]
        first = dataclasses.replace(infos[0], max_model_len=min(lengths) if lengths else None)
        the_plan = plan(grid, first, max_num_seqs, max_num_batched_tokens)
        for note in the_plan.skipped:
            progress(f"skipped: {note}")
        together = f" on {len(infos)} workers at once" if len(infos) > 1 else ""
        progress(f"grid {grid.name}: prompts up to {the_plan.longest} tokens, {the_plan.requests} requests"
                 f"{together} (time scale {time_scale:g})")
        per_worker: list[list[Measured]] = [[] for _ in infos]

        async def measure_one(i: int) -> None:
            def tagged(line: str) -> None:
                progress(f"{infos[i].url}: {line}" if len(infos) > 1 else line)
            per_worker[i] = await measure(Worker(client, infos[i]), the_plan, grid, time_scale, tagged,
                                          typical=len(infos) > 1)

        # a task group: the first worker that fails stops the others, and its error is the one
        # the command reports
        try:
            async with asyncio.TaskGroup() as group:
                for i in range(len(infos)):
                    group.create_task(measure_one(i))
        except* CalibrationError as failed:
            raise failed.exceptions[0] from None
    measured = [m for samples in per_worker for m in samples]
    try:
        fit, round_trip, steps = fit_with_round_trip(measured)
    except FitError as err:
        raise CalibrationError(f"the measurements cannot be fitted: {err}") from None
    return Calibration(infos[0], the_plan, measured, fit, round_trip, steps, tuple(infos),
                       tuple(len(samples) for samples in per_worker))


def _check_alike(infos: Sequence[WorkerInfo]) -> None:
    first = infos[0]
    for info in infos[1:]:
        for what, mine, theirs in (("model", info.model, first.model),
                                   ("KV blocks", info.num_gpu_blocks, first.num_gpu_blocks),
                                   ("block size", info.block_size, first.block_size)):
            if mine != theirs:
                raise CalibrationError(f"{info.url} has {what} {mine}, {first.url} {theirs}: one preset "
                                       "stands for workers alike; calibrate them apart")
