"""The step-time fit (sim/calibration.py): exact on the model's own steps, non-negative, honest
about its quality."""

from __future__ import annotations

import random

import pytest

from sim.calibration import FitError, StepSample, fit_step_time
from sim.step_time import preset

MODEL = preset("llama3.1-8b-h100")


def _grid(noise: float = 0.0, seed: int = 3) -> list[StepSample]:
    rng = random.Random(seed)
    shapes = [(p, 1, p) for p in (128, 512, 2048, 8192)]                      # cold prefills
    shapes += [(p, 1, p + 4096) for p in (128, 1024)]                           # behind a cached prefix
    shapes += [(0, s, s * c) for s in (1, 8, 32, 128) for c in (512, 4096)]     # decode batches
    return [StepSample(p, s, c, MODEL.step_s(p, s, c) * (1 + rng.uniform(-noise, noise)))
            for p, s, c in shapes]


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
    with pytest.raises(FitError, match="cannot fit"):
        fit_step_time(_grid()[:3])
    with pytest.raises(FitError, match="positive duration"):
        fit_step_time([*_grid(), StepSample(10, 1, 10, 0.0)])
