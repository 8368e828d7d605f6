"""The real-vLLM experiment's programs (experiments/real_vllm/workload.py): the live client's
token ids and the simulator's ProgramSpec are one script, so both shells run the same calls."""

from __future__ import annotations

from experiments.real_vllm.workload import AgentWorkload, WorkloadShape


def test_the_simulated_program_is_the_live_one() -> None:
    shape = WorkloadShape()
    live = AgentWorkload(7, shape, label="program_aware-0")
    for index in range(50):
        program, spec = live.program(index), live.spec(index)
        # the live client's context: system, opening, then each answer and tool result
        context = [*live.system_ids, *program.opening_ids]
        for k, call in enumerate(spec.calls):
            assert call.prompt_tokens == len(context)
            assert call.output_tokens == program.output_tokens[k]
            assert call.think_s == (program.tool_s[k - 1] if k else 0.0)
            if k + 1 < program.calls:
                context += [1] * program.output_tokens[k] + list(program.tool_ids[k])
        assert spec.shared_prefix_tokens == shape.system_tokens == len(live.system_ids)
        assert len(context) + program.output_tokens[-1] <= shape.longest_context()


def test_runs_share_sizes_but_not_tokens() -> None:
    shape = WorkloadShape()
    first, second = AgentWorkload(7, shape, "a"), AgentWorkload(7, shape, "b")
    assert first.system_ids != second.system_ids
    for index in range(10):
        a, b = first.program(index), second.program(index)
        assert (a.output_tokens, a.tool_s, len(a.opening_ids)) == (b.output_tokens, b.tool_s, len(b.opening_ids))
        assert [len(t) for t in a.tool_ids] == [len(t) for t in b.tool_ids]
        assert a.opening_ids != b.opening_ids
    assert AgentWorkload(8, shape).program(0).output_tokens != first.program(0).output_tokens


def test_the_longest_context_is_reached_by_the_largest_draws() -> None:
    shape = WorkloadShape(system_tokens=10, opening_tokens=(5, 20), calls=(1, 3), output_tokens=(2, 4),
                          tool_tokens=(6, 8), tool_s=(0.0, 0.1))
    assert shape.longest_context() == 10 + 20 + 2 * (4 + 8) + 4
