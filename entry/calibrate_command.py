"""``sluice calibrate``: fit the engine model's step time to a running worker and write it as a
preset file (entry/calibration_driver.py measures and fits; sim/preset_file.py writes).

Progress goes to stderr, the fit to stdout. A worker that cannot be reached, refuses, or
answers something calibration cannot use stops the command with ``error: ...``, exit status 1,
and no file written; bad options exit with status 2.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path

import typer

from entry.usage_error import usage_error
from sim.step_time import Provenance, StepTimeModel

_DEFAULTS = StepTimeModel("defaults", "", 0.0, 0.0, 0.0, 0.0, 1)


def calibrate(
    worker: list[str] = typer.Option(..., "--worker", help="Base URL of a running OpenAI-compatible worker "
                                                           "(vLLM or `sluice simworker`), e.g. http://127.0.0.1:8000. "
                                                           "Repeat it to calibrate workers that share a host "
                                                           "as they run in service: all at once, one preset "
                                                           "fitted to every step (same model and KV pool)."),
    out: Path = typer.Option(..., "--out", help="Preset file to write (YAML; read by --preset-file)."),
    model: str | None = typer.Option(None, "--model", help="Served model to drive; default: the "
                                                              "first one /v1/models lists."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Wall seconds per engine second: measured times are divided "
                                          "by it (a simworker run with --time-scale 5 needs 5 here)."),
    grid: str = typer.Option("full", "--grid", help="full (prompts up to 4096 tokens, decode batches "
                                                    "up to 32) or short (up to 1024 tokens, batches up "
                                                    "to 16; a few minutes on a CPU worker)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a residual plot (PNG) here."),
    name: str | None = typer.Option(None, "--name", help="The preset's name; default: "
                                                            "calibrated-<served model>."),
    where: str | None = typer.Option(None, "--where",
                                        help="What was measured (hardware, engine version); default: "
                                             "the worker URL, served model and KV pool from /metrics."),
    max_num_seqs: int = typer.Option(_DEFAULTS.max_num_seqs, "--max-num-seqs", min=1,
                                     help="The worker's --max-num-seqs (not on /metrics): caps the "
                                          "decode batches and goes into the preset."),
    max_num_batched_tokens: int = typer.Option(
        _DEFAULTS.max_num_batched_tokens, "--max-num-batched-tokens", min=16,
        help="The worker's --max-num-batched-tokens (not on /metrics; vLLM's CPU server defaults to "
             "2048): longer prompts would be prefilled in chunks, so the grid stays below it; goes "
             "into the preset."),
    timeout_s: float = typer.Option(120.0, "--timeout", help="Seconds to wait for any one answer."),
) -> None:
    """Measure a worker's step times (cold prefills, prefills behind a cached prefix, decode
    batches), fit the engine model's coefficients and write them as a measured preset."""
    from entry.calibration_driver import GRIDS, CalibrationError
    from entry.calibration_driver import calibrate as run
    from entry.calibration_report import plot_residuals, report
    from sim.preset_file import write_preset_file

    if grid not in GRIDS:
        raise usage_error(f"--grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    if not time_scale > 0:
        raise usage_error(f"--time-scale must be > 0, got {time_scale}")
    if not timeout_s > 0:
        raise usage_error(f"--timeout must be > 0, got {timeout_s}")

    def progress(line: str) -> None:
        typer.echo(f"calibrate: {line}", err=True)

    try:
        calibration = asyncio.run(run(worker, model=model, grid=GRIDS[grid], time_scale=time_scale,
                                      timeout_s=timeout_s, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, progress=progress))
    except CalibrationError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(report(calibration))
    fit, info = calibration.fit, calibration.info
    workers = calibration.workers or (info,)
    urls = ", ".join(w.url for w in workers)
    how = (f"sluice {shlex.join(sys.argv[1:])}: grid {grid}, {fit.samples} steps, non-negative relative "
           f"least squares; request round trip {calibration.round_trip_s * 1e3:.3f} ms removed from TTFTs")
    preset = StepTimeModel(
        name=name or f"calibrated-{info.model}",
        description=f"fitted to {info.model} at {urls}"
                    + (f", {len(workers)} workers measured at once" if len(workers) > 1 else ""),
        base_s=fit.base_s, prefill_token_s=fit.prefill_token_s, seq_s=fit.seq_s,
        context_token_s=fit.context_token_s, prefill_attention_s=fit.prefill_attention_s,
        kv_capacity_tokens=info.kv_capacity_tokens, block_size=info.block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        provenance=Provenance("measured", where or "; ".join(w.describe() for w in workers), how, r_squared=fit.r_squared,
                              max_relative_error=fit.max_relative_error, samples=fit.samples))
    if plot is not None:
        plot_residuals(calibration, plot)
        progress(f"residual plot: {plot}")
    write_preset_file(preset, out)
    progress(f"wrote {out}")
