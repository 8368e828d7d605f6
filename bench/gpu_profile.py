"""Measure the step-time surface of a Llama-3.1-8B-shaped transformer and fit the engine model.

``python -m bench.gpu_profile --out preset.yaml`` builds a decoder with the public shape of
Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 query heads ×
128 dims, 8 KV heads (grouped-query attention), SwiGLU MLP of 14336, vocabulary 128256,
RMSNorm, RoPE with θ = 500000, untied embeddings) with random bf16 weights in PyTorch, times
real forward steps on one GPU, fits ``step_s = base_s + prefill_token_s·P + seq_s·S +
context_token_s·C`` (sim/calibration.py) and writes a preset with provenance "measured"
(sim/preset_file.py). Each timed step becomes one sample in the engine model's terms:

- a cold prefill of P tokens (one sequence): P = P, S = 1, C = P;
- a prefill of P new tokens behind a cached prefix of N tokens: P = P, S = 1, C = N + P;
- a decode step of S sequences, each attending over c tokens (its new one included):
  P = 0, S = S, C = S·c (the engine model counts decode tokens under S, not P).

The whole run, from importing torch to writing the preset, stays inside ``--budget-s``: the
grid is visited small points first, alternating between the three kinds, and a point whose
predicted time no longer fits is skipped (and named). What it leaves out (vLLM's scheduler,
sampling, paged-attention kernels) is in docs/design-notes.md, "GPU profile".

Where the Python that has torch lacks pydantic (the preset writer's), measure with
``--samples-out samples.json`` there and fit elsewhere with ``--from-samples samples.json
--out preset.yaml``. Exit status: 0 done, 1 the run failed, 2 bad usage or a missing library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.calibration import FitError, StepSample, StepTimeFit, fit_step_time
from sim.step_time import Provenance, StepTimeModel

SAMPLES_FORMAT = "sluice gpu_profile samples v1"
# vLLM's default gpu_memory_utilization: the share of the device the engine may take
MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16


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
    if len(run.measured) < 4:
        return None
    try:
        fit = fit_step_time(run.samples())
    except FitError:
        return None
    # 1.5×: the fit so far extrapolates to a larger point, and setting a point up costs too
    return 1.5 * steps * fit.predict(point.sample(1.0))


# -- the transformer ------------------------------------------------------------------------


def import_torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise UsageError(f"PyTorch is not installed in this Python ({sys.executable}): {err}. "
                         "bench/gpu_profile.py times a real transformer and needs torch; run it "
                         "with a Python that has it (on a GPU machine, its CUDA build).") from None
    return torch


class RandomDecoder:
    """A decoder-only transformer of ``shape`` with random weights and a preallocated KV cache
    per sequence: no paging, but every step reads and writes the cache it would in an engine.

    QKV and gate/up projections are single fused matrices, as vLLM runs them; logits are
    computed only for each sequence's last position, the one an engine samples from.
    """

    def __init__(self, torch: Any, shape: DecoderShape, *, device: str, dtype: Any,
                 max_positions: int, seed: int) -> None:
        self.torch, self.shape, self.device, self.dtype = torch, shape, device, dtype
        self.functional = torch.nn.functional
        from torch.nn.attention.bias import causal_lower_right
        self.causal_lower_right = causal_lower_right
        generator = torch.Generator(device=device).manual_seed(seed)

        def weight(*size: int) -> Any:
            # N(0, 0.02) keeps activations finite through the layers; the values do not change
            # the work a step does
            return torch.empty(size, device=device, dtype=dtype).normal_(0.0, 0.02, generator=generator)

        def ones(size: int) -> Any:
            return torch.ones(size, device=device, dtype=dtype)

        heads_dim = shape.query_heads * shape.head_dim
        kv_dim = shape.kv_heads * shape.head_dim
        self.embedding = weight(shape.vocab, shape.hidden)
        self.layers = [
            {"attention_norm": ones(shape.hidden), "qkv": weight(heads_dim + 2 * kv_dim, shape.hidden),
             "out": weight(shape.hidden, heads_dim), "mlp_norm": ones(shape.hidden),
             "gate_up": weight(2 * shape.mlp_hidden, shape.hidden), "down": weight(shape.hidden, shape.mlp_hidden)}
            for _ in range(shape.layers)]
        self.final_norm = ones(shape.hidden)
        self.lm_head = weight(shape.vocab, shape.hidden)
        # the RoPE rotation of every position the grid reaches, computed once as engines do
        inverse_frequency = 1.0 / (shape.rope_theta ** (
            torch.arange(0, shape.head_dim, 2, device=device, dtype=torch.float32) / shape.head_dim))
        angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32),
                             inverse_frequency)
        self.cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
        self.sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
        # how a prefill's queries meet the grouped KV heads: chosen by check_attention()
        self.prefill_attention = "native"

    def attention_kernels(self) -> contextlib.AbstractContextManager[Any]:
        """On a GPU, attention may only run on a fused kernel: a call none of them takes
        fails (and check_attention() then picks the other path) rather than falling back to
        the unfused one, which materialises every score and would time something no engine
        runs. A CPU has no such kernels to insist on."""
        if self.device != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.CUDNN_ATTENTION])

    def new_cache(self, seqs: int, length: int) -> tuple[Any, Any]:
        """K and V for ``seqs`` sequences of ``length`` tokens: [layers, seqs, kv heads, length,
        head dim] each, filled with finite values (uninitialised memory may hold NaNs or, on a
        CPU, denormals that slow the arithmetic down)."""
        size = (self.shape.layers, seqs, self.shape.kv_heads, length, self.shape.head_dim)
        return tuple(self.torch.empty(size, device=self.device, dtype=self.dtype).uniform_(-1.0, 1.0)
                     for _ in range(2))

    def random_tokens(self, seqs: int, length: int) -> Any:
        return self.torch.randint(0, self.shape.vocab, (seqs, length), device=self.device)

    def forward(self, tokens: Any, cache: tuple[Any, Any], start: int) -> Any:
        """One engine step: ``tokens`` [seqs, new] at positions ``start``…, their K/V written
        into ``cache`` after the ``start`` cached ones; the logits of each last position."""
        f = self.functional
        x = f.embedding(tokens, self.embedding)
        with self.attention_kernels():
            x = self._layers(x, cache, start)
        return f.linear(self._rms_norm(x[:, -1], self.final_norm), self.lm_head)

    def _layers(self, x: Any, cache: tuple[Any, Any], start: int) -> Any:
        f, shape = self.functional, self.shape
        seqs, new = x.shape[:2]
        keys_cache, values_cache = cache
        cos, sin = self.cos[start:start + new], self.sin[start:start + new]
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["attention_norm"])
            q, k, v = f.linear(h, layer["qkv"]).split(
                [shape.query_heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                 shape.kv_heads * shape.head_dim], dim=-1)
            q = self._rotate(q.view(seqs, new, shape.query_heads, shape.head_dim).transpose(1, 2), cos, sin)
            k = self._rotate(k.view(seqs, new, shape.kv_heads, shape.head_dim).transpose(1, 2), cos, sin)
            v = v.view(seqs, new, shape.kv_heads, shape.head_dim).transpose(1, 2)
            keys_cache[index, :, :, start:start + new] = k
            values_cache[index, :, :, start:start + new] = v
            keys = keys_cache[index, :, :, :start + new]
            values = values_cache[index, :, :, :start + new]
            attended = self.attend(q, keys, values, start)
            x = x + f.linear(attended.transpose(1, 2).reshape(seqs, new, -1), layer["out"])
            gate, up = f.linear(self._rms_norm(x, layer["mlp_norm"]), layer["gate_up"]).chunk(2, dim=-1)
            x = x + f.linear(f.silu(gate) * up, layer["down"])
        return x

    def attend(self, q: Any, keys: Any, values: Any, start: int) -> Any:
        """Causal attention of q [seqs, query heads, new, d] over keys/values [seqs, KV heads,
        start + new, d], the new tokens at the end."""
        f, shape = self.functional, self.shape
        seqs, _, new, dim = q.shape
        if new == 1:
            # A decode query sees every key. The query heads that share a KV head are laid
            # along the query axis, so each KV head is read once, as decode kernels do.
            grouped = q.reshape(seqs, shape.kv_heads, shape.group, dim)
            return f.scaled_dot_product_attention(grouped, keys, values).reshape(seqs, -1, 1, dim)
        if self.prefill_attention == "expanded":
            keys = keys.repeat_interleave(shape.group, dim=1)
            values = values.repeat_interleave(shape.group, dim=1)
            grouped_query = {}
        else:
            grouped_query = {"enable_gqa": True}
        if start == 0:
            return f.scaled_dot_product_attention(q, keys, values, is_causal=True, **grouped_query)
        # behind a cached prefix the causal mask is aligned to the last key (lower right)
        return f.scaled_dot_product_attention(q, keys, values, attn_mask=self.causal_lower_right(new, start + new),
                                              **grouped_query)

    def _rms_norm(self, x: Any, weight: Any) -> Any:
        x32 = x.float()
        normed = x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps)
        return normed.to(self.dtype) * weight

    def _rotate(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        return x * cos + self.torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def check_attention(self) -> None:
        """Run each attention path on a small input against a plain reference (float32,
        heads expanded, the mask built by hand) before timing anything: a kernel that fails or
        computes something else must not be timed. A prefill uses the backend's grouped-query
        attention where it passes, else K/V expanded to every query head (counted in the
        steps' time; said on stderr and in the provenance)."""
        torch, shape = self.torch, self.shape
        generator = torch.Generator(device=self.device).manual_seed(1)
        tolerance = 3e-2 if self.dtype in (torch.bfloat16, torch.float16) else 1e-4

        def rand(*size: int) -> Any:
            return torch.randn(size, device=self.device, dtype=torch.float32, generator=generator).to(self.dtype)

        def reference(q: Any, keys: Any, values: Any, start: int) -> Any:
            keys = keys.float().repeat_interleave(shape.group, dim=1)
            values = values.float().repeat_interleave(shape.group, dim=1)
            scores = q.float() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
            new, total = q.shape[-2], keys.shape[-2]
            allowed = torch.arange(total, device=self.device)[None, :] \
                <= (start + torch.arange(new, device=self.device))[:, None]
            return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values

        def mismatch(new: int, start: int, seqs: int = 1) -> str | None:
            q = rand(seqs, shape.query_heads, new, shape.head_dim)
            keys = rand(seqs, shape.kv_heads, start + new, shape.head_dim)
            values = rand(seqs, shape.kv_heads, start + new, shape.head_dim)
            try:
                with self.attention_kernels():
                    got = self.attend(q, keys, values, start).float()
            except Exception as err:  # noqa: BLE001 - any backend refusal means "not this path"
                return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            error = (got - reference(q, keys, values, start)).abs().max().item()
            return None if error <= tolerance else f"differs from the reference by {error:.3g}"

        failed = mismatch(new=1, start=40, seqs=3)
        if failed:
            raise ProfileError(f"decode attention on {self.device} {failed}")
        reasons = []
        for path in ("native", "expanded"):
            self.prefill_attention = path
            failed = mismatch(new=16, start=0) or mismatch(new=16, start=40)
            if failed is None:
                if reasons:
                    say(f"prefill attention expands K/V to every query head ({'; '.join(reasons)})")
                return
            reasons.append(f"{path} grouped-query attention: {failed}")
        raise ProfileError(f"prefill attention on {self.device} fails: {'; '.join(reasons)}")


# -- timing on a device ---------------------------------------------------------------------


@dataclass
class Device:
    """Where steps run, how they are timed, and how much memory there is."""

    torch: Any
    name: str  # "cuda" or "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def description(self) -> str:
        if self.is_cuda:
            return self.torch.cuda.get_device_name(0)
        threads = self.torch.get_num_threads()
        return f"CPU ({platform.machine()}, {threads} thread{'' if threads == 1 else 's'})"

    def synchronize(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def memory(self) -> tuple[int, int]:
        """(bytes available to new tensors, total bytes). On a GPU, free memory plus what
        torch's allocator holds unused; on a CPU, the kernel's MemAvailable."""
        if self.is_cuda:
            free, total = self.torch.cuda.mem_get_info()
            cached = self.torch.cuda.memory_reserved() - self.torch.cuda.memory_allocated()
            return free + cached, total
        return _meminfo("MemAvailable"), _meminfo("MemTotal")

    def time_step(self, step: Callable[[], Any]) -> float:
        """Seconds of one step, started on an idle device."""
        if self.is_cuda:
            self.torch.cuda.synchronize()
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        began = time.perf_counter()
        step()
        return time.perf_counter() - began


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Profiler:
    """Times the grid's points on one device with one model."""

    def __init__(self, device: Device, decoder: RandomDecoder, *, warmup: int, repeats: int,
                 cuda_graphs: bool) -> None:
        self.device, self.decoder, self.warmup, self.repeats = device, decoder, warmup, repeats
        # vLLM replays decode steps as CUDA graphs; eager steps would pay ~1,000 kernel launches
        self.cuda_graphs = cuda_graphs and device.is_cuda
        self.graph_failures: list[str] = []
        self.dtype_bytes = decoder.torch.empty((), dtype=decoder.dtype).element_size()
        # the most memory a step needed beyond weights and KV cache (vLLM's profile run)
        self.peak_activation_bytes = 0
        self.step_seconds: dict[GridPoint, list[float]] = {}

    def _activation_estimate(self, point: GridPoint) -> int:
        shape, tokens = self.decoder.shape, point.seqs * point.new_tokens
        per_token = (4 * shape.hidden + 3 * shape.mlp_hidden
                     + (shape.query_heads + 2 * shape.kv_heads) * shape.head_dim)
        expanded = 0
        if self.decoder.prefill_attention == "expanded" and point.new_tokens > 1:
            expanded = 2 * point.context_each * shape.query_heads * shape.head_dim
        return 2 * (tokens * per_token + expanded) * self.dtype_bytes + point.seqs * shape.vocab * 4

    def measure(self, point: GridPoint, deadline: float) -> float:
        torch, decoder = self.device.torch, self.decoder
        cache_bytes = point.kv_tokens * decoder.shape.kv_bytes_per_token(self.dtype_bytes)
        needed = cache_bytes + self._activation_estimate(point) + (512 << 20)
        available, _ = self.device.memory()
        if needed > available:
            raise PointSkipped(f"needs ~{needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free")
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if self.device.is_cuda else 0
        try:
            with torch.inference_mode():
                cache = decoder.new_cache(point.seqs, point.context_each)
                tokens = decoder.random_tokens(point.seqs, point.new_tokens)

                def step() -> Any:
                    return decoder.forward(tokens, cache, start=point.cached_tokens)

                for _ in range(self.warmup):
                    step()
                if self.cuda_graphs and point.kind == "decode":
                    step = self._as_graph(step, point)
                self.device.synchronize()
                seconds: list[float] = []
                while len(seconds) < self.repeats:
                    seconds.append(self.device.time_step(step))
                    if time.monotonic() >= deadline:
                        break  # the budget ends inside this point: keep what was timed
            if self.device.is_cuda:
                peak = torch.cuda.max_memory_allocated() - before - cache_bytes
                self.peak_activation_bytes = max(self.peak_activation_bytes, peak)
        except torch.cuda.OutOfMemoryError as err:
            raise PointSkipped(f"out of device memory ({str(err).splitlines()[0]})") from None
        except RuntimeError as err:
            # one kernel refusing one shape should not throw away a whole GPU run; it is named
            raise PointSkipped(f"failed: {type(err).__name__}: {str(err).splitlines()[0]}") from None
        finally:
            cache = tokens = step = None  # a captured graph holds its own memory too
            if self.device.is_cuda:
                torch.cuda.empty_cache()  # the next point may need one larger cache
        self.step_seconds[point] = seconds
        return statistics.median(seconds)

    def _as_graph(self, step: Callable[[], Any], point: GridPoint) -> Callable[[], Any]:
        """``step`` captured as a CUDA graph (its replay does the same kernels on the same
        tensors, without launching each); the eager step, named, where capture fails."""
        torch = self.device.torch
        try:
            graph = torch.cuda.CUDAGraph()
            # one run on a side stream first, as capture requires of the allocator
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                step()
        except RuntimeError as err:
            reason = f"{point.label()}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self.graph_failures.append(reason)
            say(f"CUDA graph capture failed, timing this point eagerly ({reason})")
            return step
        return graph.replay


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
        context_token_s=fit.context_token_s, kv_capacity_tokens=measurement.kv_capacity_tokens,
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
          f" + {fit.context_token_s * 1e9:.4g} ns per context token (C)")
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
        "engine model's step time (base + per prompt token + per sequence + per context token) and "
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
        if len(measurement.samples) < 4:
            raise ProfileError(f"{len(measurement.samples)} points measured; the fit needs at least 4 "
                               "(raise --budget-s, or see the skipped points above)")
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
