"""Agent frameworks that send no program identity, through ``sluice serve`` on the embedded fleet.

The openai-agents SDK (chat completions and Responses models), mini-swe-agent (its default
``LitellmModel`` with the ``bash`` tool) and a plain ``litellm`` tool loop (OpenAI and
Anthropic providers) run unchanged against the gateway, which sits in front of simworkers
that answer with tool calls for the first ``TOOL_TURNS`` turns of a conversation and sample
their text (``sluice simworker --tool-call-turns``). None of these clients sends a session
header or an identity field, so the gateway tells their programs apart by the answers their
calls carry back (docs/architecture.md §5.2, "Calls without identity").

Each check runs two agents on the *same* task at once and then reads the gateway's programs
(``GET /sluice/programs``): the check passes when the calls made a program per run (two new
programs, in one group: the task's opening), each holding every call of its run. Output:
``PASS`` / ``FAIL`` lines as experiments/clients/run_clients.py prints them.

    python -m experiments.clients.run_agents [--only agents,mini-swe-agent,litellm]
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from entry.live_demo import ADMIN_TOKEN, DemoSetup
from experiments.clients.run_clients import (
    API_KEY,
    MODEL,
    OPENAI_TOOL,
    Checks,
    Outcome,
    cli,
    expect,
    run_on_fleet,
)

# The simworkers answer a conversation's first TOOL_TURNS calls with a tool call, then text.
TOOL_TURNS = 3
RUNS = 2  # agents on one task at once
LIBRARIES = {"agents": "agents", "mini-swe-agent": "minisweagent", "litellm": "litellm"}
TASK = ("The date parser in utils/dates.py rejects ISO week dates such as 2024-W05-3. "
        "Find why and fix it.")
MAX_TOKENS = 48


class Programs:
    """What the gateway's programs were before a check, to tell the ones it made."""

    def __init__(self, gateway_url: str) -> None:
        self._url = f"{gateway_url}/sluice/programs"
        self._before = {p["session_id"] for p in self._read()}

    def _read(self) -> list[dict[str, Any]]:
        response = httpx.get(self._url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=10, trust_env=False)
        response.raise_for_status()
        return response.json()["programs"]

    def new(self) -> list[dict[str, Any]]:
        return [p for p in self._read() if p["session_id"] not in self._before]


def expect_one_program_per_run(programs: Programs, calls_per_run: list[int]) -> str:
    """Two runs of one task: two new programs, one group, each holding its run's calls."""
    made = programs.new()
    steps = sorted(p["steps"] for p in made)
    expect(len(made) == len(calls_per_run),
           f"{len(made)} programs for {len(calls_per_run)} runs: {[(p['session_id'], p['steps']) for p in made]}")
    expect(steps == sorted(calls_per_run), f"steps per program {steps}, calls per run {sorted(calls_per_run)}")
    groups = {p["group_id"] for p in made}
    expect(len(groups) == 1, f"the runs of one task are in {len(groups)} groups: {groups}")
    return f"{len(made)} programs of group {groups.pop()}, steps {steps}"


def _at_once(run: Callable[[int], int]) -> list[int]:
    """Run ``run(i)`` for each of the RUNS agents in threads started together; their results."""
    results: list[int | BaseException] = [0] * RUNS
    start = threading.Barrier(RUNS)

    def target(i: int) -> None:
        start.wait()
        try:
            results[i] = run(i)
        except BaseException as err:  # re-raised below, in the check
            results[i] = err

    threads = [threading.Thread(target=target, args=(i,)) for i in range(RUNS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for outcome in results:
        if isinstance(outcome, BaseException):
            raise outcome
    return [int(r) for r in results]  # type: ignore[arg-type]


# -- openai-agents -----------------------------------------------------------------------------


def agents_checks(checks: Checks, gateway_url: str) -> None:
    from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would post traces to OpenAI otherwise

    @function_tool
    def run_tests(path: str) -> str:
        """Run the tests under a path."""
        return f"3 passed, 1 failed in {path}"

    def check(kind: str) -> Callable[[], str]:
        def run_all() -> str:
            programs = Programs(gateway_url)

            async def one() -> int:
                client = AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=0)
                model = (OpenAIChatCompletionsModel(MODEL, client) if kind == "chat"
                         else OpenAIResponsesModel(MODEL, client))
                # no output limit: one that cuts the reply short makes the Responses model
                # raise (status "incomplete"), as it would on any server
                agent = Agent(name="fixer", instructions="You fix bugs in Python code.", model=model,
                              tools=[run_tests])
                result = await Runner.run(agent, TASK, max_turns=TOOL_TURNS + 2)
                expect(bool(result.final_output), "no final output")
                return len(result.raw_responses)

            async def both() -> list[int]:
                return list(await asyncio.gather(*(one() for _ in range(RUNS))))

            calls = asyncio.run(both())
            expect(calls == [TOOL_TURNS + 1] * RUNS, f"model calls per run {calls}")
            return expect_one_program_per_run(programs, calls)
        return run_all

    checks.run("agents", "two Runner.run of one task (chat completions model)", check("chat"))
    checks.run("agents", "two Runner.run of one task (Responses model)", check("responses"))


# -- mini-swe-agent ----------------------------------------------------------------------------


class ScriptedShell:
    """mini-swe-agent's environment interface without running anything: each command gets
    a canned output, and the ``submit_after``-th submits (the agent's way to finish)."""

    def __init__(self, submit_after: int) -> None:
        self.commands: list[str] = []
        self.submit_after = submit_after

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        from minisweagent.exceptions import Submitted

        self.commands.append(action.get("command", ""))
        if len(self.commands) >= self.submit_after:
            raise Submitted({"role": "exit", "content": "diff --git a/utils/dates.py",
                             "extra": {"exit_status": "Submitted", "submission": "diff"}})
        return {"output": f"ran {len(self.commands)} command(s)\n", "returncode": 0, "exception_info": ""}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"system": "Linux", "release": "6", "version": "1", "machine": "x86_64", **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment_type": "ScriptedShell"}}}


def mini_swe_agent_checks(checks: Checks, gateway_url: str) -> None:
    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # else a provider-list hint on every cost lookup
    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())

    def run_all() -> str:
        programs = Programs(gateway_url)

        def one(_: int) -> int:
            model = LitellmModel(model_name=f"openai/{MODEL}", cost_tracking="ignore_errors",
                                 model_kwargs={"api_base": f"{gateway_url}/v1", "api_key": API_KEY,
                                               "max_tokens": MAX_TOKENS})
            agent = DefaultAgent(model, ScriptedShell(submit_after=TOOL_TURNS),
                                 **{**config["agent"], "step_limit": TOOL_TURNS + 3})
            info = agent.run(TASK)
            expect(info.get("exit_status") == "Submitted", f"exit status {info.get('exit_status')!r}")
            return agent.n_calls

        calls = _at_once(one)
        expect(calls == [TOOL_TURNS] * RUNS, f"model calls per run {calls}")
        return expect_one_program_per_run(programs, calls)

    checks.run("mini-swe-agent", "two DefaultAgent.run of one task (LitellmModel, bash tool)", run_all)


# -- litellm -----------------------------------------------------------------------------------


def litellm_checks(checks: Checks, gateway_url: str) -> None:
    import litellm

    litellm.suppress_debug_info = True

    def loop(prefix: str, api_base: str) -> Callable[[], str]:
        def run_all() -> str:
            programs = Programs(gateway_url)

            def one(_: int) -> int:
                messages: list[Any] = [{"role": "system", "content": "You fix bugs."},
                                       {"role": "user", "content": TASK}]
                for calls in range(1, TOOL_TURNS + 3):
                    answer = litellm.completion(model=prefix + MODEL, api_base=api_base, api_key=API_KEY,
                                                messages=messages, tools=[OPENAI_TOOL], max_tokens=MAX_TOKENS)
                    message = answer.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        return calls
                    for call in message.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": "exit 0"})
                raise AssertionError("the loop never ended with a text answer")

            calls = _at_once(one)
            expect(calls == [TOOL_TURNS + 1] * RUNS, f"model calls per run {calls}")
            return expect_one_program_per_run(programs, calls)
        return run_all

    checks.run("litellm", f"two tool loops of one task (openai/{MODEL})", loop("openai/", f"{gateway_url}/v1"))
    checks.run("litellm", f"two tool loops of one task (anthropic/{MODEL})", loop("anthropic/", gateway_url))


CHECKS: dict[str, Callable[[Checks, str], None]] = {
    "agents": agents_checks, "mini-swe-agent": mini_swe_agent_checks, "litellm": litellm_checks,
}


def agents_setup() -> DemoSetup:
    """Two small fast simworkers that answer with tool calls for a conversation's first turns."""
    return DemoSetup(workers=2, blocks=1024, time_scale=0.02, prefill_scale=1.0,
                     simworker_args=("--tool-call-turns", str(TOOL_TURNS)))


def _mini_swe_agent_home(workdir: Path) -> None:
    """mini-swe-agent keeps a config directory and prints a banner on import: here, and
    quietly, not in the user's home."""
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(workdir / "mini-swe-agent"))
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")


def run(chosen: tuple[str, ...], emit: Callable[[str], None]) -> list[Outcome]:
    emit(f"simworkers answer with tool calls for a conversation's first {TOOL_TURNS} turns")
    return run_on_fleet(agents_setup(), CHECKS, chosen, emit, prepare=_mini_swe_agent_home)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.split("\n\n")[0], LIBRARIES, run)


if __name__ == "__main__":
    sys.exit(main())
