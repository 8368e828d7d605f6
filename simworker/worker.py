"""The simworker: the engine model (sim/engine.py) behind vLLM's OpenAI API, in scaled real time.

``sluice simworker`` (entry/simworker_command.py) serves one of these. The gateway, ``make demo``
and the integration tests use it as a stand-in for a vLLM worker: token counts, timing and
prefix-cache behaviour are the model's, the text is filler (sim/tokens.py says what hits).

Time: virtual (model) time is ``(wall − start) / time_scale``; ``time_scale`` 0.1 runs ten
times faster than the modelled hardware. One engine task loops: start the next iteration
(or decode run), sleep until it ends on the wall clock, complete it, deliver the tokens.
Arrivals queue the call in the engine (cutting a decode run at its next step) and wake the
loop. Decode runs are capped (``max_run_steps``, ``max_run_wall_s``) so streamed tokens flow
in small chunks. When the loop falls behind the wall clock (a busy event loop) it starts the
next iteration where the last one ended, so throughput stays the model's (a call that
arrived meanwhile may join it that little early); a lag beyond ``max_lag_wall_s`` is
skipped instead of caught up, logged and counted in ``sluice_simworker:skipped_lag_seconds``.

Endpoints (vLLM 0.32 shapes; the API shapes are simworker/calls.py's ``CallShape``). Every
body is checked as vLLM 0.32 checks it, before anything runs (simworker/validation.py: the
same fields and types, lax coercions included; a body that does not fit is a 400 in OpenAI's
envelope, type "Bad Request", on every route), then as vLLM's handlers check it
(simworker/calls.py: sampling parameters, ``tools`` against ``tool_choice``, an unknown
``model`` (404), the model length), each refusal in the route's envelope and worded as vLLM
words it. Unknown fields are accepted. The worker stands for vLLM started with
``--enable-auto-tool-choice`` and a tool parser (``hermes``), so ``tools`` with
``tool_choice`` "auto" are served.
- ``POST /v1/chat/completions``, ``POST /v1/completions``: stream (SSE ``data: {...}`` chunks,
  the first one the assistant's role, then ``data: [DONE]``) or not. ``usage`` has
  ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
  ``prompt_tokens_details.cached_tokens`` (always: vLLM needs
  ``--enable-prompt-tokens-details`` for the last). ``stream_options.include_usage`` adds a
  final chunk with the usage and no choices; ``continuous_usage_stats`` puts usage on every
  chunk. Output length: ``max_completion_tokens`` / ``max_tokens`` (completions: 16 when
  unset, as vLLM), else ``default_max_tokens`` (``finish_reason`` "length" when the client
  set it, "stop" otherwise), cut to what the context leaves (vLLM's rule; "length"). A limit
  above ``max_model_len`` and a prompt longer than the context are refused as vLLM refuses
  them. The response's ``model`` echoes the request's, which must be the served one (or
  absent).
- ``POST /v1/messages`` (Anthropic Messages, stream or not: ``message_start`` …
  ``message_stop``), ``POST /v1/messages/count_tokens``, ``POST /v1/responses`` (OpenAI
  Responses, stream or not, ``previous_response_id`` continuing a stored answer's tokens):
  simworker/apis.py says how their requests become prompts and their output lengths.
  Every API drives the same engine, KV events and session labels.
- Sampling: with ``temperature`` > 0 (vLLM's default for these requests) and no ``seed`` the
  reply is drawn from the worker's random source (``sampling_seed``, fresh entropy when
  None), so identical prompts get different replies; with a ``seed`` or ``temperature`` 0 it
  is fixed by the prompt (and seed), as vLLM's seeded and greedy sampling are.
- Tool calls: with ``tool_call_turns`` K > 0, a request that offers tools (``tool_choice``
  not "none") and whose conversation holds fewer than K tool results is answered with one
  call of an offered tool (simworker/tool_calls.py), in each API's vLLM shape: chat
  ``message.tool_calls`` with ``finish_reason`` "tool_calls" ("stop" for a named
  ``tool_choice``) and, streamed, a delta with the call's id, type and name, then deltas of
  its arguments. A limit too short for the whole call gets a text reply instead.
- Priority: ``scheduling_policy`` is vLLM's ``--scheduling-policy``; under "priority" the
  body's integer ``priority`` (chat, completions, Responses; vLLM's Anthropic route has
  none) orders the engine's queue, lower first; under "fcfs" it is accepted and ignored, as
  vLLM 0.32 does.
- Session id (every API): body ``session_id``, else header ``X-Session-ID``, else
  ``vllm_xargs.session_id`` (vLLM's order); it labels the request's ``BlockStored`` events, as
  does ``vllm_xargs.continuation_id``. ``vllm_xargs.kv_cache_report_mode == "full"`` reports
  the request's prefix hits as a ``BlockStored`` from block 0. ``cache_salt`` is honoured.
- A client that disconnects (stream or not) has its call aborted: out of the engine, blocks
  freed (cached ones stay cached).
- ``GET /v1/models`` (with ``max_model_len``), ``GET /health`` (503 once the engine loop has
  failed), ``GET /metrics``. Other paths: vLLM's 404 ``{"detail": "Not Found"}`` (405 for a
  wrong method).
- KV events on ZMQ (simworker/kv_publisher.py), one batch per engine iteration that produced any,
  with what the Sluice engine plugin adds to vLLM's: ``continuation_id`` on stores, first
  admitter and prefix length on removals, and a per-start epoch frame.
- Retention directives (``directives`` endpoint, simworker/directive_socket.py): the KvHint envelopes
  the gateway sends to the plugin, applied to the engine's block pool.

The model length: ``max_model_len`` (vLLM's ``--max-model-len``) bounds ``max_tokens`` and
the prompt; left unset it is DEFAULT_MAX_MODEL_LEN or the KV pool, whichever is larger, so a
client that asks for a long reply limit (Claude Code: 32k) is served by a small demo pool. A
pool smaller than the model length is where the simworker departs from vLLM (which refuses
to start so): a prompt, or prompt plus reply, is held to the pool, and one that does not fit
is refused with vLLM's context-length message naming the pool's size.

Not modelled: ``n`` > 1 (refused), batched completion prompts (refused), stop sequences,
logprobs, structured outputs, multimodal input (refused, as a text-only model refuses it),
several tool calls in one reply, reasoning output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from random import Random
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scheduler.kv_events import BlockStored
from sim.engine import SCHEDULING_POLICIES, Engine
from sim.engine_request import EngineRequest
from sim.step_time import DEFAULT_PRESET
from sim.step_time import preset as load_preset
from sim.tokens import FILLER_WORDS, PromptError, PseudoTokenizer, block_hashes, prompt_seed, tool_calls_text
from simworker.apis import (
    EMPTY_CONVERSATION,
    MEDIA_PART_TYPES,
    AnthropicMessages,
    OpenAIResponses,
    count_tool_results,
)
from simworker.calls import (
    BadRequest,
    Call,
    CallFailed,
    CallParams,
    CallShape,
    Progress,
    PromptPlan,
    check_openai_preconditions,
    error_response,
    invalid_request_response,
    parse_params,
    refused,
)
from simworker.directive_socket import DirectiveSocket
from simworker.kv_publisher import KvEventPublisher
from simworker.tool_calls import AUTO, NO_TOOL_CHOICE, ToolCallReply, ToolChoice, ToolSpec, plan_tool_call, random_hex
from simworker.validation import InvalidRequest, check_media_type, parse_json, validate_body

class Prepared(NamedTuple):
    """A call ready for the engine: its prompt's length, the whole sequence (prompt then
    reply), the reply's text pieces, the sequence's full-block hashes, the finish reason and
    the reply's tool call (None for text)."""

    prompt_tokens: int
    tokens: array
    pieces: list[str]
    hashes: list[int]
    finish: str
    tool_call: ToolCallReply | None


# The model length a worker serves when none is set (or its pool, if larger): Llama 3.1's
# and Qwen3's (with YaRN) context, the models of sim/step_time.py's presets.
DEFAULT_MAX_MODEL_LEN = 131_072


@dataclass(frozen=True, slots=True)
class SimWorkerConfig:
    name: str = "w0"
    model: str = "sluice-sim"
    preset: str = DEFAULT_PRESET
    num_blocks: int | None = None          # None: the preset's KV pool
    block_size: int = 16
    kv_events: str | None = "tcp://*:5557"  # None: no KV events
    replay: str | None = None
    directives: str | None = None          # ZMQ PULL for retention directives; None: none
    topic: str | None = None               # None: "kv@<name>"
    time_scale: float = 1.0
    # Multiplies the preset's per-token prompt cost. A small demo pool holds contexts ~18×
    # shorter than a real agent's; scaling prefill keeps a re-prefill as costly, relative to
    # a turn, as it is for those on a GPU.
    prefill_scale: float = 1.0
    default_max_tokens: int = 256
    max_run_steps: int = 16
    max_run_wall_s: float = 0.05
    max_lag_wall_s: float = 0.25
    replay_buffer: int = 10_000
    # Responses API answers whose token sequences are kept for ``previous_response_id``
    # (oldest forgotten first).
    responses_kept: int = 1024
    # vLLM's --max-model-len; None: DEFAULT_MAX_MODEL_LEN or the pool, whichever is larger
    max_model_len: int | None = None
    # vLLM's --max-num-seqs; None: the preset's
    max_num_seqs: int | None = None
    # vLLM's --scheduling-policy ("fcfs", vLLM's default, or "priority")
    scheduling_policy: str = "fcfs"
    # Reply with a tool call while the conversation holds fewer tool results than this
    # (simworker/tool_calls.py); 0: every reply is text.
    tool_call_turns: int = 0
    # Seed of the worker's random source (replies sampled without a request seed); None:
    # fresh entropy, so two workers (or two runs) sample differently, as vLLM does.
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not self.prefill_scale > 0:
            raise ValueError(f"prefill_scale must be > 0, got {self.prefill_scale}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if self.default_max_tokens < 1 or self.max_run_steps < 1:
            raise ValueError("default_max_tokens and max_run_steps must be ≥ 1")
        if self.responses_kept < 0:
            raise ValueError(f"responses_kept must be ≥ 0, got {self.responses_kept}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be ≥ 1, got {self.max_model_len}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.tool_call_turns < 0:
            raise ValueError(f"tool_call_turns must be ≥ 0, got {self.tool_call_turns}")

    @property
    def kv_topic(self) -> str:
        return f"kv@{self.name}" if self.topic is None else self.topic


class _EngineCollector:
    """Metrics read from the engine at scrape time, under vLLM's names and labels."""

    def __init__(self, worker: SimWorker) -> None:
        self._worker = worker

    def collect(self):
        worker = self._worker
        engine = worker.engine
        config = worker.config
        labels = ["model_name", "engine"]
        values = [config.model, "0"]
        cache = {
            "block_size": str(engine.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.pool.num_blocks),
            "kv_cache_size_tokens": str(engine.capacity_tokens),
            "engine": "0",
        }
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(cache))
        info.add_metric(list(cache.values()), 1.0)
        yield info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        stats = engine.stats
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    engine.pool.usage)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    len(engine.waiting))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.output_tokens)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.prompt_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.cached_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.preemptions)
        yield counter("sluice_simworker:skipped_lag_seconds",
                      "Model seconds skipped because the engine loop fell behind the wall clock.",
                      worker.lag_dropped_s)
        yield counter("sluice_simworker:aborted_requests",
                      "Calls aborted because their client went away.", worker.aborted)
        if worker.directives is not None:
            yield counter("sluice_simworker:directives_applied",
                          "Retention directives applied to the block pool.", worker.directives.applied)
            yield counter("sluice_simworker:directives_dropped",
                          "Directive envelopes dropped as malformed.", worker.directives.dropped)


class SimWorker:
    """The engine, its clock, the calls in flight and the KV-event publisher."""

    def __init__(self, config: SimWorkerConfig) -> None:
        self.config = config
        model = load_preset(config.preset)
        if config.prefill_scale != 1.0:
            model = dataclasses.replace(model, prefill_token_s=model.prefill_token_s * config.prefill_scale)
        if config.max_num_seqs is not None:
            model = dataclasses.replace(model, max_num_seqs=config.max_num_seqs)
        self.engine = Engine(config.name, model, num_blocks=config.num_blocks,
                             block_size=config.block_size, scheduling_policy=config.scheduling_policy)
        self.max_model_len = (config.max_model_len if config.max_model_len is not None
                              else max(DEFAULT_MAX_MODEL_LEN, self.engine.capacity_tokens))
        # what a prompt and its reply must fit: the model length, or the pool if smaller
        self.context_tokens = min(self.max_model_len, self.engine.capacity_tokens)
        self.rng = Random(config.sampling_seed)
        self.tokenizer = PseudoTokenizer()
        self.publisher = (
            KvEventPublisher(config.kv_events, replay_endpoint=config.replay, topic=config.kv_topic,
                             buffer_steps=config.replay_buffer)
            if config.kv_events else None
        )
        self.directives = (
            DirectiveSocket(config.directives, self.engine, self.vnow) if config.directives else None
        )
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        self.aborted = 0
        self.lag_dropped_s = 0.0
        self._lag_logged_at = float("-inf")
        self.failed: str | None = None
        self._calls: dict[str, Call] = {}
        self._wake: anyio.Event | None = None
        self._t0 = time.monotonic()
        self._last_end: float | None = None
        self._log = structlog.get_logger("sluice.simworker").bind(worker=config.name)

    # -- clock -----------------------------------------------------------------------

    def vnow(self) -> float:
        return (time.monotonic() - self._t0) / self.config.time_scale

    def _wall(self, virtual: float) -> float:
        return self._t0 + virtual * self.config.time_scale

    # -- lifecycle -------------------------------------------------------------------

    @property
    def kv_endpoint(self) -> str | None:
        return self.publisher.bound_endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.bound_replay_endpoint if self.publisher else None

    def open(self) -> None:
        if self.publisher is not None:
            self.publisher.open()
        if self.directives is not None:
            try:
                self.directives.open()
            except Exception:
                self.close()
                raise
        self._t0 = time.monotonic()
        engine = self.engine
        self._log.info("simworker ready", model=self.config.model, preset=self.config.preset,
                       num_gpu_blocks=engine.pool.num_blocks, block_size=engine.block_size,
                       capacity_tokens=engine.capacity_tokens, time_scale=self.config.time_scale,
                       kv_events=self.kv_endpoint, replay=self.replay_endpoint,
                       directives=self.directives.bound_endpoint if self.directives else None,
                       topic=self.config.kv_topic)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.directives is not None:
            self.directives.close()

    async def serve_replay(self) -> None:
        if self.publisher is None:
            return
        try:
            await self.publisher.serve_replay()
        except Exception:
            # the worker keeps serving; consumers lose gap repair, so say so loudly
            self._log.exception("replay socket failed; replay is no longer served",
                                replay=self.replay_endpoint)

    async def serve_directives(self) -> None:
        if self.directives is None:
            return
        try:
            await self.directives.serve()
        except Exception:
            # the engine keeps serving, without the bias: directives are hints
            self._log.exception("directive socket failed; directives are no longer applied",
                                directives=self.directives.bound_endpoint)

    # -- engine loop -----------------------------------------------------------------

    async def run_engine(self) -> None:
        try:
            await self._engine_loop()
        except Exception as err:
            self.failed = f"engine loop failed: {type(err).__name__}: {err}"
            self._log.exception("engine loop failed; failing the calls in flight",
                                calls=len(self._calls), running=len(self.engine.running),
                                waiting=len(self.engine.waiting))
            for call in self._calls.values():
                call.error = self.failed
                call.changed.set()
            self._calls.clear()

    async def _engine_loop(self) -> None:
        engine = self.engine
        config = self.config
        max_run_s = config.max_run_wall_s / config.time_scale
        max_lag = config.max_lag_wall_s / config.time_scale
        while True:
            if engine.busy_until is None:
                now = self.vnow()
                last = self._last_end
                start_at = now
                if last is not None:
                    if now - last < max_lag:
                        start_at = last
                    else:
                        self._dropped_lag(now - last)
                until = engine.start(start_at, max_run_steps=config.max_run_steps, max_run_s=max_run_s)
                self._publish()
                if until is None:
                    self._last_end = None
                    await self._sleep(None)
                    continue
            delay = self._wall(engine.busy_until) - time.monotonic()
            if delay > 0:
                await self._sleep(delay)
                continue
            end = engine.busy_until
            done = engine.complete()
            engine.finished.clear()  # the offline simulator's record; a server must not keep it
            self._last_end = end
            self._publish()
            self._deliver(done)
            await anyio.lowlevel.checkpoint()

    def _dropped_lag(self, lag: float) -> None:
        """The loop fell behind the wall clock by more than ``max_lag_wall_s``: that much
        model time is skipped rather than caught up (the host is too slow for the scale)."""
        self.lag_dropped_s += lag
        wall = time.monotonic()
        if wall - self._lag_logged_at >= 10.0:
            self._lag_logged_at = wall
            self._log.warning("engine loop behind the wall clock; skipping the lag",
                              lag_model_s=round(lag, 4), time_scale=self.config.time_scale,
                              skipped_total_model_s=round(self.lag_dropped_s, 3))

    async def _sleep(self, delay: float | None) -> None:
        self._wake = wake = anyio.Event()
        with anyio.move_on_after(delay):
            await wake.wait()
        self._wake = None

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _publish(self) -> None:
        events = self.engine.pool.take_events()
        if events and self.publisher is not None:
            for event in events:
                # vLLM's KVCacheManager.take_events annotates stores with the group's spec
                if isinstance(event, BlockStored) and event.group_idx is not None:
                    event.kv_cache_spec_kind = "full_attention"
            self.publisher.publish(events)

    def _deliver(self, done: list[EngineRequest]) -> None:
        calls = self._calls
        for request in itertools.chain(self.engine.running, done):
            call = calls.get(request.request_id)
            if call is None:
                continue
            if request.num_output != call.seen or request.finished:
                call.seen = request.num_output
                call.changed.set()
            if request.finished:
                del calls[request.request_id]

    def submit(self, call: Call) -> None:
        if self.failed:
            raise BadRequest(self.failed, status=503)
        self.engine.add_request(call.request, self.vnow())
        self._calls[call.request.request_id] = call
        self._wake_loop()

    def abort(self, call: Call) -> None:
        if call.over:
            return
        self._calls.pop(call.request.request_id, None)
        removed = self.engine.abort(call.request.request_id)
        call.error = "aborted"
        if removed is not None:
            self.aborted += 1
            self._log.info("call aborted: client went away", request_id=call.request.request_id,
                           session_id=call.request.session_id, output_tokens=call.request.num_output)
        self._wake_loop()

    # -- requests --------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        """vLLM's 404 for a ``model`` it does not serve (an absent one is the served one)."""
        if model and model != self.config.model:
            raise BadRequest(f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                             "model", status=404)

    def _context_refusal(self, prompt_tokens: int, exact: bool) -> BadRequest:
        """vLLM's refusal of a prompt past the context. vLLM tokenizes text cut one token past
        the limit, so for a rendered prompt it can only say "at least" that many."""
        limit = self.context_tokens
        count = str(prompt_tokens) if exact else f"at least {limit + 1}"
        return refused(f"This model's maximum context length is {limit} tokens. However, your prompt "
                       f"contains {count} input tokens, which exceeds this limit even without any output "
                       f"tokens. Please reduce the length of the input prompt.", "input_tokens",
                       prompt_tokens if exact else limit + 1)

    def _prepare(self, plan: PromptPlan, params: CallParams, leading_space: bool, draw: int) -> Prepared:
        """The prompt, the reply and the sequence's block hashes (runs in a worker thread:
        long prompts take milliseconds). ``draw`` seeds the call's random source unless the
        reply must be reproducible, when the prompt and ``seed`` do. Raises BadRequest or
        PromptError."""
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise refused(f"{params.max_tokens_param}={params.max_tokens} cannot be greater than "
                          f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                          params.max_tokens_param, params.max_tokens)
        tokenizer = self.tokenizer
        prompt = plan.render(tokenizer)
        p = len(prompt)
        room = self.context_tokens - p
        if room < 0:
            raise self._context_refusal(p, exact=plan.token_ids)
        if room == 0:  # vLLM cuts the limit to what the context leaves: nothing
            raise refused("max_tokens must be at least 1, got 0.", "max_tokens", 0)
        rng = Random(prompt_seed(prompt, params.seed) if params.reproducible else draw)
        tool_call = plan_tool_call(plan.tools, plan.tool_choice, plan.tool_results,
                                   self.config.tool_call_turns, rng)
        default = self.config.default_max_tokens
        limit = params.max_tokens
        pieces: list[str] | None = None
        if tool_call is not None:
            pieces = tokenizer.pieces(tool_calls_text([tool_call.as_chat_tool_call()]))
            if len(pieces) > room or (limit is not None and len(pieces) > limit):
                tool_call, pieces = None, None  # cut short, the call would not parse: text instead
            else:
                finish = "stop" if tool_call.named or params.max_is_limit else "tool_calls"
        if pieces is None:
            if limit is None:
                n = min(default, room)
                finish = "stop" if n == default else "length"
            elif params.max_is_limit:
                n = min(limit, default, room)
                finish = "length" if n < default and (n == limit or n == room) else "stop"
            else:
                n = min(limit, room)
                finish = "length"
            start = rng.randrange(len(FILLER_WORDS))
            out_ids, pieces = tokenizer.filler(n, start, leading_space=leading_space)
        else:
            out_ids = [tokenizer.piece_id(piece) for piece in pieces]
        tokens = array("I", prompt)  # 4 bytes a token: running calls may hold long contexts
        tokens.extend(out_ids)
        hashes = block_hashes(tokens, self.engine.block_size, params.cache_salt)
        return Prepared(len(prompt), tokens, pieces, hashes, finish, tool_call)

    async def _read_body(self, request: Request, shape: CallShape) -> dict[str, Any]:
        """The body as vLLM reads it: JSON, what its models check before their fields, then
        the fields. Raises InvalidRequest or BadRequest."""
        check_media_type(request.headers.get("content-type"))
        body = parse_json(await request.body())
        check_openai_preconditions(shape.kind, body)
        return validate_body(shape.validation, body)

    async def _admit(self, request: Request, shape: CallShape
                     ) -> tuple[dict[str, Any], CallParams, PromptPlan]:
        """The checks vLLM makes before running a call, in its order: the body, the model,
        then what its handler checks. Raises InvalidRequest or BadRequest."""
        body = await self._read_body(request, shape)
        params = parse_params(shape.kind, body, request.headers)
        self._check_model(params.model)
        if self.failed:
            raise BadRequest(self.failed, status=503)
        return body, params, shape.plan(body)

    async def handle(self, request: Request, shape: CallShape) -> Response:
        try:
            body, params, plan = await self._admit(request, shape)
            echo = shape.echo(body)
            # A completion continues the prompt's text; the other APIs start a new message.
            prepared = await anyio.to_thread.run_sync(
                self._prepare, plan, params, shape.kind == "completion", self.rng.getrandbits(64))
        except InvalidRequest as err:
            return invalid_request_response(err)
        except PromptError as err:
            return shape.error(BadRequest(str(err), err.param))
        except BadRequest as err:
            return shape.error(err)
        response_id = shape.response_id()
        engine_request = EngineRequest(
            request_id=response_id, session_id=params.session_id, hashes=prepared.hashes,
            prompt_tokens=prepared.prompt_tokens, output_tokens=len(prepared.pieces), priority=params.priority,
            arrival=self.vnow(), continuation_id=params.continuation_id, token_ids=prepared.tokens,
            report_reuse=params.report_full,
        )
        call = Call(shape.kind, response_id, params.model or self.config.model, int(time.time()),
                    params, engine_request, prepared.pieces, prepared.finish, echo, tool_call=prepared.tool_call,
                    tool_results=plan.tool_results)
        try:
            self.submit(call)
        except BadRequest as err:
            return shape.error(err)
        except ValueError as err:  # the engine refuses what cannot fit the pool
            return shape.error(BadRequest(str(err)))
        if params.stream:
            return StreamingResponse(self._stream(call, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if not await self._wait_or_disconnect(request, call):
            return Response(status_code=499)
        if call.error is not None:
            return shape.error(BadRequest(call.error, status=500))
        return JSONResponse(shape.body(call))

    async def count_prompt(self, request: Request, shape: CallShape) -> Response:
        """The prompt's token count, rendered as a call of ``shape`` would render it, in the
        shape of vLLM's ``/v1/messages/count_tokens`` answer."""
        try:
            body = await self._read_body(request, shape)
            self._check_model(body.get("model"))
            plan = shape.plan(body)
            prompt = await anyio.to_thread.run_sync(plan.render, self.tokenizer)
        except InvalidRequest as err:
            return invalid_request_response(err)
        except PromptError as err:
            return shape.error(BadRequest(str(err), err.param))
        except BadRequest as err:
            return shape.error(err)
        return JSONResponse({"input_tokens": len(prompt),
                             "context_management": {"original_input_tokens": len(prompt)}})

    async def _until_over(self, call: Call) -> None:
        while not call.over:
            await call.changed.wait()
            call.changed = anyio.Event()

    async def _wait_or_disconnect(self, request: Request, call: Call) -> bool:
        disconnected = False

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal disconnected
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    scope.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                await self._until_over(call)
                tg.cancel_scope.cancel()
        finally:
            if not call.over:  # client gone, or the server is shutting down
                self.abort(call)
        return not disconnected

    @staticmethod
    async def _progress(call: Call) -> AsyncIterator[Progress]:
        """Each step of the reply as the engine produces it (the last may carry no text).
        Raises CallFailed."""
        sent = 0
        while True:
            await call.changed.wait()
            call.changed = anyio.Event()
            if call.error is not None:
                raise CallFailed(call.error)
            produced = min(call.request.num_output, len(call.pieces))
            finished = call.request.finished
            if produced > sent or finished:
                yield Progress("".join(call.pieces[sent:produced]), produced, finished)
                sent = produced
            if finished:
                return

    async def _stream(self, call: Call, shape: CallShape) -> AsyncIterator[bytes]:
        try:
            async for chunk in shape.events(call, self._progress(call)):
                yield chunk
        finally:
            if not call.over:  # the client went away (Starlette cancelled the stream)
                self.abort(call)

    # -- other endpoints -------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model, "object": "model", "created": int(time.time()),
            "owned_by": "sluice", "root": self.config.model, "parent": None,
            "max_model_len": self.max_model_len, "permission": [],
        }]})

    async def health(self, request: Request) -> Response:
        if self.failed:
            return error_response(503, self.failed)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _chat_tools(body: Mapping[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice]:
    """A checked chat request's function tools and its ``tool_choice`` (vLLM's default:
    "auto" with tools, "none" without)."""
    tools = body.get("tools") or []
    specs = tuple(ToolSpec(tool["function"]["name"], tool["function"].get("parameters")) for tool in tools)
    choice = body.get("tool_choice", "auto" if tools else "none")
    if not tools or choice in (None, "none"):
        return specs, NO_TOOL_CHOICE
    if choice == "required":
        return specs, ToolChoice("required")
    if isinstance(choice, dict):
        return specs, ToolChoice("named", choice["function"]["name"])
    return specs, AUTO


def _check_chat_parts(messages: list[dict[str, Any]], model: str) -> None:
    """What vLLM's chat parser refuses of content parts: media on a text-only model, and a
    part that is no content part (its message: "N validation errors for
    ValidatorIterator", pydantic's own)."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for number, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"1 validation error for ValidatorIterator\n{number}\n  Input should be a valid "
                                 f"dictionary (messages[{index}].content[{number}])")
            kind = part.get("type")
            if kind in MEDIA_PART_TYPES:
                raise BadRequest(f"{model} is not a multimodal model")
            if kind in ("text", "input_text", "output_text", "refusal", "thinking") or kind is None:
                if not isinstance(part.get("text", part.get("refusal", part.get("thinking"))), str):
                    raise BadRequest(f"1 validation error for ValidatorIterator\n{number}.text\n  Field required "
                                     f"(messages[{index}].content[{number}])")
            else:
                raise BadRequest(f"1 validation error for ValidatorIterator\n{number}.type\n  Input should be a "
                                 f"content part type, got {kind!r} (messages[{index}].content[{number}])")


class OpenAICompletions:
    """``/v1/chat/completions`` (``kind`` "chat") and ``/v1/completions`` ("completion"),
    in vLLM's shapes."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.validation = kind
        self.model = model
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    def response_id(self) -> str:
        return f"{self.id_prefix}{random_hex()}"

    def error(self, err: BadRequest) -> Response:
        return error_response(err.status, str(err), err.param, err.error_type)

    def plan(self, body: Mapping[str, Any]) -> PromptPlan:
        if self.kind == "completion":
            prompt = body.get("prompt")
            if prompt in (None, "", []):
                raise refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            token_ids = isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
            return PromptPlan(render=lambda tokenizer: tokenizer.render_completion(prompt), token_ids=token_ids)
        messages = body["messages"]
        if not messages:
            raise BadRequest(EMPTY_CONVERSATION)
        _check_chat_parts(messages, self.model)
        continue_final = body.get("continue_final_message") is True
        add_prompt = body.get("add_generation_prompt", True) is not False
        if continue_final and add_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, "
                             "and add_generation_prompt when you want to add a header that will prompt it to "
                             "start a new assistant message instead.")
        specs, choice = _chat_tools(body)
        tools = body.get("tools")
        return PromptPlan(
            render=lambda tokenizer: tokenizer.render_chat(messages, tools, add_generation_prompt=add_prompt,
                                                           continue_final_message=continue_final),
            tools=specs, tool_choice=choice, tool_results=count_tool_results(messages))

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    @staticmethod
    def usage(call: Call) -> dict[str, Any]:
        prompt, cached, output = call.usage_counts()
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + output,
            "completion_tokens": output,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def body(self, call: Call) -> dict[str, Any]:
        if call.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": call.text, "reasoning": None}
            if call.tool_call is not None:
                # vLLM: no text before the call is content null ("" for a forced call)
                message["content"] = "" if call.tool_call.named else None
                message["tool_calls"] = [call.tool_call.as_chat_tool_call()]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": call.finish_reason,
                      "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": call.text, "logprobs": None, "finish_reason": call.finish_reason,
                      "stop_reason": None}
            obj = "text_completion"
        return {"id": call.response_id, "object": obj, "created": call.created, "model": call.model,
                "choices": [choice], "usage": self.usage(call)}

    def _chunk(self, call: Call, choices: list[dict[str, Any]], usage: bool) -> bytes:
        body: dict[str, Any] = {
            "id": call.response_id,
            "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
            "created": call.created, "model": call.model, "choices": choices,
        }
        if usage:
            body["usage"] = self.usage(call)
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _choice(self, call: Call, delta_or_text: Any, finish: str | None) -> dict[str, Any]:
        if call.kind == "chat":
            return {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish}

    def _chat_deltas(self, call: Call, step: Progress, sent_arguments: int) -> tuple[list[dict[str, Any]], int]:
        """A step's chat deltas: the text, or the tool call's next arguments (its id, type
        and name go in the first delta, as vLLM's tool parsers stream them)."""
        tool = call.tool_call
        if tool is None:
            return [{"content": step.text}], sent_arguments
        deltas = []
        if sent_arguments < 0:
            deltas.append({"tool_calls": [{"index": 0, "id": tool.call_id, "type": "function",
                                           "function": {"name": tool.name}}]})
            sent_arguments = 0
        arguments = call.arguments_through(step.produced)
        if len(arguments) > sent_arguments:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": arguments[sent_arguments:]}}]})
            sent_arguments = len(arguments)
        return deltas, sent_arguments

    async def events(self, call: Call, progress: AsyncIterator[Progress]) -> AsyncIterator[bytes]:
        continuous = call.params.continuous_usage
        try:
            if call.kind == "chat":
                # vLLM opens every chat stream with the role, before the first token
                yield self._chunk(call, [self._choice(call, {"role": "assistant", "content": ""}, None)], continuous)
            sent_arguments = -1  # the tool call's arguments streamed so far; -1: not opened
            async for step in progress:
                finish = call.finish_reason if step.finished else None
                if call.kind != "chat":
                    yield self._chunk(call, [self._choice(call, step.text, finish)], continuous)
                    continue
                deltas, sent_arguments = self._chat_deltas(call, step, sent_arguments)
                if not deltas:
                    deltas = [{"content": ""}]
                for number, delta in enumerate(deltas):
                    last = number == len(deltas) - 1
                    yield self._chunk(call, [self._choice(call, delta, finish if last else None)], continuous)
            if call.params.include_usage:
                yield self._chunk(call, [], True)
        except CallFailed as err:
            error = {"error": {"message": str(err), "type": "InternalServerError", "code": 500}}
            yield b"data: " + msgspec.json.encode(error) + b"\n\n"
        yield b"data: [DONE]\n\n"


def create_app(config: SimWorkerConfig) -> Starlette:
    """Build the app; its sockets open and its engine task starts when the server starts."""
    worker = SimWorker(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.open()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.run_engine)
                tg.start_soon(worker.serve_replay)
                tg.start_soon(worker.serve_directives)
                yield
                tg.cancel_scope.cancel()
        finally:
            worker.close()

    def serving(shape: CallShape) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await worker.handle(request, shape)
        return endpoint

    counting = AnthropicMessages(config.model, counting=True)

    async def count_tokens(request: Request) -> Response:
        return await worker.count_prompt(request, counting)

    routes = [
        Route("/v1/chat/completions", serving(OpenAICompletions("chat", config.model)), methods=["POST"]),
        Route("/v1/completions", serving(OpenAICompletions("completion", config.model)), methods=["POST"]),
        Route("/v1/messages", serving(AnthropicMessages(config.model)), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", serving(OpenAIResponses(config.model, config.responses_kept)), methods=["POST"]),
        Route("/v1/models", worker.models, methods=["GET"]),
        Route("/health", worker.health, methods=["GET"]),
        Route("/metrics", worker.metrics, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        # a path or method no route takes: vLLM's app (FastAPI on Starlette) answers with
        # Starlette's own body, not its error envelope
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return JSONResponse({"detail": HTTPStatus(status).phrase}, status_code=status)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.worker = worker
    return app
