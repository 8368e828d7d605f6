"""The real-vLLM experiment's live shell (experiments/real_vllm/shells.py) on the session's two
vLLM CPU workers, briefly: programs played in token ids through the gateway come back exactly
as scripted (prompt lengths, answers of max_tokens with their ids), their later calls find
their context cached, and the counters the experiment reads off /metrics move. The experiment
itself (minutes per policy) is run by hand: ``python -m experiments.real_vllm``."""

from __future__ import annotations

import pytest

from experiments.real_vllm.shells import RunSetup, run_live, run_simulated
from experiments.real_vllm.workload import WorkloadShape
from sim.step_time import StepTimeModel
from tests.support.vllm_fleet import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, Fleet

pytestmark = pytest.mark.e2e

SHAPE = WorkloadShape(system_tokens=64, opening_tokens=(128, 256), calls=(2, 4), output_tokens=(8, 16),
                      tool_tokens=(32, 64), tool_s=(0.05, 0.2))
SETUP = RunSetup(seed=3, workers=2, blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, concurrency=6,
                 duration_s=15.0, ramp_s=2.0, shape=SHAPE, scheduling_policy="fcfs",
                 growth_reserve_tokens=32)


def test_programs_in_token_ids_run_as_scripted(fleet: Fleet) -> None:
    assert SHAPE.longest_context() <= MAX_MODEL_LEN
    run = run_live(SETUP, "program_aware", fleet, label="e2e")
    d = run.diagnostics
    assert d["errors"] == 0, d["error_samples"]
    assert run.calls_completed >= 10 and d["programs_completed"] >= 2
    # the answers' ids went back into the next prompts: later calls hit their own blocks
    assert run.cached_tokens > 0 and run.hit_rate > 0.3, run.row()
    assert run.output_tokens > 0 and run.prompt_tokens >= run.cached_tokens
    # the simulator takes the same setup and programs
    model = StepTimeModel("e2e", "a rough CPU model", base_s=0.005, prefill_token_s=3e-5, seq_s=6e-5,
                          context_token_s=6e-7, kv_capacity_tokens=(NUM_BLOCKS - 1) * BLOCK_SIZE,
                          block_size=BLOCK_SIZE, max_num_seqs=128, max_num_batched_tokens=2048)
    simulated = run_simulated(SETUP, "program_aware", model)
    assert simulated.calls_completed > 0 and simulated.hit_rate > 0.3
