"""The scripted parity workload (sim/scripted.py): what the live client sends renders, under the
simworker's tokenizer, to exactly the token counts and prefix structure the simulator plays."""

from __future__ import annotations

import pytest

from sim.scripted import MAX_PROGRAMS, ScriptedWorkload, word
from sim.tokens import FILLER_WORDS, PseudoTokenizer


def _conversation(workload: ScriptedWorkload, index: int) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, reply tokens) of each call, as a simworker would serve the program
    to a client that sends each reply back verbatim: its replies are filler from a point of
    the word cycle it samples, here a different one each call."""
    tokenizer = PseudoTokenizer()
    program = workload.program(index)
    messages = workload.opening(program)
    calls = []
    for k in range(program.calls):
        prompt = tokenizer.render_chat(messages)
        reply, pieces = tokenizer.filler(program.output_tokens[k], (7 * k + index) % len(FILLER_WORDS),
                                         leading_space=False)
        calls.append((prompt, reply))
        if k + 1 < program.calls:
            messages = [*messages, {"role": "assistant", "content": "".join(pieces)},
                        program.tool_message(k)]
    return calls


@pytest.mark.parametrize("index", [0, 1, 7, 25, MAX_PROGRAMS - 1])
def test_each_prompt_has_the_scripted_length_and_extends_the_previous_prompt_and_reply(index):
    workload = ScriptedWorkload(seed=3)
    program = workload.program(index)
    calls = _conversation(workload, index)
    assert [len(prompt) for prompt, _ in calls] == list(program.prompt_tokens)
    assert [len(reply) for _, reply in calls] == list(program.output_tokens)
    for (prompt, reply), (following, _) in zip(calls, calls[1:]):
        assert following[:len(prompt) + len(reply)] == prompt + reply


def test_programs_share_exactly_the_shared_prefix():
    workload = ScriptedWorkload(seed=3)
    tokenizer = PseudoTokenizer()
    openings = [tokenizer.render_chat(workload.opening(workload.program(i))) for i in (0, 1, 2, 676, MAX_PROGRAMS - 1)]
    shared = workload.shared_prefix_tokens
    for other in openings[1:]:
        common = next(i for i, (a, b) in enumerate(zip(openings[0], other)) if a != b)
        assert common == shared


def test_the_simulators_programs_carry_the_scripted_counts_and_tool_times():
    workload = ScriptedWorkload(seed=5)
    for index in range(20):
        program = workload.program(index)
        spec = workload.make_program(index)
        assert spec.session_id == program.session_id and spec.index == index
        assert spec.shared_prefix_tokens == workload.shared_prefix_tokens and spec.family == 0
        assert [c.prompt_tokens for c in spec.calls] == list(program.prompt_tokens)
        assert [c.output_tokens for c in spec.calls] == list(program.output_tokens)
        assert [c.think_s for c in spec.calls] == [0.0, *program.tool_s]
        for before, call in zip(spec.calls, spec.calls[1:]):
            assert call.prompt_tokens > before.prompt_tokens + before.output_tokens


def test_a_program_depends_on_its_seed_and_index_only():
    first, again = ScriptedWorkload(seed=9), ScriptedWorkload(seed=9)
    again.program(40)  # asked for in another order
    assert [first.program(i) for i in (3, 40)] == [again.program(i) for i in (3, 40)]
    assert ScriptedWorkload(seed=10).program(3) != first.program(3)


def test_words_are_one_token_each():
    tokenizer = PseudoTokenizer()
    text = " ".join(word(n) for n in (0, 1, 675, 676, MAX_PROGRAMS - 1))
    assert len(tokenizer.encode(text)) == 5


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="seed"):
        ScriptedWorkload(seed=-1)
    with pytest.raises(ValueError, match="turns"):
        ScriptedWorkload(seed=1, turns=(0, 3))
    with pytest.raises(ValueError, match="task_tokens"):
        ScriptedWorkload(seed=1, task_tokens=(0, 10))
    with pytest.raises(ValueError, match="index"):
        ScriptedWorkload(seed=1).program(MAX_PROGRAMS)
