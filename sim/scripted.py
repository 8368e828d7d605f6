"""A scripted agent workload both shells play token for token (live-vs-simulated parity).

"One policy, two shells" is only worth something if the gateway on workers does what the
simulator measured. To compare the two, they must play *the same* programs: the same prompt
and output token counts, the same tool times, the same prefix structure. This module fixes
those programs. The live client (tests/support/parity.py) sends them as OpenAI chat
conversations through the gateway to simworkers; the simulator plays them as
:class:`sim.programs.ProgramSpec` objects (:meth:`ScriptedWorkload.make_program`).

A program, fixed by ``(seed, index)``:

- call 0's messages: a system prompt every program shares, then the program's own task
  (a user message whose first word is the program index's own, so no two programs share
  anything past the system prompt);
- after call ``k`` (``output_tokens[k]`` tokens long, ``max_tokens`` in the request), the
  client waits ``tool_s[k]`` seconds, then sends call ``k + 1``: the same messages, the reply
  verbatim as an assistant message, and a tool message of the program's next tool text.

Token counts are exact under the simworker's tokenizer (sim/tokens.py): the texts are words
of three lowercase letters, and the tokenizer cuts a letter run of up to four letters with
its leading space as one piece, so a text of ``n`` words is ``n`` tokens. A chat prompt is
rendered message by message (``<bos>``, then per message its role token, header, content and
``<end>``, then the generation prompt ``<start:assistant>``), and the reply is filler whose
text is its tokens, so call ``k + 1``'s prompt is call ``k``'s prompt and output followed by
the new turn: the token stream of sim/programs.py, whose blocks the simulator hashes per
program (and per family for the shared prefix). The shared prefix is ``<bos>``, the system
message and the user message's role token.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sim.programs import CallSpec, ProgramSpec
from sim.tokens import PseudoTokenizer
from sim.workloads import LogNormal

_LETTERS = string.ascii_lowercase
WORDS = 26 ** 3  # three-letter words
# programs a workload can name: each task starts with the word of its program's index
MAX_PROGRAMS = WORDS


def word(number: int) -> str:
    """The three-letter word numbered ``number`` (0 ≤ number < 26³): one token."""
    if not 0 <= number < WORDS:
        raise ValueError(f"a word number is in [0, {WORDS}), got {number}")
    return _LETTERS[number // 676] + _LETTERS[number // 26 % 26] + _LETTERS[number % 26]


def words(rng: np.random.Generator, count: int) -> str:
    """``count`` random three-letter words: ``count`` tokens."""
    return " ".join(word(int(n)) for n in rng.integers(0, WORDS, count))


@dataclass(frozen=True, slots=True)
class ScriptedProgram:
    """One program as both shells play it. ``prompt_tokens[k]`` is call ``k``'s exact prompt
    length; ``tool_texts[k]`` and ``tool_s[k]`` follow call ``k`` (the last call has none)."""

    session_id: str
    index: int
    task: str
    output_tokens: tuple[int, ...]
    tool_texts: tuple[str, ...]
    tool_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]

    @property
    def calls(self) -> int:
        return len(self.output_tokens)

    def tool_message(self, k: int) -> dict[str, str]:
        """The tool message that follows call ``k``'s reply."""
        return tool_message(k, self.tool_texts[k])


def tool_message(k: int, text: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": f"call-{k}", "content": text}


class ScriptedWorkload:
    """Fixed agent programs (module docstring). Sizes are drawn per program from
    ``numpy.random.default_rng([seed, index])`` in a fixed order, so a program depends on
    ``(seed, index)`` only: the same in both shells, whatever order programs start in."""

    def __init__(
        self,
        seed: int,
        *,
        system_tokens: int = 480,
        task_tokens: tuple[int, int] = (60, 240),
        turns: tuple[int, int] = (5, 10),
        output_tokens: LogNormal = LogNormal(56, 0.4, 16, 128),
        tool_tokens: LogNormal = LogNormal(160, 0.6, 24, 480),
        tool_s: LogNormal = LogNormal(1.5, 0.6, 0.2, 8.0),
    ) -> None:
        if seed < 0:
            raise ValueError(f"seed must be ≥ 0, got {seed}")
        if system_tokens < 1:
            raise ValueError(f"system_tokens must be ≥ 1, got {system_tokens}")
        if not 1 <= task_tokens[0] <= task_tokens[1]:
            raise ValueError(f"task_tokens must be a range of counts ≥ 1, got {task_tokens}")
        if not 1 <= turns[0] <= turns[1]:
            raise ValueError(f"turns must be a range of counts ≥ 1, got {turns}")
        self.seed = seed
        self.system_tokens = system_tokens
        self.task_tokens = task_tokens
        self.turns = turns
        self.output_tokens = output_tokens
        self.tool_tokens = tool_tokens
        self.tool_s = tool_s
        self._tokenizer = PseudoTokenizer()

    @cached_property
    def system_prompt(self) -> str:
        return words(np.random.default_rng([self.seed, 1 << 30]), self.system_tokens)

    def opening(self, program: ScriptedProgram) -> list[dict[str, str]]:
        """Call 0's messages."""
        return self._opening(program.task)

    def _opening(self, task: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task}]

    @cached_property
    def shared_prefix_tokens(self) -> int:
        """Tokens every program's prompt starts with: ``<bos>``, the system message and the
        user message's role token (the task's first word is the program's own)."""
        system = self._tokenizer.render_chat([{"role": "system", "content": self.system_prompt}],
                                             add_generation_prompt=False)
        return len(system) + 1

    def program(self, index: int) -> ScriptedProgram:
        if not 0 <= index < MAX_PROGRAMS:
            raise ValueError(f"index must be in [0, {MAX_PROGRAMS}), got {index}")
        rng = np.random.default_rng([self.seed, index])
        # Drawn in a fixed order so a program depends on (seed, index) only.
        turns = int(rng.integers(self.turns[0], self.turns[1] + 1))
        task_words = int(rng.integers(self.task_tokens[0], self.task_tokens[1] + 1))
        outputs = self.output_tokens.draw_tokens(rng, turns)
        tool_lengths = self.tool_tokens.draw_tokens(rng, turns - 1)
        tool_s = [float(s) for s in self.tool_s.draw(rng, turns - 1)]
        task = " ".join([word(index), words(rng, task_words - 1)]) if task_words > 1 else word(index)
        tool_texts = tuple(words(rng, n) for n in tool_lengths)
        return ScriptedProgram(f"parity-{self.seed}-{index}", index, task, tuple(outputs), tool_texts,
                               tuple(tool_s), self._prompt_lengths(task, outputs, tool_texts))

    def _prompt_lengths(self, task: str, outputs: list[int], tool_texts: tuple[str, ...]
                        ) -> tuple[int, ...]:
        """Each call's exact prompt length. A turn renders on its own (no ``<bos>``) as the
        reply's assistant message and the tool message, then the generation prompt; the
        previous prompt's generation prompt is the reply message's role token, so the turn
        adds its own length less one. The reply stands in as any text of its length:
        filler is its tokens, whatever the words."""
        tokenizer = self._tokenizer
        prompt = len(tokenizer.render_chat(self._opening(task)))
        lengths = [prompt]
        for k, text in enumerate(tool_texts):
            _, reply = tokenizer.filler(outputs[k], 0, leading_space=False)
            turn = [{"role": "assistant", "content": "".join(reply)}, tool_message(k, text)]
            prompt += len(tokenizer.render_chat(turn, opening=False)) - 1
            lengths.append(prompt)
        return tuple(lengths)

    def make_program(self, index: int) -> ProgramSpec:
        """The program as the simulator plays it: its calls' exact token counts and tool
        times on one token stream, the shared prefix as prefix family 0."""
        program = self.program(index)
        calls = [CallSpec(prompt_tokens=program.prompt_tokens[k],
                          output_tokens=program.output_tokens[k],
                          think_s=program.tool_s[k - 1] if k else 0.0)
                 for k in range(program.calls)]
        return ProgramSpec(session_id=program.session_id, calls=calls, index=index, family=0,
                           shared_prefix_tokens=self.shared_prefix_tokens)
