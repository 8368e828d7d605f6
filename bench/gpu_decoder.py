"""The GPU profile's transformer and its timing (bench/gpu_profile.py): a decoder of a given
shape with random weights and a preallocated KV cache, the device it runs on, and the
profiler that times one grid point's steps there. Imports torch only when asked to.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_grid import (
    DecoderShape,
    GridPoint,
    PointSkipped,
    ProfileError,
    UsageError,
    say,
)

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
