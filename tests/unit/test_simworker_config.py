"""The simworker's engine model from its config: the demo's prefill scaling, vLLM's
--scheduling-policy, --max-num-seqs and --max-model-len."""

from __future__ import annotations

import dataclasses

import pytest

from simworker.worker import DEFAULT_MAX_MODEL_LEN, SimWorker, SimWorkerConfig
from sim.step_time import preset


def test_prefill_scale_multiplies_only_the_prompt_cost_of_the_preset() -> None:
    base = dataclasses.replace(preset("llama3.1-8b-h100"), prefill_attention_s=1.2e-9)
    worker = SimWorker(SimWorkerConfig(preset=base, kv_events=None, prefill_scale=10.0, num_blocks=64))
    try:
        model = worker.engine.model
        # per prompt token and per attention pair: the whole prompt costs 10×
        assert model.prefill_token_s == pytest.approx(10.0 * base.prefill_token_s)
        assert model.prefill_attention_s == pytest.approx(10.0 * base.prefill_attention_s)
        assert (model.base_s, model.context_token_s, model.seq_s) == (
            base.base_s, base.context_token_s, base.seq_s)
    finally:
        worker.close()


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_a_non_positive_prefill_scale_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="prefill_scale"):
        SimWorkerConfig(prefill_scale=scale)


def test_vllms_scheduling_settings_reach_the_engine() -> None:
    default = SimWorker(SimWorkerConfig(kv_events=None, num_blocks=64))
    tuned = SimWorker(SimWorkerConfig(kv_events=None, num_blocks=64, scheduling_policy="priority", max_num_seqs=3))
    assert default.engine.scheduling_policy == "fcfs"  # vLLM's default
    assert default.engine.max_num_seqs == preset("llama3.1-8b-h100").max_num_seqs
    assert (tuned.engine.scheduling_policy, tuned.engine.max_num_seqs) == ("priority", 3)


def test_the_model_length_defaults_past_a_small_pool_and_the_context_is_the_smaller() -> None:
    small = SimWorker(SimWorkerConfig(kv_events=None, num_blocks=65, block_size=32))
    assert small.max_model_len == DEFAULT_MAX_MODEL_LEN and small.context_tokens == 64 * 32
    set_ = SimWorker(SimWorkerConfig(kv_events=None, num_blocks=65, block_size=32, max_model_len=1024))
    assert (set_.max_model_len, set_.context_tokens) == (1024, 1024)


@pytest.mark.parametrize("settings, key", [
    ({"scheduling_policy": "lottery"}, "scheduling_policy"),
    ({"tool_call_turns": -1}, "tool_call_turns"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_bad_settings_are_refused_naming_the_key(settings, key) -> None:
    with pytest.raises(ValueError, match=key):
        SimWorkerConfig(**settings)
