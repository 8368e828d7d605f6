"""Measure the step-time surface of a Llama-3.1-8B-shaped transformer and fit the engine model.

``python -m bench.gpu_profile --out preset.yaml`` builds a decoder with the public shape of
Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 query heads ×
128 dims, 8 KV heads (grouped-query attention), SwiGLU MLP of 14336, vocabulary 128256,
RMSNorm, RoPE with θ = 500000, untied embeddings) with random bf16 weights in PyTorch, times
real forward steps on one GPU, fits ``step_s = base_s + prefill_token_s·P + seq_s·S +
context_token_s·C + prefill_attention_s·P·(C − P/2)`` (sim/calibration.py) and writes a preset
with provenance "measured" (sim/preset_file.py). Each timed step becomes one sample in the
engine model's terms:

- a cold prefill of P tokens (one sequence): P = P, S = 1, C = P;
- a prefill of P new tokens behind a cached prefix of N tokens: P = P, S = 1, C = N + P;
- a decode step of S sequences, each attending over c tokens (its new one included):
  P = 0, S = S, C = S·c (the engine model counts decode tokens under S, not P).

The whole run, from importing torch to writing the preset, stays inside ``--budget-s``: the
grid is visited small points first, alternating between the three kinds, and a point whose
predicted time no longer fits is skipped (and named). What it leaves out (vLLM's scheduler,
sampling, paged-attention kernels) is in docs/design-notes.md, "GPU profile".

The grid and its budget are bench/gpu_grid.py; the transformer and its timing
bench/gpu_decoder.py; this module runs them, fits and writes.

Where the Python that has torch lacks pydantic (the preset writer's), measure with
``--samples-out samples.json`` there and fit elsewhere with ``--from-samples samples.json
--out preset.yaml``. Exit status: 0 done, 1 the run failed, 2 bad usage or a missing library.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_decoder import Device, Profiler, RandomDecoder, import_torch
from bench.gpu_grid import GRIDS, SHAPES, ProfileError, UsageError, run_grid, say
from sim.calibration import COEFFICIENTS, FitError, StepSample, StepTimeFit, fit_step_time
from sim.step_time import Provenance, StepTimeModel

SAMPLES_FORMAT = "sluice gpu_profile samples v1"
# vLLM's default gpu_memory_utilization: the share of the device the engine may take
MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16



# -- the whole run --------------------------------------------------------------------------


@dataclass
class Measurement:
    """What a measuring run produced: enough to fit and write a preset anywhere."""

    where: str
    how: str
    device: str
    shape: str
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    kv_capacity_how: str
    samples: list[StepSample]
    step_seconds: list[list[float]]
    skipped: list[tuple[str, str]]
    budget_s: float
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SAMPLES_FORMAT, "where": self.where, "how": self.how, "device": self.device,
            "shape": self.shape,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_capacity_how": self.kv_capacity_how, "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "samples": [{"kind": s.kind, "prefill_tokens": s.prefill_tokens, "seqs": s.seqs,
                         "context_tokens": s.context_tokens, "seconds": s.seconds, "step_seconds": times}
                        for s, times in zip(self.samples, self.step_seconds, strict=True)],
            "skipped": [{"point": label, "reason": reason} for label, reason in self.skipped],
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> Measurement:
        if not isinstance(data, dict) or data.get("format") != SAMPLES_FORMAT:
            raise UsageError(f"{source}: not a samples file of bench/gpu_profile.py "
                             f"(its \"format\" must be {SAMPLES_FORMAT!r})")
        try:
            samples = [StepSample(int(s["prefill_tokens"]), int(s["seqs"]), int(s["context_tokens"]),
                                  float(s["seconds"]), str(s["kind"])) for s in data["samples"]]
            return cls(where=str(data["where"]), how=str(data["how"]), device=str(data["device"]),
                       shape=str(data["shape"]),
                       kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                       kv_capacity_tokens=int(data["kv_capacity_tokens"]),
                       kv_capacity_how=str(data["kv_capacity_how"]),
                       samples=samples, step_seconds=[list(s["step_seconds"]) for s in data["samples"]],
                       skipped=[(str(s["point"]), str(s["reason"])) for s in data["skipped"]],
                       budget_s=float(data["budget_s"]), elapsed_s=float(data["elapsed_s"]))
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(f"{source}: a samples file with a missing or malformed entry ({err!r})") from None


def measure(args: argparse.Namespace, command: str) -> Measurement:
    began = time.monotonic()
    deadline = began + args.budget_s - min(10.0, 0.05 * args.budget_s)  # room to fit and write
    torch = import_torch()
    shape, grid = SHAPES[args.shape], GRIDS[args.shape]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"no CUDA device is visible to torch {torch.__version__}; pass --device cpu "
                         "to try the profiler on a CPU (its numbers say nothing about a GPU)")
    device = Device(torch, args.device)
    if not device.is_cuda:
        torch.set_num_threads(args.cpu_threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    points = grid.ordered()
    max_positions = max(p.context_each for p in points)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    weights_bytes = shape.parameters() * dtype_bytes
    available, total = device.memory()
    say(f"{device.description()}, torch {torch.__version__}; {shape.name}-shaped decoder ({shape.summary()}): "
        f"{shape.parameters() / 1e6:,.1f} M parameters, {weights_bytes / 2**30:.2f} GiB in {args.dtype}; "
        f"{available / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    if weights_bytes > 0.9 * available:
        raise ProfileError(f"the weights need {weights_bytes / 2**30:.1f} GiB and only "
                           f"{available / 2**30:.1f} GiB are free on {device.description()}")
    decoder = RandomDecoder(torch, shape, device=args.device, dtype=dtype, max_positions=max_positions,
                            seed=args.seed)
    device.synchronize()
    free_after_weights, total = device.memory()
    decoder.check_attention()
    say(f"weights built; {len(points)} grid points, {args.warmup} warm-up + {args.repeats} timed steps each, "
        f"{max(deadline - time.monotonic(), 0.0):.0f} s of budget left")
    profiler = Profiler(device, decoder, warmup=args.warmup, repeats=args.repeats,
                        cuda_graphs=args.cuda_graphs)
    grid_run = run_grid(points, profiler.measure, deadline=deadline, clock=time.monotonic,
                        steps_per_point=args.warmup + args.repeats)
    say(f"{len(grid_run.measured)} of {len(points)} points measured, {len(grid_run.skipped)} skipped")

    kv_bytes = shape.kv_bytes_per_token(dtype_bytes)
    if device.is_cuda:
        # as vLLM sizes its pool: gpu_memory_utilization × total, less what is in use once the
        # weights are loaded (this process's and any other's), less the peak activations
        pool = MEMORY_UTILIZATION * total - (total - free_after_weights) - profiler.peak_activation_bytes
        capacity_how = (f"{MEMORY_UTILIZATION:.0%} of {total / 2**30:.1f} GiB, less "
                        f"{(total - free_after_weights) / 2**30:.1f} GiB in use after the weights and "
                        f"{profiler.peak_activation_bytes / 2**30:.2f} GiB of peak activations")
    else:
        pool = MEMORY_UTILIZATION * free_after_weights
        capacity_how = (f"{MEMORY_UTILIZATION:.0%} of the {free_after_weights / 2**30:.1f} GiB of host "
                        "memory available after the weights (a CPU has no device memory of its own)")
    kv_capacity = int(pool // kv_bytes)
    if kv_capacity < BLOCK_SIZE:
        raise ProfileError(f"no room for a KV cache: {capacity_how}")
    prefill_attention = ("grouped-query kernel" if decoder.prefill_attention == "native"
                         else "K/V expanded to every query head")
    where = (f"{device.description()}, torch {torch.__version__}, {shape.name}-shaped decoder "
             f"({shape.summary()}), random {args.dtype} weights, prefill attention: {prefill_attention}")
    if profiler.cuda_graphs:
        execution = "decode steps replayed as CUDA graphs"
        if profiler.graph_failures:
            execution += f" (eager at {len(profiler.graph_failures)} point(s) where capture failed)"
        execution += ", prefills eager"
    else:
        execution = "PyTorch eager, no CUDA graphs"
    how = (f"{command}: {execution}; median of {args.repeats} timed steps after {args.warmup} "
           "warm-up")
    if grid_run.skipped:
        how += (f"; {len(grid_run.measured)} of {len(points)} grid points, "
                f"{len(grid_run.skipped)} skipped (budget or memory)")
    return Measurement(
        where=where, how=how, device=device.description(), shape=shape.name, kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=kv_capacity, kv_capacity_how=capacity_how, samples=grid_run.samples(),
        step_seconds=[profiler.step_seconds[point] for point, _ in grid_run.measured],
        skipped=[(point.label(), reason) for point, reason in grid_run.skipped],
        budget_s=args.budget_s, elapsed_s=time.monotonic() - began)


def preset_from(measurement: Measurement, fit: StepTimeFit, *, name: str | None,
                fitted_by: str | None = None) -> StepTimeModel:
    how = measurement.how if fitted_by is None else f"{measurement.how}; fitted by {fitted_by}"
    return StepTimeModel(
        name=name or f"{measurement.shape}-{_slug(measurement.device.split(' (')[0])}-measured",
        description=f"fitted to PyTorch steps of a {measurement.shape}-shaped decoder (bench/gpu_profile.py)",
        base_s=fit.base_s, prefill_token_s=fit.prefill_token_s, seq_s=fit.seq_s,
        context_token_s=fit.context_token_s, prefill_attention_s=fit.prefill_attention_s,
        kv_capacity_tokens=measurement.kv_capacity_tokens,
        block_size=BLOCK_SIZE, kv_bytes_per_token=measurement.kv_bytes_per_token,
        provenance=Provenance("measured", measurement.where, how, r_squared=fit.r_squared,
                              max_relative_error=fit.max_relative_error, samples=fit.samples))


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split()) or "device"


def report_fit(measurement: Measurement, fit: StepTimeFit) -> None:
    """The fit and every sample beside its prediction, on stdout."""
    print(f"fit over {fit.samples} steps: step_s = {fit.base_s * 1e3:.4g} ms"
          f" + {fit.prefill_token_s * 1e6:.4g} us per prompt token (P)"
          f" + {fit.seq_s * 1e6:.4g} us per sequence (S)"
          f" + {fit.context_token_s * 1e9:.4g} ns per context token (C)"
          f" + {fit.prefill_attention_s * 1e9:.4g} ns per prefill attention pair (P·(C − P/2))")
    errors = fit.relative_errors(measurement.samples)
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    print(f"R² {fit.r_squared:.4f}, largest relative error {fit.max_relative_error:.1%} "
          f"({measurement.samples[worst].kind}, P={measurement.samples[worst].prefill_tokens} "
          f"S={measurement.samples[worst].seqs} C={measurement.samples[worst].context_tokens})")
    print(f"KV: {measurement.kv_bytes_per_token} bytes per token, {measurement.kv_capacity_tokens} tokens "
          f"({measurement.kv_capacity_how})")
    print(f"{'kind':<15}{'P':>7}{'S':>6}{'C':>9}{'measured ms':>13}{'fit ms':>10}{'error':>8}")
    for sample, error in zip(measurement.samples, errors, strict=True):
        print(f"{sample.kind:<15}{sample.prefill_tokens:>7}{sample.seqs:>6}{sample.context_tokens:>9}"
              f"{sample.seconds * 1e3:>13.3f}{fit.predict(sample) * 1e3:>10.3f}{error:>8.1%}")
    for label, reason in measurement.skipped:
        print(f"not measured: {label} ({reason})")


def _preset_writer() -> Callable[[StepTimeModel, Path], None]:
    try:
        from sim.preset_file import write_preset_file
    except ImportError as err:
        raise UsageError(
            f"writing a preset needs the project's dependencies (pydantic, PyYAML), missing in "
            f"{sys.executable} ({err}). Measure here with --samples-out FILE and make the preset "
            "with `python -m bench.gpu_profile --from-samples FILE --out preset.yaml` in the "
            "project's venv.") from None
    return write_preset_file


def _write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_profile",
        description="Time forward steps of a Llama-3.1-8B-shaped transformer (random weights) on one "
        "GPU over a grid of prefill lengths, cached prefixes, decode batches and contexts; fit the "
        "engine model's step time (base + per prompt token + per sequence + per context token + per "
        "prefill attention pair) and "
        "write a measured preset for --preset-file. Not part of `make bench`: it needs torch and, "
        "for its real numbers, a GPU.",
        epilog="Examples: `python -m bench.gpu_profile --out preset.yaml` on a GPU machine; "
        "`python -m bench.gpu_profile --device cpu --shape toy --dtype float32 --budget-s 60 --out "
        "toy.yaml` to try it on a CPU; `--samples-out s.json` where torch has no pydantic beside it, "
        "then `--from-samples s.json --out preset.yaml` in the project's venv.")
    parser.add_argument("--out", type=Path, metavar="PRESET", help="write the fitted preset (YAML) here")
    parser.add_argument("--samples-out", type=Path, metavar="SAMPLES",
                        help="also write every measured step (JSON), to keep or to fit elsewhere")
    parser.add_argument("--from-samples", type=Path, metavar="SAMPLES",
                        help="measure nothing: fit a samples file written by --samples-out (no torch needed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: cuda")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama3.1-8b",
                        help="the transformer (default llama3.1-8b; toy is for trying it on a CPU)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                        help="weights, activations and KV cache (default bfloat16)")
    parser.add_argument("--budget-s", type=float, default=480.0, metavar="SECONDS",
                        help="wall-clock budget of the whole run, torch's import included; points "
                        "that would overrun it are skipped and named (default 480)")
    parser.add_argument("--warmup", type=int, default=2, metavar="STEPS", help="untimed steps per point (default 2)")
    parser.add_argument("--repeats", type=int, default=7, metavar="STEPS",
                        help="timed steps per point; the median is kept (default 7)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="replay decode steps as CUDA graphs, as vLLM does (default on; a GPU only)")
    parser.add_argument("--cpu-threads", type=int, default=1, metavar="N",
                        help="torch's threads with --device cpu (default 1: on a shared machine, threads "
                        "that wait for each other at every operator make steps swing by tens of times)")
    parser.add_argument("--name", help="the preset's name (default: SHAPE-DEVICE-measured)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    args = parser.parse_args(argv)
    if args.from_samples is not None and args.out is None:
        parser.error("--from-samples needs --out")
    if args.out is None and args.samples_out is None:
        parser.error("nothing to write: give --out (the preset) and/or --samples-out (the measurements)")
    if args.budget_s <= 0 or args.warmup < 0 or args.repeats < 1 or args.cpu_threads < 1:
        parser.error("--budget-s must be positive, --warmup at least 0, --repeats and --cpu-threads "
                     "at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    command = shlex.join(["python", "-m", "bench.gpu_profile", *(sys.argv[1:] if argv is None else argv)])
    args = parse_args(argv)
    try:
        writer = _preset_writer() if args.out is not None else None
        if args.from_samples is not None:
            try:
                data = json.loads(args.from_samples.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as err:
                raise UsageError(f"{args.from_samples}: cannot read the samples: {err}") from None
            measurement = Measurement.from_json(data, str(args.from_samples))
            fitted_by = command
        else:
            measurement = measure(args, command)
            fitted_by = None
            if args.samples_out is not None:
                _write_json(measurement.to_json(), args.samples_out)
                say(f"wrote {len(measurement.samples)} samples to {args.samples_out}")
        if len(measurement.samples) < len(COEFFICIENTS):
            raise ProfileError(f"{len(measurement.samples)} points measured; the fit needs at least "
                               f"{len(COEFFICIENTS)} (raise --budget-s, or see the skipped points above)")
        fit = fit_step_time(measurement.samples)
        report_fit(measurement, fit)
        if writer is not None:
            writer(preset_from(measurement, fit, name=args.name, fitted_by=fitted_by), args.out)
            say(f"wrote the preset to {args.out} ({measurement.elapsed_s:.0f} s measuring)")
    except UsageError as err:
        print(f"gpu_profile: {err}", file=sys.stderr)
        return 2
    except (ProfileError, FitError) as err:
        print(f"gpu_profile: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
