"""The agent programs of the real-vLLM experiment, as token ids for the live run and as
:class:`sim.programs.ProgramSpec` for the simulator: one script, two renderings.

A program is a system prompt every program of the run shares, an opening of its own, then
calls that each append the model's answer and a tool result to the context (append-only, as
an agent loop's transcript grows), with a tool wait before every call but the first. The live
client sends token ids to vLLM's completions route and appends the ids the engine generated
(``return_token_ids``), so the next prompt extends the previous one token for token, as the
simulator's token stream does; text would be re-tokenized, and a random model's answer does
not survive that unchanged. RL rollout frameworks send token ids for the same reason. With
``ignore_eos`` every answer is exactly ``max_tokens`` long, so both shells see the same
prompt and output lengths for every call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim.programs import CallSpec, ProgramSpec

# The tiny model's vocabulary is 1,024 ids (scripts/make_tiny_model.py); ids below 8 are left
# out so that no special token lands in a prompt.
_FIRST_ID, _LAST_ID = 8, 1000


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """The programs' sizes (tokens) and waits (seconds); each range is drawn uniformly.

    The default is a rollout fleet's agent with quick tools (a shell command, a test run in a
    warm sandbox): model calls take longer than the tool calls between them, so most live
    programs are reasoning at any moment and the running calls' contexts alone come near the
    pool. The longest program needs 4,096 tokens, the tiny model's longest context."""

    system_tokens: int = 256
    opening_tokens: tuple[int, int] = (1024, 1536)
    calls: tuple[int, int] = (4, 8)
    output_tokens: tuple[int, int] = (32, 64)
    tool_tokens: tuple[int, int] = (128, 256)
    tool_s: tuple[float, float] = (0.1, 0.5)

    def longest_context(self) -> int:
        """The most tokens one program's last call can hold (prompt and answer)."""
        calls = self.calls[1]
        return (self.system_tokens + self.opening_tokens[1]
                + (calls - 1) * (self.output_tokens[1] + self.tool_tokens[1]) + self.output_tokens[1])


@dataclass(frozen=True, slots=True)
class AgentProgram:
    session_id: str
    index: int
    opening_ids: tuple[int, ...]  # the program's own opening (after the shared system prompt)
    output_tokens: tuple[int, ...]  # max_tokens of each call
    tool_ids: tuple[tuple[int, ...], ...]  # the tool result appended after call k's answer
    tool_s: tuple[float, ...]  # the wait before call k + 1

    @property
    def calls(self) -> int:
        return len(self.output_tokens)

    def prompt_tokens(self, system_tokens: int) -> list[int]:
        """Each call's prompt length: the previous prompt, its answer and the tool result."""
        lengths = [system_tokens + len(self.opening_ids)]
        for k in range(self.calls - 1):
            lengths.append(lengths[-1] + self.output_tokens[k] + len(self.tool_ids[k]))
        return lengths


class AgentWorkload:
    """Program ``i`` of a run is the same for every ``label``, but for its token ids: each
    label (one per live run) draws its own, so no run finds another's blocks cached."""

    def __init__(self, seed: int, shape: WorkloadShape, label: str = "") -> None:
        self.seed = seed
        self.shape = shape
        self.label = label
        ids = random.Random(f"{seed}/{label}/system")
        self.system_ids = tuple(ids.randint(_FIRST_ID, _LAST_ID) for _ in range(shape.system_tokens))

    def program(self, index: int) -> AgentProgram:
        shape = self.shape
        sizes = random.Random(f"{self.seed}/program/{index}")  # the same for every label
        ids = random.Random(f"{self.seed}/{self.label}/ids/{index}")

        def tokens(n: int) -> tuple[int, ...]:
            return tuple(ids.randint(_FIRST_ID, _LAST_ID) for _ in range(n))

        calls = sizes.randint(*shape.calls)
        opening = tokens(sizes.randint(*shape.opening_tokens))
        outputs = tuple(sizes.randint(*shape.output_tokens) for _ in range(calls))
        tools = tuple(tokens(sizes.randint(*shape.tool_tokens)) for _ in range(calls - 1))
        waits = tuple(round(sizes.uniform(*shape.tool_s), 3) for _ in range(calls - 1))
        return AgentProgram(f"agent-{self.seed}-{index}", index, opening, outputs, tools, waits)

    def spec(self, index: int) -> ProgramSpec:
        """Program ``index`` for the simulator: the same lengths and waits; its prompts share
        the system prompt's blocks with every other program (prefix family 0)."""
        program = self.program(index)
        prompts = program.prompt_tokens(self.shape.system_tokens)
        calls = [CallSpec(prompt_tokens=prompts[k], output_tokens=program.output_tokens[k],
                          think_s=program.tool_s[k - 1] if k else 0.0)
                 for k in range(program.calls)]
        return ProgramSpec(session_id=program.session_id, calls=calls, index=index, family=0,
                           shared_prefix_tokens=self.shape.system_tokens)
