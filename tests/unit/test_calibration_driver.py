"""The parts of ``sluice calibrate`` that need no worker: the round trip told apart from the
step time, the mean decode step read off streams that arrive in bursts, and the grid cut to
what a worker takes."""

from __future__ import annotations

import dataclasses
import re

import pytest

from entry.calibration_driver import (
    GRIDS,
    Calibration,
    CalibrationError,
    Measured,
    StreamResult,
    StreamsApart,
    WorkerInfo,
    _decode_sample,
    fit_with_round_trip,
    plan,
)
from entry.calibration_report import report
from sim.calibration import COEFFICIENTS, StepSample
from sim.step_time import preset

# the H100 preset with a prefill attention term (seconds per token pair) as a measured one has
TRUTH = dataclasses.replace(preset("llama3.1-8b-h100"), prefill_attention_s=1.2e-9)
ROUND_TRIP_S = 0.004


def _prefill_s(prefill: int, context: int) -> float:
    return TRUTH.step_s(prefill, 1, context, prefill_pairs=prefill * (context - prefill / 2))


def _ttft(prefill: int, context: int) -> Measured:
    seconds = _prefill_s(prefill, context) + ROUND_TRIP_S
    return Measured(StepSample(prefill, 1, context, seconds, "prefill"), round_trip=True)


def _decode(seqs: int, context: int) -> Measured:
    return Measured(StepSample(0, seqs, context, TRUTH.step_s(0, seqs, context), "decode"), round_trip=False)


def test_the_round_trip_is_fitted_apart_from_base_s() -> None:
    measured = ([_ttft(p, p) for p in (128, 512, 2048, 4096)] + [_ttft(128, 2048), _ttft(512, 1536)]
                + [_decode(s, c) for s in (1, 4, 16, 32) for c in (s * 500, s * 2000)])
    fit, round_trip, steps = fit_with_round_trip(measured)
    assert round_trip == pytest.approx(ROUND_TRIP_S, rel=1e-6)
    for name in COEFFICIENTS:
        assert getattr(fit, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    assert fit.r_squared == pytest.approx(1.0)
    # the steps fitted are the TTFTs less the round trip, the decode steps as measured
    assert steps[0].seconds == pytest.approx(_prefill_s(128, 128))
    assert steps[-1].seconds == measured[-1].sample.seconds


def test_the_mean_decode_step_counts_tokens_that_arrive_in_bursts() -> None:
    # two streams, 10 ms steps; stream a's tokens arrive two at a time, b's one at a time
    # from a step later (its prefill came a step after a's)
    step = 0.010
    a = StreamResult(sent_at=0.0, first_token_at=0.010, prompt_tokens=100,
                     points=[(0.010, 1)] + [(0.010 + step * k, 1 + k) for k in range(2, 40, 2)])
    b = StreamResult(sent_at=0.0, first_token_at=0.020, prompt_tokens=200,
                     points=[(0.010 + step * k, k) for k in range(1, 40)])
    sample = _decode_sample([a, b], time_scale=2.0, what="decode")
    assert sample.sample.seconds == pytest.approx(step / 2.0)
    assert sample.sample.seqs == 2 and sample.sample.prefill_tokens == 0 and not sample.round_trip
    # the window runs from b's first token to a's last: a counts tokens 3..39 in it, b 1..38,
    # so the steps attend over 100 + 20.5 and 200 + 19 tokens on average
    assert sample.sample.context_tokens == 340


def test_streams_that_never_decode_together_are_refused() -> None:
    a = StreamResult(sent_at=0.0, first_token_at=0.01, prompt_tokens=10, points=[(0.01 * k, k) for k in range(1, 20)])
    b = StreamResult(sent_at=0.0, first_token_at=0.5, prompt_tokens=10,
                     points=[(0.5 + 0.01 * k, k) for k in range(1, 20)])
    with pytest.raises(StreamsApart, match="decoded together for fewer than"):
        _decode_sample([a, b], time_scale=1.0, what="decode")


def test_the_grid_fits_a_small_worker() -> None:
    # the e2e fleet's vLLM CPU worker: 64 blocks of 32 tokens, max_model_len 1024
    info = WorkerInfo("http://w", "tiny", "vllm", 1024, 64, 32)
    the_plan = plan(GRIDS["short"], info, max_num_seqs=128, max_num_batched_tokens=2048)
    grid = GRIDS["short"]
    assert the_plan.longest + grid.decode_tokens <= 1024
    assert max(the_plan.cold) == the_plan.longest
    assert all(prefix + max(new) <= the_plan.longest for prefix, new in the_plan.cached)
    usable = int(63 * 0.85)
    for seqs, context in the_plan.decode:
        assert -(-context // 32) + seqs * 3 <= usable
    assert (16, 480) not in the_plan.decode and any("16 × 480" in note for note in the_plan.skipped)
    # a prompt longer than the batched-token budget would be prefilled in chunks: the grid stays below
    assert plan(grid, info, max_num_seqs=128, max_num_batched_tokens=256).longest == 256


def _calibration(measured: list[Measured]) -> Calibration:
    fit, round_trip, steps = fit_with_round_trip(measured)
    info = WorkerInfo("http://w", "tiny", "vllm", 1024, 64, 32)
    the_plan = plan(GRIDS["short"], info, max_num_seqs=128, max_num_batched_tokens=2048)
    return Calibration(info, the_plan, measured, fit, round_trip, steps)


def test_the_report_gives_each_coefficient_its_unit_and_the_fit_without_prefill_attention() -> None:
    pair_s = 5e-8  # seconds per (new token, context token) pair, as vLLM CPU's tiny model shows
    shapes = [(p, p) for p in (64, 256, 512, 960)] + [(80, 560), (260, 740)]
    measured = [Measured(StepSample(p, 1, c, TRUTH.step_s(p, 1, c) + pair_s * p * (c - p / 2)
                                    + ROUND_TRIP_S, "prefill"), round_trip=True) for p, c in shapes]
    measured += [_decode(s, s * c) for s in (1, 4, 8) for c in (160, 520)]
    calibration = _calibration(measured)
    assert calibration.fit.prefill_attention_s == pytest.approx(pair_s, rel=1e-6)
    text = report(calibration)
    assert "prefill_attention_s" in text and "50 ns/token pair" in text
    assert "R² 1.0000" in text
    without = re.search(r"without prefill attention \(prefill_attention_s held at 0\): R² ([0-9.]+)", text)
    assert without is not None and float(without.group(1)) < 0.99, text
