"""bench/gpu_profile.py without torch: how a grid point becomes a sample of the engine model,
the order the grid is visited in, the budget that bounds the run, and the exit when torch is
missing. (The timing itself runs in tests/integration/test_gpu_profile.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_profile
from bench.gpu_grid import (
    GRIDS,
    SHAPES,
    GridPoint,
    PointSkipped,
    cached_prefill,
    cold_prefill,
    decode,
    run_grid,
)

ROOT = Path(__file__).resolve().parents[2]


def terms(sample) -> tuple[int, int, int]:
    return sample.prefill_tokens, sample.seqs, sample.context_tokens


def test_each_point_maps_to_the_engine_models_terms() -> None:
    # a cold prefill computes and attends over its own P tokens
    assert terms(cold_prefill(512).sample(0.1)) == (512, 1, 512)
    # behind a cached prefix: P new tokens, context = prefix + P
    point = cached_prefill(256, 4096)
    assert point.cached_tokens == 4096
    assert terms(point.sample(0.1)) == (256, 1, 4352)
    # decode: no prompt tokens, S sequences, S·c context (each c includes its new token)
    point = decode(32, 2048)
    assert point.cached_tokens == 2047
    sample = point.sample(0.02)
    assert (sample.prefill_tokens, sample.seqs, sample.context_tokens, sample.seconds) == (0, 32, 65536, 0.02)
    assert sample.kind == "decode"


def test_llama_shape_is_the_published_one() -> None:
    shape = SHAPES["llama3.1-8b"]
    # 8.03 B parameters and 128 KiB of bf16 KV per token (sim/step_time.py's preset says the same)
    assert round(shape.parameters() / 1e9, 2) == 8.03
    assert shape.kv_bytes_per_token(2) == 131072
    assert shape.group == 4


def test_llama_grid_fits_an_80_gb_gpu_and_stays_within_a_step() -> None:
    grid = GRIDS["llama3.1-8b"]
    kv_bytes = SHAPES["llama3.1-8b"].kv_bytes_per_token(2)
    weights_bytes = SHAPES["llama3.1-8b"].parameters() * 2
    largest = max(p.kv_tokens for p in grid.ordered())
    assert weights_bytes + largest * kv_bytes < 0.9 * 80e9 - 8e9  # room left for activations
    # no prefill computes more than vLLM's default max_num_batched_tokens
    assert max(p.new_tokens for p in grid.cold + grid.cached) == 8192


def test_grid_alternates_kinds_from_small_to_large() -> None:
    order = GRIDS["toy"].ordered()
    assert [p.kind for p in order[:3]] == ["cold prefill", "decode", "cached prefill"]
    assert len(order) == len(set(order)) == sum(len(lane) for lane in
                                                 (GRIDS["toy"].cold, GRIDS["toy"].cached, GRIDS["toy"].decode))
    for kind in ("cold prefill", "cached prefill", "decode"):
        sizes = [(p.seqs * p.new_tokens, p.kv_tokens) for p in order if p.kind == kind]
        assert sizes == sorted(sizes)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_run_grid_skips_points_predicted_to_overrun_and_stops_when_spent() -> None:
    """Steps follow a known linear law; each point costs 10 steps of clock time."""
    clock = FakeClock()
    measured: list[GridPoint] = []

    def step_s(point: GridPoint) -> float:
        sample = point.sample(1.0)
        return 0.01 + 1e-4 * sample.prefill_tokens + 1e-3 * sample.seqs + 1e-6 * sample.context_tokens

    def measure(point: GridPoint, deadline: float) -> float:
        measured.append(point)
        clock.now += 10 * step_s(point)
        return step_s(point)

    # five points first: the fit that predicts the rest has five coefficients
    points = [cold_prefill(64), decode(1, 512), cached_prefill(64, 1024), decode(8, 2048), cold_prefill(256),
              cold_prefill(8192),  # 10 × ~0.83 s: predicted to overrun what is left
              decode(2, 1024), cold_prefill(128)]
    run = run_grid(points, measure, deadline=3.0, clock=clock, steps_per_point=10)
    assert [p for p, _ in run.measured] == measured
    assert cold_prefill(8192) not in measured
    assert dict(run.skipped)[cold_prefill(8192)].startswith("predicted")
    assert decode(2, 1024) in measured and cold_prefill(128) in measured  # smaller ones still fit
    assert all(seconds == pytest.approx(step_s(p)) for p, seconds in run.measured)

    # a budget already spent measures nothing more and names every point left
    clock.now = 5.0
    run = run_grid(points[:3], measure, deadline=3.0, clock=clock, steps_per_point=10)
    assert run.measured == []
    assert [reason for _, reason in run.skipped] == ["the budget was spent"] * 3


def test_run_grid_records_a_point_that_cannot_be_measured() -> None:
    def measure(point: GridPoint, deadline: float) -> float:
        if point.kind == "decode":
            raise PointSkipped("needs ~40.0 GiB, 30.0 GiB free")
        return 0.01

    run = run_grid([cold_prefill(64), decode(256, 8192)], measure, deadline=10.0, clock=FakeClock(),
                   steps_per_point=9)
    assert [p for p, _ in run.measured] == [cold_prefill(64)]
    assert run.skipped == [(decode(256, 8192), "needs ~40.0 GiB, 30.0 GiB free")]


def test_without_torch_it_exits_2_and_says_why(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    status = gpu_profile.main(["--device", "cpu", "--shape", "toy", "--out", str(tmp_path / "p.yaml")])
    assert status == 2
    assert "PyTorch is not installed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        gpu_profile.main(["--device", "cpu"])  # nowhere to write anything
    assert exit_.value.code == 2
    assert "nothing to write" in capsys.readouterr().err


def test_measuring_needs_only_torch_and_numpy(tmp_path) -> None:
    """A GPU image may have torch and numpy but not the project's pydantic and PyYAML: the
    module and its measuring path import neither, so without torch as well the only thing it
    misses is torch."""
    code = ("import sys; sys.modules.update(pydantic=None, yaml=None, torch=None); "
            "from bench.gpu_profile import main; "
            f"sys.exit(main(['--device', 'cpu', '--samples-out', {str(tmp_path / 's.json')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "PyTorch is not installed" in proc.stderr


def test_a_preset_without_its_writer_exits_2_before_measuring(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "sim.preset_file", None)  # as where pydantic is missing
    monkeypatch.setitem(sys.modules, "torch", None)  # would fail later: the writer is checked first
    status = gpu_profile.main(["--device", "cpu", "--out", str(tmp_path / "p.yaml")])
    assert status == 2
    err = capsys.readouterr().err
    assert "--samples-out" in err and "--from-samples" in err
    assert list(tmp_path.iterdir()) == []
