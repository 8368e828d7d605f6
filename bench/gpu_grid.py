"""The GPU profile's grid (bench/gpu_profile.py): the decoder shapes, the points to time on them,
each point as a sample of the engine model, and visiting them within a time budget.

Needs neither torch nor a device: the grid and the budget are tested on their own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sim.calibration import COEFFICIENTS, FitError, StepSample, fit_step_time


def say(message: str) -> None:
    print(f"[gpu_profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class ProfileError(RuntimeError):
    """The run cannot go on (exit 1)."""


class UsageError(RuntimeError):
    """A missing library or impossible arguments (exit 2)."""


# -- the shapes and what to measure on them -------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecoderShape:
    name: str
    layers: int
    hidden: int
    query_heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab: int
    rope_theta: float
    rms_eps: float

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.query_heads // self.kv_heads

    def parameters(self) -> int:
        attention = self.hidden * (self.query_heads + 2 * self.kv_heads) * self.head_dim \
            + self.query_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.mlp_hidden
        per_layer = attention + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def summary(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.query_heads}×{self.head_dim} query / "
                f"{self.kv_heads} KV heads, MLP {self.mlp_hidden}, vocab {self.vocab}")


SHAPES = {
    # meta-llama/Llama-3.1-8B config.json. Its "llama3" RoPE scaling only changes the rotation
    # frequencies, computed once, not the work of a step, so plain RoPE at θ = 500000 stands in.
    "llama3.1-8b": DecoderShape("llama3.1-8b", layers=32, hidden=4096, query_heads=32, kv_heads=8,
                                head_dim=128, mlp_hidden=14336, vocab=128256, rope_theta=500000.0,
                                rms_eps=1e-5),
    # small enough for a CPU test, with the same structure (GQA groups of 2)
    "toy": DecoderShape("toy", layers=2, hidden=256, query_heads=4, kv_heads=2, head_dim=64,
                        mlp_hidden=768, vocab=2048, rope_theta=10000.0, rms_eps=1e-5),
}


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One step shape to time: ``seqs`` sequences each computing ``new_tokens`` and attending
    over ``context_each`` tokens (the new ones included)."""

    kind: str  # "cold prefill", "cached prefill" or "decode"
    new_tokens: int
    seqs: int
    context_each: int

    @property
    def cached_tokens(self) -> int:
        """Tokens already in each sequence's KV cache before the step."""
        return self.context_each - self.new_tokens

    @property
    def kv_tokens(self) -> int:
        return self.seqs * self.context_each

    def sample(self, seconds: float) -> StepSample:
        """The step in the engine model's terms (a decode token counts under S, not P)."""
        if self.kind == "decode":
            return StepSample(0, self.seqs, self.kv_tokens, seconds, self.kind)
        return StepSample(self.new_tokens, self.seqs, self.kv_tokens, seconds, self.kind)

    def label(self) -> str:
        if self.kind == "decode":
            return f"decode S={self.seqs} c={self.context_each}"
        if self.kind == "cached prefill":
            return f"prefill P={self.new_tokens} behind {self.cached_tokens} cached"
        return f"prefill P={self.new_tokens}"


def cold_prefill(tokens: int) -> GridPoint:
    return GridPoint("cold prefill", tokens, 1, tokens)


def cached_prefill(tokens: int, prefix: int) -> GridPoint:
    return GridPoint("cached prefill", tokens, 1, prefix + tokens)


def decode(seqs: int, context: int) -> GridPoint:
    return GridPoint("decode", 1, seqs, context)


@dataclass(frozen=True, slots=True)
class Grid:
    cold: tuple[GridPoint, ...]
    cached: tuple[GridPoint, ...]
    decode: tuple[GridPoint, ...]

    def ordered(self) -> list[GridPoint]:
        """Small points first, taking the kinds in turn, so that a budget cut still leaves all
        three kinds (and so every coefficient) measured over a range."""
        lanes = [sorted(lane, key=lambda p: (p.seqs * p.new_tokens, p.kv_tokens))
                 for lane in (self.cold, self.decode, self.cached)]
        order: list[GridPoint] = []
        for rank in range(max(len(lane) for lane in lanes)):
            order.extend(lane[rank] for lane in lanes if rank < len(lane))
        return order


def _decode_points(batches: Sequence[int], contexts: Sequence[int], max_kv_tokens: int
                   ) -> tuple[GridPoint, ...]:
    return tuple(decode(s, c) for s in batches for c in contexts if s * c <= max_kv_tokens)


GRIDS = {
    # Prefills up to vLLM's default max_num_batched_tokens (8192: no step computes more).
    # Decode batches × contexts up to 262,144 tokens of KV = 32 GiB in bf16, so the largest
    # point fits an 80 GB GPU beside the 16 GB of weights; points that do not fit the device
    # at hand are skipped by a memory check.
    "llama3.1-8b": Grid(
        cold=tuple(cold_prefill(p) for p in (128, 512, 1024, 2048, 4096, 8192)),
        cached=(cached_prefill(512, 8192), cached_prefill(512, 32768), cached_prefill(2048, 16384),
                cached_prefill(2048, 32768), cached_prefill(8192, 16384)),
        decode=_decode_points((1, 8, 32, 64, 128, 256), (512, 2048, 8192, 32768), 262_144),
    ),
    # Seconds on two CPU cores. The toy's layers are small beside its attention, so a prefix
    # costs it ~35× more per token than it costs the 8B (whose prefill attention matches its
    # weights' work only past ~32k cached tokens): its prefixes stay short to keep that ratio.
    "toy": Grid(
        cold=tuple(cold_prefill(p) for p in (32, 128, 256, 512, 1024)),
        cached=(cached_prefill(64, 512), cached_prefill(64, 2048), cached_prefill(256, 1024),
                cached_prefill(512, 1024)),
        decode=_decode_points((1, 4, 16, 64), (64, 512, 2048), 65_536),
    ),
}


# -- visiting the grid within the budget ----------------------------------------------------


class PointSkipped(Exception):
    """A point that cannot be measured here (it would not fit in memory, or it failed)."""


@dataclass
class GridRun:
    measured: list[tuple[GridPoint, float]] = field(default_factory=list)
    skipped: list[tuple[GridPoint, str]] = field(default_factory=list)

    def samples(self) -> list[StepSample]:
        return [point.sample(seconds) for point, seconds in self.measured]


def run_grid(points: Sequence[GridPoint], measure: Callable[[GridPoint, float], float], *,
             deadline: float, clock: Callable[[], float], steps_per_point: int) -> GridRun:
    """Measure each point in turn (``measure(point, deadline)`` → median step seconds) while
    the budget lasts. Once four points are in, each next point's time is predicted from a fit
    of those so far, and a point predicted to overrun the deadline is skipped; the first
    points are the smallest, measured without a prediction."""
    run = GridRun()
    for index, point in enumerate(points):
        left = deadline - clock()
        if left <= 0:
            for rest in points[index:]:
                run.skipped.append((rest, "the budget was spent"))
            say(f"budget spent: {len(points) - index} point(s) not measured")
            break
        predicted = _predict_point_s(run, point, steps_per_point)
        if predicted is not None and predicted > left:
            run.skipped.append((point, f"predicted {predicted:.1f} s, {left:.1f} s of budget left"))
            say(f"skip {point.label()}: predicted {predicted:.1f} s, {left:.1f} s of budget left")
            continue
        started = clock()
        try:
            seconds = measure(point, deadline)
        except PointSkipped as skip:
            run.skipped.append((point, str(skip)))
            say(f"skip {point.label()}: {skip}")
            continue
        run.measured.append((point, seconds))
        say(f"{point.label()}: {seconds * 1e3:.3f} ms per step ({clock() - started:.1f} s, "
            f"{max(deadline - clock(), 0.0):.0f} s of budget left)")
    return run


def _predict_point_s(run: GridRun, point: GridPoint, steps: int) -> float | None:
    if len(run.measured) < len(COEFFICIENTS):
        return None
    try:
        fit = fit_step_time(run.samples())
    except FitError:
        return None
    # 1.5×: the fit so far extrapolates to a larger point, and setting a point up costs too
    return 1.5 * steps * fit.predict(point.sample(1.0))
