"""bench/gpu_profile.py for real, at the toy shape on a CPU: torch lives in vLLM's venv (not in
the project's), so the profiler runs there as a subprocess, as it would on a GPU machine, and
its preset is read here with the project's strict reader.

The machine may be busy: the growth checks compare each point's least disturbed step (the
profiler keeps every timed step) and ask for a wide margin, far inside what the toy's
arithmetic gives (a 1024-token prefill does ~30× the work of a 32-token one).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import gpu_profile
from bench.gpu_grid import GRIDS
from sim.preset_file import read_preset_file
from tests.support.vllm_venv import ROOT, run_check, vllm_env, vllm_python

BUDGET_S = 60


@dataclass(frozen=True)
class ToyRun:
    preset: Path
    samples: dict
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> ToyRun:
    out = tmp_path_factory.mktemp("gpu_profile")
    command = [str(vllm_python()), "-m", "bench.gpu_profile", "--device", "cpu", "--shape", "toy",
               "--dtype", "float32", "--budget-s", str(BUDGET_S), "--out", str(out / "toy.yaml"),
               "--samples-out", str(out / "toy.json")]
    proc = subprocess.run(command, check=False, cwd=ROOT, env=vllm_env(), capture_output=True, text=True,
                          timeout=BUDGET_S + 60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ToyRun(out / "toy.yaml", json.loads((out / "toy.json").read_text()), proc.stdout, proc.stderr)


def test_toy_profile_writes_a_measured_preset(toy_run: ToyRun) -> None:
    preset = read_preset_file(toy_run.preset)
    provenance = preset.provenance
    assert provenance.kind == "measured"
    assert "CPU" in provenance.where and "torch 2." in provenance.where and "toy-shaped" in provenance.where
    assert provenance.how.startswith("python -m bench.gpu_profile --device cpu --shape toy")
    # every toy point fits the budget and memory: nothing skipped, all in the fit
    points = len(GRIDS["toy"].ordered())
    assert toy_run.samples["skipped"] == []
    assert provenance.samples == len(toy_run.samples["samples"]) == points
    assert provenance.r_squared is not None and provenance.r_squared <= 1.0
    assert f"R² {provenance.r_squared:.4f}" in toy_run.stdout
    assert provenance.max_relative_error is not None
    for name in ("base_s", "prefill_token_s", "seq_s", "context_token_s"):
        assert getattr(preset, name) >= 0.0, name
    # 2 layers × K and V × 2 KV heads × 64 dims × 4 bytes (float32)
    assert preset.kv_bytes_per_token == 2048
    assert preset.block_size == 16 and preset.kv_capacity_tokens >= 16
    assert toy_run.samples["elapsed_s"] < BUDGET_S


def _least_disturbed(samples: list[dict], kind: str, size) -> dict[int, float]:
    return {size(s): min(s["step_seconds"]) for s in samples if s["kind"] == kind}


def test_toy_step_times_grow_with_prompt_and_context(toy_run: ToyRun) -> None:
    samples = toy_run.samples["samples"]
    for sample in samples:  # the median the fit used is one of the timed steps' median
        assert min(sample["step_seconds"]) <= sample["seconds"] <= max(sample["step_seconds"])
    by_prompt = _least_disturbed(samples, "cold prefill", lambda s: s["prefill_tokens"])
    assert by_prompt[max(by_prompt)] > 3 * by_prompt[min(by_prompt)], by_prompt
    by_context = _least_disturbed(samples, "decode", lambda s: s["context_tokens"])
    assert by_context[max(by_context)] > 3 * by_context[min(by_context)], by_context
    preset = read_preset_file(toy_run.preset)
    assert preset.prefill_token_s > 0 and preset.context_token_s > 0


def test_refitting_the_samples_gives_the_same_preset(toy_run: ToyRun, tmp_path: Path) -> None:
    """The second path (measure where torch is, fit where the project is) agrees with the first."""
    samples_file = tmp_path / "toy.json"
    samples_file.write_text(json.dumps(toy_run.samples))
    assert gpu_profile.main(["--from-samples", str(samples_file), "--out", str(tmp_path / "refit.yaml")]) == 0
    first, refit = read_preset_file(toy_run.preset), read_preset_file(tmp_path / "refit.yaml")
    for name in ("base_s", "prefill_token_s", "seq_s", "context_token_s", "kv_capacity_tokens"):
        assert getattr(refit, name) == pytest.approx(getattr(first, name), rel=1e-9), name
    assert refit.provenance.how.startswith(first.provenance.how)
    assert "fitted by python -m bench.gpu_profile --from-samples" in refit.provenance.how


CACHE_CONSISTENCY = """
import json, torch
from bench.gpu_decoder import RandomDecoder
from bench.gpu_grid import SHAPES
torch.set_num_threads(1)  # threads waiting on each other on a busy machine cost seconds
decoder = RandomDecoder(torch, SHAPES["toy"], device="cpu", dtype=torch.float32, max_positions=128, seed=3)
decoder.check_attention()
tokens = decoder.random_tokens(2, 97)

def logits(chunks, path):
    decoder.prefill_attention = path
    cache, start = decoder.new_cache(2, 97), 0
    with torch.inference_mode():
        for size in chunks:
            out = decoder.forward(tokens[:, start:start + size], cache, start=start)
            start += size
    return out

whole = logits([97], "native")
gaps = {
    "decode after a prefill": (logits([96, 1], "native") - whole).abs().max().item(),
    "prefill behind a cached prefix": (logits([40, 57], "native") - whole).abs().max().item(),
    "expanded K/V": (logits([40, 57], "expanded") - whole).abs().max().item(),
    "another cache's leftovers": (logits([97], "native") - whole).abs().max().item(),
}
print("RESULT" + json.dumps({"gaps": gaps, "scale": whole.abs().max().item()}))
"""


def test_the_kv_cache_gives_what_one_whole_prefill_gives() -> None:
    """The decoder is a transformer with a working cache: a decode step after a prefill, or a
    prefill behind a cached prefix (either attention path), yields the logits of computing the
    whole sequence at once. (new_cache fills with random values, so a step that read cache
    positions it should not would show.)"""
    result = run_check(CACHE_CONSISTENCY)
    assert result["scale"] > 1e-3
    for what, gap in result["gaps"].items():
        assert gap < 1e-4 * max(1.0, result["scale"]), (what, gap)
