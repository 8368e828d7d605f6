"""The policies' cost terms from a preset (sim/step_time.py ``policy_cost_terms``, sim/runs.py):
what a model gives, which a policy takes (explicit keys win), and that a run applies them."""

from __future__ import annotations

import pytest

import sim.runs
from scheduler.config import AutellixConfig, ContinuumConfig, ProgramAwareConfig, VllmRouterConfig
from scheduler.config_reading import parse_policy_yaml
from sim.runs import (policy_cost_notes, policy_costs_taken, preset_policy_costs, recorded_policy_costs,
                      run_policies, workload_feed)
from sim.step_time import StepTimeModel, policy_cost_terms, preset, vllm_router_cost_terms

MODEL = StepTimeModel(
    name="hand", description="hand-made terms", base_s=0.010, prefill_token_s=1e-4, seq_s=1e-3,
    context_token_s=1e-7, prefill_attention_s=2e-8, kv_capacity_tokens=1_000_000)


def test_the_cost_terms_are_a_typical_decode_step_and_a_prompt_tokens_share_of_a_step():
    costs = policy_cost_terms(MODEL)
    # a decode step of 64 sequences at 2,048 tokens each: 10 ms + 64 × 1 ms + 131,072 × 0.1 µs
    assert costs["decode_token_s"] == pytest.approx(0.010 + 0.064 + 0.0131072, rel=1e-12)
    # a prompt token: its matmuls, its KV in the context, its attention over 2,048 tokens
    assert costs["prefill_token_s"] == pytest.approx(1e-4 + 1e-7 + 2e-8 * 2048, rel=1e-12)
    # no host link: no reload price
    assert set(costs) == {"decode_token_s", "prefill_token_s", "reload_token_s", *vllm_router_cost_terms(MODEL)}
    assert costs["reload_token_s"] == 0.0


def test_vllm_routers_terms_are_a_whole_prompts_step_and_a_decode_step_of_the_model():
    costs = vllm_router_cost_terms(MODEL)
    # a cold prefill of x thousand tokens is one step of one sequence: step_s(P, 1, P, P²/2)
    for tokens in (1_000, 8_000, 50_000):
        x = tokens / 1000
        predicted = (costs["prefill_intercept_seconds"] + costs["prefill_linear_seconds_per_1k_tokens"] * x
                     + costs["prefill_quadratic_seconds_per_1k_tokens_squared"] * x * x)
        assert predicted == pytest.approx(MODEL.step_s(tokens, 1, tokens, prefill_pairs=tokens * tokens / 2),
                                          rel=1e-12)
    # a decode step of B sequences over C tokens of context
    for seqs, context in ((1, 100), (64, 131_072)):
        predicted = (costs["decode_fixed_step_seconds"] + costs["decode_batch_step_seconds_per_request"] * seqs
                     + costs["decode_context_step_seconds_per_token"] * context)
        assert predicted == pytest.approx(MODEL.step_s(0, seqs, context), rel=1e-12)


def test_the_typical_batch_shrinks_to_what_the_engine_holds():
    small = StepTimeModel("small", "", base_s=0.010, prefill_token_s=1e-4, seq_s=1e-3, context_token_s=1e-7,
                          prefill_attention_s=2e-8, kv_capacity_tokens=4000, max_num_seqs=8)
    costs = policy_cost_terms(small)
    # 8 sequences (max_num_seqs) sharing the 4,000-token pool: 500 tokens of context each
    assert costs["decode_token_s"] == pytest.approx(0.010 + 0.008 + 4000 * 1e-7, rel=1e-12)
    assert costs["prefill_token_s"] == pytest.approx(1e-4 + 1e-7 + 2e-8 * 500, rel=1e-12)


def test_the_h100_preset_gives_about_what_autellix_defaults_to():
    costs = policy_cost_terms(preset("llama3.1-8b-h100"))
    defaults = AutellixConfig()
    assert costs["decode_token_s"] == pytest.approx(defaults.decode_token_s, rel=0.1)
    assert costs["prefill_token_s"] == pytest.approx(defaults.prefill_token_s, rel=0.01)


def test_a_named_preset_gives_only_vllm_routers_cost_terms():
    # autellix's runs on the named presets stay as they were
    assert preset_policy_costs(MODEL, None) == vllm_router_cost_terms(MODEL)
    assert preset_policy_costs(MODEL, "measured.yaml") == policy_cost_terms(MODEL)


def test_a_named_presets_costs_are_recorded_only_for_a_run_of_a_policy_that_takes_them():
    costs = vllm_router_cost_terms(MODEL)
    assert recorded_policy_costs(costs, None, None, ["autellix", "least_loaded"]) is None
    assert recorded_policy_costs(costs, None, None, ["least_loaded", "vllm_router"]) == costs
    assert recorded_policy_costs(costs, "measured.yaml", None, ["least_loaded"]) == costs


def test_a_zero_term_is_taken_by_a_key_that_admits_zero():
    # the named presets carry no prefill attention: vllm_router's quadratic term is 0
    taken = policy_costs_taken(VllmRouterConfig(), {"prefill_quadratic_seconds_per_1k_tokens_squared": 0.0,
                                                    "decode_fixed_step_seconds": 0.0})
    assert taken == {"prefill_quadratic_seconds_per_1k_tokens_squared": 0.0}


def test_keys_the_config_sets_win_and_policies_without_the_keys_take_nothing():
    costs = {"decode_token_s": 0.03, "prefill_token_s": 5e-5}
    assert policy_costs_taken(AutellixConfig(), costs) == costs
    assert policy_costs_taken(AutellixConfig(decode_token_s=0.05), costs) == {"prefill_token_s": 5e-5}
    assert policy_costs_taken(ProgramAwareConfig(), costs) == {}
    # a section carried in another policy's file: its keys are explicit there too
    carried = parse_policy_yaml("policy:\n  name: program_aware\n  autellix:\n    prefill_token_s: 1.0e-4\n")
    assert policy_costs_taken(carried.for_policy("autellix"), costs) == {"decode_token_s": 0.03}
    # a term the preset prices at 0 leaves the configured one (a policy's costs are positive)
    assert policy_costs_taken(AutellixConfig(), {"decode_token_s": 0.03, "prefill_token_s": 0.0}) == \
        {"decode_token_s": 0.03}


def test_the_notes_say_what_each_policy_takes_and_keeps():
    costs = {"decode_token_s": 0.03, "prefill_token_s": 5e-5}
    config = parse_policy_yaml("policy:\n  name: autellix\n  decode_token_s: 0.05\n")
    assert policy_cost_notes(config, ["autellix", "least_loaded"], costs, "the preset file") == [
        "autellix: prefill_token_s 5e-05 from the preset file, decode_token_s 0.05 as configured"]


def test_a_run_gives_autellix_the_costs_it_does_not_set(monkeypatch):
    made: list = []

    def recording_make_policy(config):
        made.append(config)
        return make_policy(config)

    make_policy = sim.runs.make_policy
    monkeypatch.setattr(sim.runs, "make_policy", recording_make_policy)
    costs = {"decode_token_s": 0.03, "prefill_token_s": 5e-5}
    config = parse_policy_yaml("policy:\n  name: program_aware\n  autellix:\n    decode_token_s: 0.05\n")
    run_policies(["autellix", "least_loaded"], lambda: workload_feed("swebench", 2, 7), workers=1,
                 preset=MODEL, duration_s=5, policy_config=config, show_progress=False, policy_costs=costs)
    autellix, least_loaded = made
    assert (autellix.decode_token_s, autellix.prefill_token_s) == (0.05, 5e-5)
    assert least_loaded.name == "least_loaded"
    made.clear()
    run_policies(["autellix"], lambda: workload_feed("swebench", 2, 7), workers=1, preset=MODEL,
                 duration_s=5, show_progress=False)
    assert (made[0].decode_token_s, made[0].prefill_token_s) == (0.02, 3.6e-5)  # no costs: the defaults


def test_the_h100_preset_gives_continuums_defaults_and_continuum_takes_its_terms():
    costs = policy_cost_terms(preset("llama3.1-8b-h100"))
    defaults = ContinuumConfig()
    assert costs["reload_token_s"] == defaults.reload_token_s  # 131,072 KV bytes at 50 GB/s
    assert costs["prefill_token_s"] == pytest.approx(defaults.prefill_token_s, rel=0.01)
    assert costs["decode_token_s"] == pytest.approx(defaults.decode_token_s, rel=0.1)
    assert policy_costs_taken(ContinuumConfig(reload_token_s=1e-6), costs) == {
        "decode_token_s": costs["decode_token_s"], "prefill_token_s": costs["prefill_token_s"]}
