"""A closed-loop SWE-bench-style agent client, for ``make demo`` and the gateway benchmark.

It plays :class:`sim.workloads.SwebenchWorkload` programs against any OpenAI-compatible
endpoint (the gateway, a simworker, vLLM): each program sends its calls in order, with the
real conversation growing turn by turn — a system prompt shared by every program, its own
task, then for each turn the assistant's reply as returned and a tool observation — and
waits out each tool latency (scaled by ``time_scale``) between calls. ``concurrency``
programs are alive at once; when one ends, the next starts. Texts are filler of the drawn
lengths (about four characters a token).

Each program speaks one API, in turn from ``apis`` by program index: ``chat`` (OpenAI chat
completions), ``messages`` (Anthropic Messages: the system prompt in ``system``) or
``responses`` (OpenAI Responses: the system prompt as ``instructions``, the whole history
as ``input`` each turn, ``store`` off — a ``previous_response_id`` is only known to the
worker that answered, and the gateway may move a program to another worker). Usage is read
in each API's own terms: Anthropic's ``input_tokens`` leave out the cache reads.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import numpy as np

from sim.programs import ProgramSpec

CHARS_PER_TOKEN = 4
APIS = ("chat", "messages", "responses")
_ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


def filler(tokens: int, seed: str) -> str:
    """Deterministic text of about ``tokens`` tokens; different seeds give different text."""
    rng = np.random.default_rng(abs(hash_text(seed)) % (2**32))
    words = []
    length = 0
    target = max(1, tokens) * CHARS_PER_TOKEN
    while length < target:
        word = _WORDS[int(rng.integers(len(_WORDS)))]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target]


def hash_text(text: str) -> int:
    value = 1469598103934665603
    for ch in text.encode():
        value = ((value ^ ch) * 1099511628211) & ((1 << 64) - 1)
    return value


@dataclass(slots=True)
class ClientResult:
    duration_s: float = 0.0
    calls: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    programs_completed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    agents_by_api: Counter[str] = field(default_factory=Counter)  # programs started
    calls_by_api: Counter[str] = field(default_factory=Counter)  # calls answered

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_s) if self.latencies_s else np.asarray([float("nan")])
        return {
            "duration_s": round(self.duration_s, 2),
            "calls": self.calls,
            "errors": self.errors,
            "output_tokens_per_s": round(self.output_tokens / max(self.duration_s, 1e-9), 1),
            "steps_per_min": round(self.calls / max(self.duration_s, 1e-9) * 60.0, 1),
            "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
            "p50_call_s": round(float(np.quantile(lat, 0.5)), 3),
            "p99_call_s": round(float(np.quantile(lat, 0.99)), 3),
            "programs_completed": self.programs_completed,
            "agents_by_api": dict(self.agents_by_api),
            "calls_by_api": dict(self.calls_by_api),
        }


class AgentClient:
    def __init__(self, base_url: str, make_program, *, concurrency: int, duration_s: float,
                 drain_s: float = 0.0, time_scale: float = 1.0, model: str = "sluice-sim",
                 system_tokens: int | None = None, timeout_s: float = 600.0,
                 apis: tuple[str, ...] = ("chat",)) -> None:
        if concurrency <= 0:
            raise ValueError(f"concurrency must be > 0, got {concurrency}")
        unknown = [api for api in apis if api not in _ROUTES]
        if not apis or unknown:
            raise ValueError(f"apis must name some of {APIS}, got {apis}")
        self._apis = apis
        self._base_url = base_url.rstrip("/")
        self._make_program = make_program
        self._concurrency = concurrency
        self._duration_s = duration_s
        # After ``duration_s`` no new program starts; those under way may finish for up to
        # ``drain_s`` more, then every call still open is cancelled (the client goes away).
        self._drain_s = drain_s
        self._time_scale = time_scale
        self._model = model
        self._system_tokens = system_tokens
        self._timeout_s = timeout_s
        self._next_index = 0
        self.result = ClientResult()

    async def run(self) -> ClientResult:
        limits = httpx.Limits(max_connections=self._concurrency + 8,
                              max_keepalive_connections=self._concurrency + 8)
        start = time.monotonic()
        self._deadline = start + self._duration_s
        async with httpx.AsyncClient(base_url=self._base_url, limits=limits,
                                     timeout=httpx.Timeout(self._timeout_s)) as http:
            with anyio.move_on_after(self._duration_s + self._drain_s):
                async with anyio.create_task_group() as tasks:
                    for slot in range(self._concurrency):
                        tasks.start_soon(self._slot, http, slot)
        self.result.duration_s = time.monotonic() - start
        return self.result

    async def _slot(self, http: httpx.AsyncClient, slot: int) -> None:
        # Stagger the first programs so they do not all arrive at once.
        await anyio.sleep(slot * 0.01)
        while time.monotonic() < self._deadline:
            index = self._next_index
            self._next_index += 1
            spec = self._make_program(index)
            api = self._apis[index % len(self._apis)]
            self.result.agents_by_api[api] += 1
            if await self._play(http, spec, api):
                self.result.programs_completed += 1

    async def _play(self, http: httpx.AsyncClient, spec: ProgramSpec, api: str) -> bool:
        system = filler(self._system_tokens or spec.shared_prefix_tokens, "system")
        first = spec.calls[0]
        task_tokens = max(1, first.prompt_tokens - spec.shared_prefix_tokens)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": filler(task_tokens, spec.session_id)},
        ]
        for k, call in enumerate(spec.calls):
            if k > 0:
                await anyio.sleep(call.think_s * self._time_scale)
                observed = call.prompt_tokens - spec.calls[k - 1].prompt_tokens - spec.calls[k - 1].output_tokens
                messages.append({"role": "user",
                                 "content": filler(max(1, observed), f"{spec.session_id}/{k}")})
            final = k == len(spec.calls) - 1
            reply = await self._call(http, api, spec.session_id, messages, call.output_tokens, final)
            if reply is None:
                return False
            messages.append({"role": "assistant", "content": reply})
        return True

    def _body(self, api: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """The request of ``api`` for a chat-shaped conversation (a system message first)."""
        system, turns = messages[0]["content"], messages[1:]
        if api == "messages":
            return {"model": self._model, "system": system, "messages": turns, "max_tokens": max_tokens}
        if api == "responses":
            return {"model": self._model, "instructions": system, "input": turns,
                    "max_output_tokens": max_tokens, "store": False}
        return {"model": self._model, "messages": messages, "max_tokens": max_tokens}

    @staticmethod
    def _read(api: str, data: dict[str, Any]) -> tuple[str, int, int, int]:
        """(reply, prompt tokens, of which cached, output tokens) of an answer of ``api``."""
        usage = data.get("usage") or {}
        if api == "messages":
            cached = int(usage.get("cache_read_input_tokens") or 0)
            return (data["content"][0]["text"], int(usage.get("input_tokens", 0)) + cached, cached,
                    int(usage.get("output_tokens", 0)))
        if api == "responses":
            details = usage.get("input_tokens_details") or {}
            text = "".join(part["text"] for item in data["output"] if item.get("type") == "message"
                           for part in item["content"] if part.get("type") == "output_text")
            return (text, int(usage.get("input_tokens", 0)), int(details.get("cached_tokens") or 0),
                    int(usage.get("output_tokens", 0)))
        details = usage.get("prompt_tokens_details") or {}
        return (data["choices"][0]["message"]["content"], int(usage.get("prompt_tokens", 0)),
                int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens", 0)))

    async def _call(self, http: httpx.AsyncClient, api: str, session: str,
                    messages: list[dict[str, str]], max_tokens: int, final: bool) -> str | None:
        headers = {"x-session-id": session}
        if final:
            headers["x-dynamo-session-final"] = "true"
        sent = time.monotonic()
        try:
            response = await http.post(_ROUTES[api], json=self._body(api, messages, max_tokens),
                                       headers=headers)
        except httpx.HTTPError as err:
            self._error(f"{session} ({api}): {type(err).__name__}: {err}")
            return None
        if response.status_code != 200:
            self._error(f"{session} ({api}): HTTP {response.status_code}: {response.text[:200]}")
            return None
        try:
            reply, prompt, cached, output = self._read(api, response.json())
        except (ValueError, KeyError, IndexError, TypeError) as err:
            self._error(f"{session} ({api}): unreadable answer: {type(err).__name__}: {err}")
            return None
        self._answered(api, sent, prompt, cached, output)
        return reply

    def _answered(self, api: str, sent: float, prompt: int, cached: int, output: int) -> None:
        """Count a call of ``api`` sent at ``sent`` (monotonic) that was answered."""
        result = self.result
        result.calls += 1
        result.calls_by_api[api] += 1
        result.latencies_s.append(time.monotonic() - sent)
        result.output_tokens += output
        result.prompt_tokens += prompt
        result.cached_tokens += cached

    def _error(self, message: str) -> None:
        self.result.errors += 1
        if len(self.result.error_samples) < 5:
            self.result.error_samples.append(message)
