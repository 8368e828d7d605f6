"""Real client libraries through ``sluice serve``, against the embedded fleet (no GPU).

Starts simworkers and the gateway as subprocesses on free loopback ports (the live demo's
:class:`entry.live_demo.Fleet`), then drives the gateway with the official ``openai`` and
``anthropic`` SDKs and with ``litellm``, unchanged: each check prints ``PASS`` or ``FAIL``
and a line saying what it saw. Exits 1 when any check fails (2 when a library is missing).

    python -m experiments.clients.run_clients [--only openai,anthropic,litellm]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from entry.live_demo import DemoSetup, Fleet, wait_ready

MODEL = "sluice-sim"
API_KEY = "sluice-local"  # the gateway checks none; the SDKs insist on one
LIBRARIES = ("openai", "anthropic", "litellm")
SYSTEM = ("You are a careful software engineer. You read the repository, run the tests and fix "
          "the bug with the smallest change that makes the failing test pass. ") * 8
OPENAI_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
RESPONSES_TOOL = {"type": "function", "name": "bash", "description": "Run a shell command.",
                  "parameters": OPENAI_TOOL["function"]["parameters"]}
ANTHROPIC_TOOL = {"name": "bash", "description": "Run a shell command.",
                  "input_schema": OPENAI_TOOL["function"]["parameters"]}
MAX_TOKENS = 32


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass(frozen=True, slots=True)
class Outcome:
    library: str
    name: str
    passed: bool
    detail: str


class Checks:
    """Runs named checks, printing each outcome as it comes."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.outcomes: list[Outcome] = []

    def run(self, library: str, name: str, check: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = check()
            passed = True
        except Exception as err:  # any failure of a client call is this check's FAIL line
            passed = False
            detail = f"{type(err).__name__}: {err}"
            if not isinstance(err, CheckFailed):
                detail += "\n" + "".join(traceback.format_exception(err)[-3:]).rstrip()
        elapsed = time.monotonic() - started
        outcome = Outcome(library, name, passed, detail)
        self.outcomes.append(outcome)
        self.emit(f"{'PASS' if passed else 'FAIL'} {library}: {name} ({elapsed:.2f} s) — {detail}")


# -- openai ------------------------------------------------------------------------------------


def openai_checks(checks: Checks, gateway_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Find the bug in parser.py."}]

    def chat_create() -> str:
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[OPENAI_TOOL],
                                                max_tokens=MAX_TOKENS)
        text = answer.choices[0].message.content
        expect(bool(text), "no text in the answer")
        expect(answer.usage.completion_tokens == MAX_TOKENS, f"usage {answer.usage}")
        return f"{len(text)} chars, usage prompt={answer.usage.prompt_tokens} completion={answer.usage.completion_tokens}"

    def chat_stream() -> str:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                stream=True, stream_options={"include_usage": True})
        text, usage, chunks = "", None, 0
        for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        expect(bool(text), "no text streamed")
        expect(usage is not None and usage.completion_tokens == MAX_TOKENS, f"usage {usage}")
        return f"{chunks} chunks, {len(text)} chars, usage completion={usage.completion_tokens}"

    def completions() -> str:
        answer = client.completions.create(model=MODEL, prompt="def parse(text):", max_tokens=MAX_TOKENS)
        expect(bool(answer.choices[0].text), "no text")
        return f"{len(answer.choices[0].text)} chars, finish_reason={answer.choices[0].finish_reason}"

    def responses_create() -> str:
        answer = client.responses.create(model=MODEL, instructions=SYSTEM, input="Explain the failure.",
                                         tools=[RESPONSES_TOOL])
        expect(answer.status == "completed", f"status {answer.status}")
        expect(bool(answer.output_text), "no output_text")
        return f"{answer.id}: {len(answer.output_text)} chars, usage input={answer.usage.input_tokens}"

    def responses_stream() -> str:
        deltas = 0
        with client.responses.stream(model=MODEL, instructions=SYSTEM, input="Stream the plan.") as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    deltas += 1
            final = stream.get_final_response()
        expect(deltas > 0 and bool(final.output_text), "no text streamed")
        expect(final.usage is not None and final.usage.output_tokens > 0, f"usage {final.usage}")
        return f"{deltas} text deltas, usage output={final.usage.output_tokens}"

    def responses_create_stream() -> str:
        kinds: list[str] = []
        for event in client.responses.create(model=MODEL, input="Stream raw events.", stream=True):
            kinds.append(event.type)
        expect(kinds[0] == "response.created" and kinds[-1] == "response.completed", f"events {kinds[:3]}…{kinds[-2:]}")
        return f"{len(kinds)} events, {kinds[0]} … {kinds[-1]}"

    def previous_response_id() -> str:
        first = client.responses.create(model=MODEL, instructions=SYSTEM, input="Read the README first.")
        second = client.responses.create(model=MODEL, instructions=SYSTEM, input="Now run the tests.",
                                         previous_response_id=first.id)
        cached = second.usage.input_tokens_details.cached_tokens
        expect(cached > 0, f"no cached tokens on the follow-up: {second.usage}")
        expect(second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens,
               "the follow-up's prompt does not hold the previous turn")
        return f"turn 2 input={second.usage.input_tokens}, cached={cached}"

    for name, check in (("chat.completions.create (tools)", chat_create),
                        ("chat.completions.create stream", chat_stream),
                        ("completions.create", completions),
                        ("responses.create (tools)", responses_create),
                        ("responses.stream", responses_stream),
                        ("responses.create stream=True", responses_create_stream),
                        ("responses previous_response_id", previous_response_id)):
        checks.run("openai", name, check)
    client.close()


# -- anthropic ---------------------------------------------------------------------------------


def anthropic_checks(checks: Checks, gateway_url: str) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=gateway_url, api_key=API_KEY, max_retries=0, timeout=60)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    opening = [{"role": "user", "content": "Find the bug in lexer.py."}]

    def create() -> str:
        message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system,
                                         messages=opening, tools=[ANTHROPIC_TOOL])
        expect(message.content[0].type == "text" and bool(message.content[0].text), "no text block")
        expect(message.usage.output_tokens == MAX_TOKENS, f"usage {message.usage}")
        return (f"{message.id}: stop_reason={message.stop_reason}, usage input={message.usage.input_tokens} "
                f"cache_read={message.usage.cache_read_input_tokens} output={message.usage.output_tokens}")

    def stream() -> str:
        with client.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, system=system,
                                    messages=[{"role": "user", "content": "Stream the fix."}]) as events:
            text = "".join(events.text_stream)
            final = events.get_final_message()
        expect(bool(text) and final.content[0].text == text, "streamed text differs from the final message")
        expect(final.usage.output_tokens == MAX_TOKENS, f"usage {final.usage}")
        return f"{len(text)} chars, stop_reason={final.stop_reason}, usage output={final.usage.output_tokens}"

    def count_tokens() -> str:
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=opening,
                                               tools=[ANTHROPIC_TOOL])
        # the same prompt as messages.create (tools) above: Anthropic's input_tokens leaves
        # out the cache reads, so the count is their sum
        message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system,
                                         messages=opening, tools=[ANTHROPIC_TOOL])
        prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        expect(counted.input_tokens == prompt, f"counted {counted.input_tokens}, the call's prompt {prompt}")
        return f"input_tokens={counted.input_tokens}, as the call's prompt"

    def two_turns() -> str:
        turn1 = [{"role": "user", "content": "Two turns: what does setup.cfg say?"}]
        first = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system, messages=turn1)
        turn2 = [*turn1, {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
                 {"role": "user", "content": "Now run the tests."}]
        second = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=system, messages=turn2)
        read = second.usage.cache_read_input_tokens or 0
        expect(read > 0, f"turn 2 read nothing from the cache: {second.usage}")
        return f"turn 1 cache_read={first.usage.cache_read_input_tokens}, turn 2 cache_read={read} input={second.usage.input_tokens}"

    for name, check in (("messages.create (tools)", create), ("messages.stream", stream),
                        ("messages.count_tokens (tools)", count_tokens),
                        ("two turns: cache_read_input_tokens > 0 on turn 2", two_turns)):
        checks.run("anthropic", name, check)
    client.close()


# -- litellm -----------------------------------------------------------------------------------


def litellm_checks(checks: Checks, gateway_url: str) -> None:
    import litellm

    litellm.suppress_debug_info = True  # else it prints a provider-list hint on every call
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise the diff."}]
    targets = (("openai/", f"{gateway_url}/v1"), ("anthropic/", gateway_url))

    def once(prefix: str, api_base: str) -> Callable[[], str]:
        def check() -> str:
            answer = litellm.completion(model=prefix + MODEL, api_base=api_base, api_key=API_KEY,
                                        messages=messages, max_tokens=MAX_TOKENS, tools=[OPENAI_TOOL])
            text = answer.choices[0].message.content
            expect(bool(text), "no text")
            expect(answer.usage.completion_tokens == MAX_TOKENS, f"usage {answer.usage}")
            return f"{len(text)} chars, usage prompt={answer.usage.prompt_tokens} completion={answer.usage.completion_tokens}"
        return check

    def streamed(prefix: str, api_base: str) -> Callable[[], str]:
        def check() -> str:
            chunks = list(litellm.completion(model=prefix + MODEL, api_base=api_base, api_key=API_KEY,
                                             messages=messages, max_tokens=MAX_TOKENS, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            expect(bool(text), "no text streamed")
            return f"{len(chunks)} chunks, {len(text)} chars"
        return check

    for prefix, api_base in targets:
        checks.run("litellm", f"completion {prefix}{MODEL}", once(prefix, api_base))
        checks.run("litellm", f"completion {prefix}{MODEL} stream", streamed(prefix, api_base))


CHECKS: dict[str, Callable[[Checks, str], None]] = {
    "openai": openai_checks, "anthropic": anthropic_checks, "litellm": litellm_checks,
}


def missing_libraries(libraries: tuple[str, ...]) -> list[str]:
    missing = []
    for name in libraries:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def clients_setup() -> DemoSetup:
    """Two small simworkers, fast: the checks are about wire formats, not about load."""
    return DemoSetup(workers=2, blocks=1024, time_scale=0.02, prefill_scale=1.0)


def run_on_fleet(setup: DemoSetup, checks_by_name: dict[str, Callable[[Checks, str], None]],
                 chosen: tuple[str, ...], emit: Callable[[str], None],
                 prepare: Callable[[Path], None] | None = None) -> list[Outcome]:
    """Start a fleet of ``setup`` in a temporary directory (``prepare`` gets it first), run the
    chosen checks against its gateway, stop it; every outcome."""
    checks = Checks(emit)
    with tempfile.TemporaryDirectory(prefix="sluice-clients-") as tmp:
        if prepare is not None:
            prepare(Path(tmp))
        fleet = Fleet(setup, "program_aware", Path(tmp))
        fleet.start()
        try:
            anyio.run(wait_ready, fleet)
            emit(f"gateway {fleet.gateway_url} in front of {len(fleet.worker_urls)} simworkers")
            for name in chosen:
                checks_by_name[name](checks, fleet.gateway_url)
            fleet.check_alive()
        finally:
            fleet.stop()
    return checks.outcomes


def cli(argv: list[str] | None, description: str, modules: dict[str, str],
        run: Callable[[tuple[str, ...], Callable[[str], None]], list[Outcome]]) -> int:
    """The command line both scripts share: ``--only`` picks among ``modules`` (name → the
    module it needs); exit 0 when every check passes, 1 when one fails, 2 when a module is
    missing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", default=",".join(modules),
                        help=f"comma-separated names to check (default: {','.join(modules)})")
    args = parser.parse_args(argv)
    chosen = tuple(name.strip() for name in args.only.split(",") if name.strip())
    unknown = [name for name in chosen if name not in modules]
    if unknown:
        parser.error(f"unknown names: {', '.join(unknown)} (known: {', '.join(modules)})")
    # litellm fetches its model price map from GitHub at import unless told to use its copy
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    missing = missing_libraries(tuple(modules[name] for name in chosen))
    if missing:
        print(f"MISSING {', '.join(missing)}: pip install -e '.[clients]'", flush=True)
        return 2
    outcomes = run(chosen, lambda line: print(line, flush=True))
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


def run(libraries: tuple[str, ...], emit: Callable[[str], None]) -> list[Outcome]:
    return run_on_fleet(clients_setup(), CHECKS, libraries, emit)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.split("\n\n")[0], {name: name for name in LIBRARIES}, run)


if __name__ == "__main__":
    sys.exit(main())
