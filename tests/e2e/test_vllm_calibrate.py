"""``sluice calibrate --grid short`` on a real vLLM CPU worker (the session's fleet: the tiny
dummy-weight model, 64 blocks of 32 tokens, max_model_len 1024): the engine model's five
coefficients must explain vLLM's measured step time to R² ≥ 0.95, and the preset must carry
the worker's KV pool as /metrics reports it.

The prefill attention term is what makes 0.95 reachable: this model (hidden 256, two layers)
spends about as long on attention as on its matmuls at 960-token prompts, which a model that
prices attention by ``C`` alone cannot follow (its fit reached R² 0.92–0.99 over 17 runs, 7 of
them below 0.95). The report still prints the fit without the term, so a run shows what it
adds (docs/design-notes.md, "Calibration")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sim.preset_file import read_preset_file
from tests.support.vllm_fleet import BLOCK_SIZE, CAPACITY_TOKENS, MODEL_NAME, Fleet

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# vLLM's defaults for its OpenAI server on CPU (vllm/engine/arg_utils.py): the grid keeps
# prompts under the batched-token budget so that no prefill is chunked.
CPU_MAX_NUM_SEQS = 128
CPU_MAX_NUM_BATCHED_TOKENS = 2048


def test_calibrate_fits_a_vllm_cpu_worker(fleet: Fleet, tmp_path: Path) -> None:
    worker = fleet["w1"]
    out, plot = tmp_path / "vllm-cpu.yaml", tmp_path / "residuals.png"
    result = subprocess.run(
        [sys.executable, "-m", "entry.cli", "calibrate", "--worker", worker.url, "--out", str(out),
         "--grid", "short", "--plot", str(plot), "--max-num-seqs", str(CPU_MAX_NUM_SEQS),
         "--max-num-batched-tokens", str(CPU_MAX_NUM_BATCHED_TOKENS)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    fitted = read_preset_file(out)
    assert fitted.provenance.kind == "measured"
    assert fitted.provenance.r_squared is not None and fitted.provenance.r_squared >= 0.95, result.stdout
    assert "without prefill attention (prefill_attention_s held at 0): R² " in result.stdout
    # the tiny model's prefills spend a share of their time on attention: the fit finds the term
    assert fitted.prefill_attention_s > 0, result.stdout
    assert fitted.kv_capacity_tokens == CAPACITY_TOKENS and fitted.block_size == BLOCK_SIZE
    assert MODEL_NAME in fitted.provenance.where
    # a real engine's step costs something per step and per prompt token
    assert fitted.base_s > 0 and fitted.prefill_token_s > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
