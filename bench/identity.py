"""Program identity: how well calls are grouped into the programs they belong to.

A generated stream of interleaved agent programs, each call as a client sends it (OpenAI chat,
Anthropic Messages or OpenAI Responses; streamed or not), goes through the identity code the
gateway runs, in the gateway's order: :func:`controller.identity.resolve_identity` on
arrival, then :meth:`Conversations.assign` for a call without identity; when the call ends,
the worker's answer — a vLLM-shaped body, or SSE bytes read by :class:`StreamTap` with an
:class:`AnswerTap` — goes to :meth:`Conversations.answered`, or the failure to
:meth:`Conversations.failed`. Each call attempt is scored against the program it truly
belongs to as pairwise precision and recall of "same program" (of all pairs of calls put in
one program, the share that truly are; of all pairs truly in one, the share put together).

The stream mixes what defeats a grouping by the conversation's opening:
- GRPO groups: 8 samples of one identical prompt started together, each a multi-turn tool
  loop (tool calls with engine-made unique ids), one program each;
- pass@k: 3 runs of one task, one after the other or at once;
- multi-turn chats without tools (text answers, user follow-ups);
- sub-agents: a fresh conversation started from a parent's tool call, a program of its own;
- retries: a call that fails (the worker refuses it, or it times out) is sent again as it was;
- clients that re-serialise what they send back (keys added, text re-indented, thinking
  blocks dropped), as SDKs do.

Run headerless (every call resolved by its content), then once per identity source with the
true program id attached there (each header and body field of architecture.md §5.2), where
the expectation is exact. Reported: ``identity_headerless_precision`` / ``_recall`` and the
lowest of the with-id runs (``identity_with_id_precision`` / ``_recall``), ratios in [0, 1].
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import progress, result
from controller.conversations import AnswerTap, Conversations, answer_from_body
from controller.identity import CONTENT_SOURCE, resolve_identity
from controller.prompt import ROUTE_CHAT, ROUTE_MESSAGES, ROUTE_RESPONSES
from controller.worker_answers import StreamTap

ROUTE_KINDS = {ROUTE_CHAT: "chat", ROUTE_MESSAGES: "messages", ROUTE_RESPONSES: "responses"}
WORDS = ("the test fails because the fixture is stale so we patch the loader and run it again "
         "then check the diff for edge cases in parsing dates lists nested maps and unicode").split()
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]
FAILURE_RATE = 0.04


# -- what the clients send and the workers answer ------------------------------------------------


@dataclass(slots=True)
class Turn:
    """One answer of the model: text, and a tool call or none."""

    text: str
    tool_id: str | None
    command: str | None
    thinking: str | None = None


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _tool_id(rng: random.Random, route: str) -> str:
    # the shapes vLLM gives them: chat "chatcmpl-tool-<hex>", Messages "toolu_<...>",
    # Responses "call_<...>"; random per call, as the engine makes them
    if route == ROUTE_MESSAGES:
        return "toolu_" + "".join(rng.choice("abcdefghijkmnopqrstuvwxyzABCDEFGH0123456789") for _ in range(24))
    prefix = "chatcmpl-tool-" if route == ROUTE_CHAT else "call_"
    return prefix + "%032x" % rng.getrandbits(128)


class Conversation:
    """One program's messages in its API's shape, as its client keeps them."""

    def __init__(self, route: str, system: str, task: str, rng: random.Random, tools: bool,
                 sloppy: bool) -> None:
        self.route, self.rng, self.tools, self.sloppy = route, rng, tools, sloppy
        self.system, self.task = system, task
        self.items: list[Any] = [{"role": "user", "content": task}]

    def body(self, model: str) -> dict[str, Any]:
        if self.route == ROUTE_CHAT:
            body: dict[str, Any] = {"model": model,
                                    "messages": [{"role": "system", "content": self.system}, *self.items]}
            if self.tools:
                body["tools"] = TOOLS
        elif self.route == ROUTE_MESSAGES:
            body = {"model": model, "max_tokens": 512, "system": self.system,
                    "messages": list(self.items)}
            if self.tools:
                body["tools"] = [{"name": "bash", "description": "run a command",
                                  "input_schema": TOOLS[0]["function"]["parameters"]}]
        else:
            body = {"model": model, "instructions": self.system, "input": list(self.items)}
            if self.tools:
                body["tools"] = [{"type": "function", "name": "bash", "parameters":
                                  TOOLS[0]["function"]["parameters"]}]
        return body

    def carry_back(self, turn: Turn, follow_up: str) -> None:
        """Append the answer as the client sends it back, then the tool result or the user's
        next message."""
        text = turn.text
        if self.sloppy:
            text = "\n  " + text.replace(" ", "  ") + "\n"  # re-indented by the client
        if self.route == ROUTE_CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text if text else None}
            if self.sloppy:
                message.update(refusal=None, annotations=[], audio=None)
            if turn.tool_id:
                message["tool_calls"] = [{"id": turn.tool_id, "type": "function", "function": {
                    "name": "bash", "arguments": json.dumps({"command": turn.command})}}]
                self.items += [message, {"role": "tool", "tool_call_id": turn.tool_id, "content": follow_up}]
            else:
                self.items += [message, {"role": "user", "content": follow_up}]
        elif self.route == ROUTE_MESSAGES:
            blocks: list[dict[str, Any]] = []
            if turn.thinking and not self.sloppy:  # a sloppy client drops thinking blocks
                blocks.append({"type": "thinking", "thinking": turn.thinking, "signature": "sig"})
            if text:
                blocks.append({"type": "text", "text": text})
            if turn.tool_id:
                blocks.append({"type": "tool_use", "id": turn.tool_id, "name": "bash",
                               "input": {"command": turn.command}})
                reply = [{"type": "tool_result", "tool_use_id": turn.tool_id, "content": follow_up,
                          "cache_control": {"type": "ephemeral"}}]
            else:
                reply = [{"type": "text", "text": follow_up}]
            self.items += [{"role": "assistant", "content": blocks}, {"role": "user", "content": reply}]
        else:
            out: list[dict[str, Any]] = []
            if turn.thinking:
                out.append({"type": "reasoning", "id": "rs_" + "%016x" % self.rng.getrandbits(64),
                            "summary": []})
            if text:
                out.append({"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]})
            if turn.tool_id:
                out.append({"type": "function_call", "id": "fc_" + "%016x" % self.rng.getrandbits(64),
                            "call_id": turn.tool_id, "name": "bash",
                            "arguments": json.dumps({"command": turn.command})})
                out.append({"type": "function_call_output", "call_id": turn.tool_id, "output": follow_up})
            else:
                out.append({"role": "user", "content": follow_up})
            self.items += out


def worker_answer(route: str, turn: Turn, stream: bool) -> tuple[bytes, bool]:
    """The worker's response to a call, as bytes (vLLM 0.32's shapes), and whether it streams."""
    if route == ROUTE_CHAT:
        calls = [{"id": turn.tool_id, "type": "function", "function": {
            "name": "bash", "arguments": json.dumps({"command": turn.command})}}] if turn.tool_id else []
        if not stream:
            message = {"role": "assistant", "content": turn.text or None, "tool_calls": calls}
            return json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": message}],
                               "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode(), False
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
        for i in range(0, len(turn.text), 7):
            events.append({"choices": [{"delta": {"content": turn.text[i:i + 7]}}]})
        if calls:
            events.append({"choices": [{"delta": {"tool_calls": [{"index": 0, **calls[0], "function": {
                "name": "bash", "arguments": ""}}]}}]})
            events.append({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
                "arguments": calls[0]["function"]["arguments"]}}]}}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}})
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n", True
    if route == ROUTE_MESSAGES:
        content: list[dict[str, Any]] = []
        if turn.thinking:
            content.append({"type": "thinking", "thinking": turn.thinking, "signature": "sig"})
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        if turn.tool_id:
            content.append({"type": "tool_use", "id": turn.tool_id, "name": "bash",
                            "input": {"command": turn.command}})
        if not stream:
            return json.dumps({"type": "message", "role": "assistant", "content": content,
                               "usage": {"input_tokens": 10, "output_tokens": 5}}).encode(), False
        events = [("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 10}}})]
        for index, block in enumerate(content):
            if block["type"] == "text":
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {"type": "text", "text": ""}}))
                for i in range(0, len(block["text"]), 9):
                    events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "text_delta",
                                                                     "text": block["text"][i:i + 9]}}))
            else:
                start = dict(block, input={}) if block["type"] == "tool_use" else block
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": start}))
        events.append(("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return b"".join(b"event: " + n.encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                        for n, e in events), True
    output: list[dict[str, Any]] = []
    if turn.text:
        output.append({"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": turn.text, "annotations": []}]})
    if turn.tool_id:
        output.append({"type": "function_call", "id": "fc_x", "call_id": turn.tool_id, "name": "bash",
                       "arguments": json.dumps({"command": turn.command})})
    response = {"object": "response", "id": "resp_x", "output": output,
                "usage": {"input_tokens": 10, "output_tokens": 5}}
    if not stream:
        return json.dumps(response).encode(), False
    events = [{"type": "response.created", "response": {**response, "output": []}},
              {"type": "response.output_text.delta", "delta": turn.text},
              {"type": "response.completed", "response": response}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events), True


# -- the programs --------------------------------------------------------------------------------


@dataclass(slots=True)
class Program:
    truth: str  # the program's true id
    conversation: Conversation
    turns: int  # model calls it makes
    start_at: float
    stream: bool
    done: int = 0
    spawn_at: int | None = None  # a sub-agent starts after this call of the program
    then: list[Program] = field(default_factory=list)  # programs that start when it ends


class Stream:
    """The generated programs (seeded): GRPO groups, pass@k runs, chats and sub-agents."""

    def __init__(self, seed: int, groups: int) -> None:
        self.rng = random.Random(seed)
        self.programs: list[Program] = []
        self._ids = itertools.count()
        for g in range(groups):
            start = self.rng.uniform(0, 300)
            kind = g % 4
            if kind == 0:
                self._grpo(g, start)
            elif kind == 1:
                self._pass_at_k(g, start)
            elif kind == 2:
                self._chat(g, start)
            else:
                self._with_sub_agent(g, start)

    def _new(self, route: str, system: str, task: str, turns: int, start: float, tools: bool,
             stream: bool | None = None, top: bool = True) -> Program:
        rng = self.rng
        program = Program(f"truth-{next(self._ids)}",
                          Conversation(route, system, task, rng, tools, sloppy=rng.random() < 0.3),
                          turns, start, rng.random() < 0.5 if stream is None else stream)
        if top:
            self.programs.append(program)
        return program

    def _route(self) -> str:
        return self.rng.choice((ROUTE_CHAT, ROUTE_MESSAGES, ROUTE_RESPONSES))

    def _grpo(self, g: int, start: float) -> None:
        route, task = self._route(), f"task {g}: " + _sentence(self.rng, 12)
        for _ in range(8):  # identical prompts, started together
            self._new(route, "You are a software agent.", task, self.rng.randint(3, 8),
                      start + self.rng.uniform(0, 0.05), tools=True)

    def _pass_at_k(self, g: int, start: float) -> None:
        route, task = self._route(), f"issue {g}: " + _sentence(self.rng, 15)
        if self.rng.random() < 0.5:  # one after the other
            first = self._new(route, "Solve the issue.", task, self.rng.randint(2, 6), start, tools=True)
            second = self._new(route, "Solve the issue.", task, self.rng.randint(2, 6), 0, tools=True,
                               top=False)
            third = self._new(route, "Solve the issue.", task, self.rng.randint(2, 6), 0, tools=True,
                              top=False)
            first.then.append(second)
            second.then.append(third)
        else:
            for _ in range(3):
                self._new(route, "Solve the issue.", task, self.rng.randint(2, 6),
                          start + self.rng.uniform(0, 2), tools=True)

    def _chat(self, g: int, start: float) -> None:
        route = self._route()
        opening = "hello, can you help me with my code?" if g % 8 == 2 else _sentence(self.rng, 8)
        for _ in range(2):  # a common opening, two users
            self._new(route, "You are a helpful assistant.", opening, self.rng.randint(2, 6),
                      start + self.rng.uniform(0, 60), tools=False)

    def _with_sub_agent(self, g: int, start: float) -> None:
        route = self._route()
        parent = self._new(route, "You are a lead agent.", f"project {g}: " + _sentence(self.rng, 10),
                           self.rng.randint(4, 7), start, tools=True)
        parent.spawn_at = 1
        child = self._new(route, "You are a research sub-agent.", f"look into {g}: " + _sentence(self.rng, 6),
                          self.rng.randint(2, 4), 0, tools=True, top=False)
        parent.then.append(child)  # started by the parent's tool call, below

    def turn(self, program: Program) -> Turn:
        rng = self.rng
        last = program.done == program.turns - 1
        if program.conversation.tools and not last:
            tool = _tool_id(rng, program.conversation.route)
            text = _sentence(rng, rng.randint(0, 10))
            return Turn(text, tool, _sentence(rng, 3), _sentence(rng, 5) if rng.random() < 0.3 else None)
        return Turn(_sentence(rng, rng.randint(6, 30)), None, None,
                    _sentence(rng, 5) if rng.random() < 0.3 else None)


# -- driving it through the identity code -------------------------------------------------------

# An id attached to every call of a program: where it goes (the route it applies to, if only one).
IdSource = Callable[[str, dict[str, Any], dict[str, str], str], None]


def _header(name: str) -> IdSource:
    def attach(route: str, body: dict[str, Any], headers: dict[str, str], program: str) -> None:
        headers[name] = program
    return attach


def _field(*path: str) -> IdSource:
    def attach(route: str, body: dict[str, Any], headers: dict[str, str], program: str) -> None:
        inner = body
        for key in path[:-1]:
            inner = inner.setdefault(key, {})
        inner[path[-1]] = program
    return attach


def _user_id(route: str, body: dict[str, Any], headers: dict[str, str], program: str) -> None:
    body["metadata"] = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                               "session_id": program})}


ID_SOURCES: dict[str, IdSource] = {
    "vllm_xargs.agentic_context": _field("vllm_xargs", "agentic_context", "program_id"),
    "nvext.agent_context": _field("nvext", "agent_context", "trajectory_id"),
    "agent_hint": _field("agent_hint", "session_id"),
    "x-dynamo-session-id": _header("x-dynamo-session-id"),
    "x-claude-code-session-id": _header("x-claude-code-session-id"),
    "session-id": _header("session-id"),
    "thread-id": _header("thread-id"),
    "x-session-id": _header("x-session-id"),
    "body.session_id": _field("session_id"),
    "body.program_id": _field("program_id"),
    "metadata.user_id": _user_id,
    "prompt_cache_key": _field("prompt_cache_key"),
}


@dataclass(slots=True)
class Score:
    calls: int
    programs: int
    precision: float
    recall: float


def pairwise(truth: list[str], predicted: list[str]) -> tuple[float, float]:
    """Pairwise precision and recall of "same program" (1.0 when there are no pairs)."""
    def pairs(counts: Counter) -> int:
        return sum(n * (n - 1) // 2 for n in counts.values())
    both = pairs(Counter(zip(truth, predicted)))
    said, true = pairs(Counter(predicted)), pairs(Counter(truth))
    return (both / said if said else 1.0), (both / true if true else 1.0)


def run_stream(seed: int, groups: int, id_source: IdSource | None = None) -> Score:
    """Play the stream through the identity code; ``id_source`` attaches the true id."""
    stream = Stream(seed, groups)
    rng = random.Random(seed + 1)
    conversations = Conversations()
    truth: list[str] = []
    predicted: list[str] = []
    queue: list[tuple[float, int, str, Program, Any]] = []
    order = itertools.count()
    for program in stream.programs:
        heapq.heappush(queue, (program.start_at, next(order), "call", program, None))
    while queue:
        now, _, what, program, pending = heapq.heappop(queue)
        conv = program.conversation
        if what == "call":
            body, headers = conv.body("qwen3-8b"), {}
            if id_source is not None:
                id_source(conv.route, body, headers, program.truth)
            identity, _ = resolve_identity(conv.route, headers, body)
            session = identity.session_id
            if identity.source == CONTENT_SOURCE:
                assert identity.group_id is not None
                session = conversations.assign(identity.group_id, identity.continues, identity.chain.head)
            truth.append(program.truth)
            predicted.append(session)
            heapq.heappush(queue, (now + rng.uniform(0.5, 5.0), next(order), "end", program,
                                   (identity, session)))
            continue
        identity, session = pending
        if rng.random() < FAILURE_RATE:  # refused or timed out: the client sends it again
            if identity.source == CONTENT_SOURCE:
                conversations.failed(session, identity.chain.head)
            heapq.heappush(queue, (now + rng.uniform(0.1, 2.0), next(order), "call", program, None))
            continue
        turn = stream.turn(program)
        raw, streamed = worker_answer(conv.route, turn, program.stream)
        if identity.source == CONTENT_SOURCE:
            kind = ROUTE_KINDS[conv.route]
            if streamed:
                tap = StreamTap(False, AnswerTap(kind))
                for i in range(0, len(raw), 64):
                    tap.feed(raw[i:i + 64])
                tap.flush()
                answer = tap.answer.answer() if tap.answer is not None else None
            else:
                answer = answer_from_body(kind, json.loads(raw))
            conversations.answered(session, identity.chain.head, answer)
        program.done += 1
        if program.spawn_at is not None and program.done == program.spawn_at:
            for child in program.then:  # the sub-agent runs inside the parent's tool call
                heapq.heappush(queue, (now + 0.01, next(order), "call", child, None))
            program.then = []
        if program.done >= program.turns:
            for later in program.then:  # the next pass@k run starts when this one ends
                heapq.heappush(queue, (now + rng.uniform(0.5, 5.0), next(order), "call", later, None))
            continue
        follow_up = _sentence(rng, rng.randint(3, 40))
        conv.carry_back(turn, follow_up)
        heapq.heappush(queue, (now + rng.uniform(0.1, 10.0), next(order), "call", program, None))
    precision, recall = pairwise(truth, predicted)
    return Score(len(truth), len(set(truth)), precision, recall)


def run(seed: int = 7, groups: int = 120) -> None:
    progress(f"identity: {groups} groups of programs (GRPO, pass@k, chats, sub-agents), seed {seed}")
    headerless = run_stream(seed, groups)
    progress(f"identity: headerless {headerless.calls} calls of {headerless.programs} programs: "
             f"precision {headerless.precision:.4f}, recall {headerless.recall:.4f}")
    result("identity_headerless_precision", headerless.precision, "ratio")
    result("identity_headerless_recall", headerless.recall, "ratio")
    worst_p, worst_r = 1.0, 1.0
    for name, source in ID_SOURCES.items():
        score = run_stream(seed, groups, source)
        worst_p, worst_r = min(worst_p, score.precision), min(worst_r, score.recall)
        if score.precision < 1.0 or score.recall < 1.0:
            progress(f"identity: with {name}: precision {score.precision:.4f}, recall {score.recall:.4f}")
    progress(f"identity: with an id in each of {len(ID_SOURCES)} sources: lowest precision "
             f"{worst_p:.4f}, lowest recall {worst_r:.4f}")
    result("identity_with_id_precision", worst_p, "ratio")
    result("identity_with_id_recall", worst_r, "ratio")
