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

Endpoints (vLLM 0.32 shapes; the API shapes are simworker/calls.py's ``CallShape``):
- ``POST /v1/chat/completions``, ``POST /v1/completions``: stream (SSE ``data: {...}`` chunks,
  then ``data: [DONE]``) or not. ``usage`` has ``prompt_tokens``, ``completion_tokens``,
  ``total_tokens`` and ``prompt_tokens_details.cached_tokens`` (always: vLLM needs
  ``--enable-prompt-tokens-details`` for the last). ``stream_options.include_usage`` adds a
  final chunk with the usage and no choices; ``continuous_usage_stats`` puts usage on every
  chunk. Output length: ``max_completion_tokens`` / ``max_tokens``, else
  ``default_max_tokens`` (``finish_reason`` "length" when the client set it, "stop"
  otherwise); prompt + output must fit the pool (the model length here), else 400. The
  response's ``model`` echoes the request's (any name is served).
- ``POST /v1/messages`` (Anthropic Messages, stream or not: ``message_start`` …
  ``message_stop``), ``POST /v1/messages/count_tokens``, ``POST /v1/responses`` (OpenAI
  Responses, stream or not, ``previous_response_id`` continuing a stored answer's tokens):
  simworker/apis.py says how their requests become prompts and their output lengths.
  Every API drives the same engine, KV events and session labels; errors come in each
  API's own shape.
- Session id (every API): body ``session_id``, else header ``X-Session-ID``, else
  ``vllm_xargs.session_id`` (vLLM's order); it labels the request's ``BlockStored`` events, as
  does ``vllm_xargs.continuation_id``. ``vllm_xargs.kv_cache_report_mode == "full"`` reports
  the request's prefix hits as a ``BlockStored`` from block 0. ``cache_salt`` is honoured.
- A client that disconnects (stream or not) has its call aborted: out of the engine, blocks
  freed (cached ones stay cached).
- ``GET /v1/models``, ``GET /health`` (503 once the engine loop has failed), ``GET /metrics``.
- KV events on ZMQ (simworker/kv_publisher.py), one batch per engine iteration that produced any,
  with what the Sluice engine plugin adds to vLLM's: ``continuation_id`` on stores, first
  admitter and prefix length on removals, and a per-start epoch frame.
- Retention directives (``directives`` endpoint, simworker/directive_socket.py): the KvHint envelopes
  the gateway sends to the plugin, applied to the engine's block pool.

Not modelled: ``n`` > 1, batched completion prompts, stop sequences, logprobs, tool-call
output (the reply is always text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from array import array
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scheduler.kv_events import BlockStored
from simworker.directive_socket import DirectiveSocket
from sim.engine import Engine, EngineRequest
from simworker.kv_publisher import KvEventPublisher
from simworker.apis import AnthropicMessages, OpenAIResponses
from simworker.calls import (
    BadRequest,
    Call,
    CallFailed,
    CallParams,
    CallShape,
    error_response,
    parse_params,
)
from sim.step_time import DEFAULT_PRESET
from sim.step_time import preset as load_preset
from sim.tokens import PromptError, PseudoTokenizer, block_hashes, filler_start


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
        self.engine = Engine(config.name, model, num_blocks=config.num_blocks,
                             block_size=config.block_size)
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

    def _prepare(self, render: Callable[[PseudoTokenizer], list[int]], params: CallParams,
                 prompt_param: str, leading_space: bool
                 ) -> tuple[list[int], array, list[str], list[int], str]:
        """Tokens, filler and hashes (runs in a worker thread: long prompts take milliseconds)."""
        tokenizer = self.tokenizer
        prompt = render(tokenizer)
        capacity = self.engine.capacity_tokens
        default = self.config.default_max_tokens
        p = len(prompt)
        if params.max_tokens is None:
            if p >= capacity:
                raise BadRequest(f"This model's maximum context length is {capacity} tokens. However, "
                                 f"your request has {p} input tokens.", prompt_param)
            n = min(default, capacity - p)
            finish = "stop" if n == default else "length"
        else:
            n = min(params.max_tokens, default) if params.max_is_limit else params.max_tokens
            if p + n > capacity:
                raise BadRequest(f"This model's maximum context length is {capacity} tokens. However, "
                                 f"you requested {p + n} tokens ({p} in the input, {n} in the "
                                 f"completion).", "max_tokens")
            finish = "length" if n == params.max_tokens else "stop"
        out_ids, pieces = tokenizer.filler(n, filler_start(prompt, params.seed),
                                           leading_space=leading_space)
        tokens = array("I", prompt)  # 4 bytes a token: running calls may hold long contexts
        tokens.extend(out_ids)
        hashes = block_hashes(tokens, self.engine.block_size, params.cache_salt)
        return prompt, tokens, pieces, hashes, finish

    async def _read_body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as err:
            raise BadRequest(f"the body is not valid JSON: {err}") from None
        except RecursionError:
            raise BadRequest("the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def handle(self, request: Request, shape: CallShape) -> Response:
        try:
            body = await self._read_body(request)
            params = parse_params(shape.kind, body, request.headers)
            if self.failed:
                raise BadRequest(self.failed, status=503)
            render = shape.renderer(body)
            echo = shape.echo(body)
            # A completion continues the prompt's text; the other APIs start a new message.
            prompt, tokens, pieces, hashes, finish = await anyio.to_thread.run_sync(
                self._prepare, render, params, shape.prompt_param, shape.kind == "completion")
        except PromptError as err:
            return shape.error(400, str(err), err.param)
        except BadRequest as err:
            return shape.error(err.status, str(err), err.param)
        response_id = f"{shape.id_prefix}{uuid.uuid4().hex}"
        engine_request = EngineRequest(
            request_id=response_id, session_id=params.session_id, hashes=hashes,
            prompt_tokens=len(prompt), output_tokens=len(pieces), priority=0.0,
            arrival=self.vnow(), continuation_id=params.continuation_id, token_ids=tokens,
            report_reuse=params.report_full,
        )
        call = Call(shape.kind, response_id, params.model or self.config.model, int(time.time()),
                    params, engine_request, pieces, finish, echo)
        try:
            self.submit(call)
        except BadRequest as err:
            return shape.error(err.status, str(err), err.param)
        except ValueError as err:  # the engine refuses what cannot fit the pool
            return shape.error(400, str(err))
        if params.stream:
            return StreamingResponse(self._stream(call, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if not await self._wait_or_disconnect(request, call):
            return Response(status_code=499)
        if call.error is not None:
            return shape.error(500, call.error)
        return JSONResponse(shape.body(call))

    async def count_prompt(self, request: Request, shape: CallShape) -> Response:
        """The prompt's token count, rendered as a call of ``shape`` would render it."""
        try:
            body = await self._read_body(request)
            render = shape.renderer(body)
            prompt = await anyio.to_thread.run_sync(render, self.tokenizer)
        except PromptError as err:
            return shape.error(400, str(err), err.param)
        except BadRequest as err:
            return shape.error(err.status, str(err), err.param)
        return JSONResponse({"input_tokens": len(prompt)})

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
    async def _progress(call: Call) -> AsyncIterator[tuple[str, bool]]:
        """The reply's new text each time the engine produces some, and whether the call
        has finished (the last item may carry no text). Raises CallFailed."""
        sent = 0
        while True:
            await call.changed.wait()
            call.changed = anyio.Event()
            if call.error is not None:
                raise CallFailed(call.error)
            produced = min(call.request.num_output, len(call.pieces))
            finished = call.request.finished
            if produced > sent or finished:
                yield "".join(call.pieces[sent:produced]), finished
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
            "max_model_len": self.engine.capacity_tokens, "permission": [],
        }]})

    async def health(self, request: Request) -> Response:
        if self.failed:
            return error_response(503, self.failed)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class OpenAICompletions:
    """``/v1/chat/completions`` (``kind`` "chat") and ``/v1/completions`` ("completion"),
    in vLLM's shapes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.prompt_param = "messages" if kind == "chat" else "prompt"

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        return error_response(status, message, param)

    def renderer(self, body: Mapping[str, Any]) -> Callable[[PseudoTokenizer], list[int]]:
        if self.kind == "chat":
            continue_final = body.get("continue_final_message") is True
            add_prompt = body.get("add_generation_prompt", True) is not False
            return lambda tokenizer: tokenizer.render_chat(
                body.get("messages"), body.get("tools"), add_generation_prompt=add_prompt,
                continue_final_message=continue_final)
        return lambda tokenizer: tokenizer.render_completion(body.get("prompt"))

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
        text = call.text
        if call.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": call.finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": call.finish_reason,
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

    def _choice(self, call: Call, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        if call.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    async def events(self, call: Call, progress: AsyncIterator[tuple[str, bool]]) -> AsyncIterator[bytes]:
        continuous = call.params.continuous_usage
        first = True
        try:
            async for text, finished in progress:
                yield self._chunk(call, [self._choice(call, text, call.finish_reason if finished else None,
                                                      first=first)], continuous)
                first = False
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

    messages = AnthropicMessages()

    async def count_tokens(request: Request) -> Response:
        return await worker.count_prompt(request, messages)

    routes = [
        Route("/v1/chat/completions", serving(OpenAICompletions("chat")), methods=["POST"]),
        Route("/v1/completions", serving(OpenAICompletions("completion")), methods=["POST"]),
        Route("/v1/messages", serving(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", serving(OpenAIResponses(config.responses_kept)), methods=["POST"]),
        Route("/v1/models", worker.models, methods=["GET"]),
        Route("/health", worker.health, methods=["GET"]),
        Route("/metrics", worker.metrics, methods=["GET"]),
    ]
    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}")

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
    app.state.worker = worker
    return app
