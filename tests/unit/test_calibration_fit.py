"""The step-time fit (sim/calibration.py): exact on the model's own steps (all five terms),
non-negative, honest about its quality."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sim.calibration import COEFFICIENTS, FitError, StepSample, fit_step_time, r_squared_without_prefill_attention
from sim.step_time import StepTimeModel, preset

MODEL = preset("llama3.1-8b-h100")
# the H100 preset with Llama-3.1-8B's attention FLOPs (4 · 32 layers · 4096 per pair) at 45% MFU
WITH_ATTENTION = dataclasses.replace(MODEL, prefill_attention_s=4 * 32 * 4096 / (989e12 * 0.45))


def _pairs(p: int, c: int) -> float:
    return p * (c - p / 2)


def _grid(noise: float = 0.0, seed: int = 3, model: StepTimeModel = MODEL) -> list[StepSample]:
    rng = random.Random(seed)
    shapes = [(p, 1, p) for p in (128, 512, 2048, 8192)]                      # cold prefills
    shapes += [(p, 1, p + 4096) for p in (128, 1024)]                           # behind a cached prefix
    shapes += [(0, s, s * c) for s in (1, 8, 32, 128) for c in (512, 4096)]     # decode batches
    return [StepSample(p, s, c, model.step_s(p, s, c, prefill_pairs=_pairs(p, c))
                       * (1 + rng.uniform(-noise, noise)))
            for p, s, c in shapes]


def test_a_samples_prefill_pairs_are_its_new_tokens_over_the_context_before_them():
    # 100 new tokens behind 400 cached: token i attends over 400 + i + 1 positions, 450.5 on average
    assert StepSample(100, 1, 500, 0.1).prefill_pairs == 100 * (400 + 100 / 2)
    assert StepSample(256, 1, 256, 0.1).prefill_pairs == 256 * 256 / 2
    assert StepSample(0, 8, 4000, 0.01).prefill_pairs == 0.0
    assert StepSample(100, 1, 500, 0.1).features() == (1.0, 100.0, 1.0, 500.0, 45_000.0)
    assert len(COEFFICIENTS) == len(StepSample(1, 1, 1, 0.1).features())


def test_a_five_coefficient_surface_is_recovered_exactly():
    samples = _grid(model=WITH_ATTENTION)
    fit = fit_step_time(samples)
    for name, value in fit.coefficients().items():
        assert value == pytest.approx(getattr(WITH_ATTENTION, name), rel=1e-6), name
    assert fit.r_squared == pytest.approx(1.0) and fit.max_relative_error < 1e-9
    assert [fit.predict(s) for s in samples] == pytest.approx([s.seconds for s in samples], rel=1e-9)
    # held at 0, the term's share shows as variance the other four cannot explain
    assert r_squared_without_prefill_attention(samples) < 1.0 - 1e-6


def test_the_models_own_steps_give_back_its_coefficients():
    fit = fit_step_time(_grid())
    for name, value in fit.coefficients().items():
        assert value == pytest.approx(getattr(MODEL, name), rel=1e-6), name
    assert fit.r_squared == pytest.approx(1.0) and fit.max_relative_error < 1e-9


def test_noise_of_two_percent_moves_no_coefficient_that_matters_by_more_than_ten():
    fit = fit_step_time(_grid(noise=0.02))
    assert fit.base_s == pytest.approx(MODEL.base_s, rel=0.1)
    assert fit.prefill_token_s == pytest.approx(MODEL.prefill_token_s, rel=0.1)
    assert fit.context_token_s == pytest.approx(MODEL.context_token_s, rel=0.1)
    assert fit.max_relative_error <= 0.03 and fit.r_squared > 0.99


def test_no_coefficient_comes_out_negative():
    # steps that get *faster* with more sequences would need a negative seq_s
    samples = [StepSample(0, s, 1000, 0.010 - 0.00001 * s) for s in (1, 10, 50, 100)]
    samples += [StepSample(p, 1, p, 0.010 + 1e-5 * p) for p in (100, 1000)]
    fit = fit_step_time(samples)
    assert min(fit.coefficients().values()) >= 0.0
    assert fit.seq_s == 0.0


def test_too_few_or_meaningless_samples_are_refused():
    with pytest.raises(FitError, match="4 samples cannot fit 5 coefficients"):
        fit_step_time(_grid()[:4])
    with pytest.raises(FitError, match="positive duration"):
        fit_step_time([*_grid(), StepSample(10, 1, 10, 0.0)])
    with pytest.raises(FitError, match="a context that holds its prompt tokens"):
        fit_step_time([*_grid(), StepSample(10, 1, 5, 0.01)])
