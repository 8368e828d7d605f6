"""The simworker: the engine model (sim/engine.py) behind vLLM's OpenAI API, in scaled real time.

``sluice simworker`` (entry/simworker_command.py) serves one of these. The gateway, ``make demo``
and the integration tests use it as a stand-in for a vLLM worker: token counts, timing and
prefix-cache behaviour are the model's, the text is filler (sim/tokens.py says what hits).

This module is the HTTP side (the app, the checks, preparing a call, waiting and streaming);
the engine runs in scaled real time in simworker/engine_driver.py (``time_scale`` 0.1 runs ten
times faster than the modelled hardware), its settings are simworker/config.py's and its
``/metrics`` simworker/metrics.py's (a lag the loop skips is counted in
``sluice_simworker:skipped_lag_seconds``).

Endpoints (vLLM 0.32 shapes; the API shapes are simworker/calls.py's ``CallShape``, chat
completions and completions simworker/openai_completions.py's). Every
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
  simworker/anthropic_messages.py and simworker/openai_responses.py say how their requests
  become prompts, simworker/apis.py their output lengths.
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
import time
from array import array
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from random import Random
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sim.engine import Engine
from sim.engine_request import EngineRequest
from sim.step_time import model_of
from sim.tokens import (
    FILLER_WORDS,
    PromptError,
    PseudoTokenizer,
    block_hashes,
    prompt_seed,
    tool_calls_text,
)
from simworker.anthropic_messages import AnthropicMessages
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
from simworker.config import DEFAULT_MAX_MODEL_LEN, SimWorkerConfig
from simworker.directive_socket import DirectiveSocket
from simworker.engine_driver import EngineDriver
from simworker.kv_publisher import KvEventPublisher
from simworker.metrics import EngineCollector
from simworker.openai_completions import OpenAICompletions
from simworker.openai_responses import OpenAIResponses
from simworker.tool_calls import ToolCallReply, plan_tool_call
from simworker.validation import (
    InvalidRequest,
    check_media_type,
    parse_json,
    validate_body,
)

# SimWorkerConfig and DEFAULT_MAX_MODEL_LEN live in simworker/config.py; callers import them from
# here with create_app.
__all__ = ["DEFAULT_MAX_MODEL_LEN", "SimWorker", "SimWorkerConfig", "create_app"]


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


class SimWorker:
    """The HTTP side of a simworker: its requests checked and prepared as vLLM's handlers do, the
    engine's replies as each API's bodies and streams, the sockets' lifecycle; the engine itself
    runs in its :class:`EngineDriver`."""

    def __init__(self, config: SimWorkerConfig) -> None:
        self.config = config
        model = model_of(config.preset)
        if config.prefill_scale != 1.0:
            model = model.with_prefill_scale(config.prefill_scale)
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
        server_keys = config.zmq_server_keys
        self.publisher = (
            KvEventPublisher(config.kv_events, replay_endpoint=config.replay, topic=config.kv_topic,
                             buffer_steps=config.replay_buffer, server_keys=server_keys,
                             allow_insecure_bind=config.allow_insecure_bind)
            if config.kv_events else None
        )
        self._log = structlog.get_logger("sluice.simworker").bind(worker=config.name)
        self.driver = EngineDriver(self.engine, config, self.publisher, self._log)
        self.directives = (
            DirectiveSocket(config.directives, self.engine, self.driver.vnow, config.directive_limits,
                            server_keys=server_keys, allow_insecure_bind=config.allow_insecure_bind)
            if config.directives else None
        )
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(self.driver, self.directives))

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
        self.driver.start_clock()
        engine = self.engine
        self._log.info("simworker ready", model=self.config.model, preset=self.engine.model.name,
                       preset_provenance=self.engine.model.provenance.kind,
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
        if self.driver.failed:
            raise BadRequest(self.driver.failed, status=503)
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
            arrival=self.driver.vnow(), continuation_id=params.continuation_id, token_ids=prepared.tokens,
            report_reuse=params.report_full,
        )
        call = Call(shape.kind, response_id, params.model or self.config.model, int(time.time()),
                    params, engine_request, prepared.pieces, prepared.finish, echo, tool_call=prepared.tool_call,
                    tool_results=plan.tool_results)
        try:
            self.driver.submit(call)
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
                self.driver.abort(call)
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
                self.driver.abort(call)

    # -- other endpoints -------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model, "object": "model", "created": int(time.time()),
            "owned_by": "sluice", "root": self.config.model, "parent": None,
            "max_model_len": self.max_model_len, "permission": [],
        }]})

    async def health(self, request: Request) -> Response:
        if self.driver.failed:
            return error_response(503, self.driver.failed)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(config: SimWorkerConfig) -> Starlette:
    """Build the app; its sockets open and its engine task starts when the server starts."""
    worker = SimWorker(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.open()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.driver.run)
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
