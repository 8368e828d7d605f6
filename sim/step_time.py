"""How long one engine iteration takes: a linear model with named hardware/model presets.

``step_s = base_s + prefill_token_s·P + seq_s·S + context_token_s·C + prefill_attention_s·A``
for an iteration that computes ``P`` prompt tokens, runs ``S`` sequences, attends over ``C``
context tokens in total and whose prefill chunks make ``A`` attention pairs. The terms stand
for: weights read once per step (memory bound), prompt FLOPs (compute bound), per-sequence
overheads (sampling, scheduling), KV reads by attention (memory bound), and the attention
FLOPs of prefill: each of a chunk's ``n`` new tokens attends over the context before it, so a
chunk behind ``c0`` computed tokens makes ``A = n·(c0 + n/2)`` pairs (``P·(C − P/2)`` for a
whole prompt prefilled in one step). ``C`` prices attention by what it reads, right for
decode; ``A`` prices what a prefill computes, which grows with the product of new and old
tokens.

The named presets leave ``prefill_attention_s`` at 0: for Llama-3.1-8B on a GPU it is small
against the matmuls (a new token over 8k of context costs about a quarter more than its
matmuls alone) and no datasheet figure gives its efficiency, so only a measured preset (a
preset file from ``sluice calibrate`` or bench/gpu_profile.py) carries one.

The named presets are derived from public figures, not fitted to measurements (each says so
in its :class:`Provenance`; a measured one is a preset file, sim/preset_file.py):
- NVIDIA H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16; H200: 4.8 TB/s HBM3e, 141 GB,
  same compute (NVIDIA H100 and H200 datasheets).
- Llama-3.1-8B: 8.0 B parameters (16 GB in BF16), 32 layers, 8 KV heads × 128 dims →
  128 KiB of KV per token (meta-llama/Llama-3.1-8B config.json).
- Qwen3-30B-A3B: 30.5 B parameters (61 GB BF16), 3.3 B active per token, 48 layers,
  4 KV heads × 128 dims → 96 KiB of KV per token (Qwen/Qwen3-30B-A3B config.json). At
  agent batch sizes nearly every expert is hit each step, so decode reads all weights.
- Prompt throughput assumes 45% MFU on 2·(active params) FLOPs per token; memory terms
  assume 70% of peak bandwidth; the KV pool is 90% of HBM minus weights (vLLM's
  ``gpu_memory_utilization=0.9``).
- Host KV tier (vLLM's native CPU offloading, ``--kv-offloading-size``; off unless a size is
  given, see sim/host_tier.py): an 8×H100 node such as the DGX H100 carries 2 TB of host DRAM
  (NVIDIA DGX H100 datasheet), 256 GB per GPU; the preset's suggested tier is 200 GiB per GPU,
  leaving the rest to the OS, the processes and pinned staging buffers. Each GPU sits on a PCIe
  Gen5 x16 link: 64 GB/s per direction nominal (PCI-SIG PCIe 5.0: 32 GT/s × 16 lanes,
  128b/130b), of which ≈ 50 GB/s is reached by large pinned-memory copies (cudaMemcpyAsync
  bandwidth tests on H100 report 50–55 GB/s), so the presets take 50 GB/s per direction.
These give ≈ 7 ms decode steps at small batch for 8B on H100 and ≈ 15–25 ms with tens of
thousands of tokens in attention, in line with published vLLM serving measurements for
that class of model. A GPU run can replace them with calibrated ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

_TB = 1e12
# 2 TB of host DRAM per 8-GPU node (DGX H100), less headroom for the OS and processes
_HOST_TIER_GIB_PER_GPU = 200.0
# PCIe Gen5 x16, achievable host↔device copy bandwidth per direction (64 GB/s nominal)
_PCIE_GEN5_X16_BYTES_PER_S = 50e9


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a preset's numbers come from: public figures, or a fit to a measured engine."""

    kind: Literal["datasheet", "measured"]
    where: str  # the datasheets cited, or the hardware, engine and model measured
    how: str  # the derivation, or the command that measured and fitted it
    # the fit's quality, for a measured preset (sim/calibration.py)
    r_squared: float | None = None
    max_relative_error: float | None = None
    samples: int | None = None


DATASHEET = Provenance(
    "datasheet", "public figures of the GPU and the model (sim/step_time.py's docstring)",
    "derived: weights and KV reads at 70% of peak bandwidth, prompt FLOPs at 45% MFU; not fitted")


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    name: str
    description: str
    base_s: float
    prefill_token_s: float
    seq_s: float
    context_token_s: float
    # seconds per (new prompt token, context token) pair of a prefill; keyword-only so that
    # it sits with the coefficients and defaults to 0 (the datasheet presets carry none)
    prefill_attention_s: float = dataclasses.field(default=0.0, kw_only=True)
    kv_capacity_tokens: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # KV bytes one token takes (all layers, K and V): sizes host-tier chunks and copies
    kv_bytes_per_token: int = 0
    # the host tier in use, in GiB (vLLM's --kv-offloading-size); 0 leaves it off
    kv_offload_gib: float = 0.0
    # the size `--host-tier` turns on for this preset, in GiB per worker
    suggested_host_tier_gib: float = 0.0
    # host↔GPU link bandwidth per direction (bytes/s)
    host_link_bytes_per_s: float = 0.0
    provenance: Provenance = DATASHEET

    def with_prefill_scale(self, scale: float) -> StepTimeModel:
        """This model with every prefill cost (per prompt token and per attention pair) times
        ``scale``: a prompt costs ``scale`` times as much, the rest of a step the same."""
        if not scale > 0:
            raise ValueError(f"prefill scale must be > 0, got {scale}")
        return dataclasses.replace(self, prefill_token_s=self.prefill_token_s * scale,
                                   prefill_attention_s=self.prefill_attention_s * scale)

    def with_host_tier(self, gib: float) -> StepTimeModel:
        """This model with a host KV tier of ``gib`` GiB (0 turns it off)."""
        if gib < 0:
            raise ValueError(f"host tier size must be >= 0 GiB, got {gib}")
        return dataclasses.replace(self, kv_offload_gib=gib)

    def step_s(self, prefill_tokens: int, seqs: int, context_tokens: int, *,
               prefill_pairs: float = 0.0) -> float:
        """One iteration; ``prefill_pairs`` is Σ n·(c0 + n/2) over its prefill chunks (``n``
        new tokens behind ``c0`` computed ones)."""
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.seq_s * seqs
            + self.context_token_s * context_tokens
            + self.prefill_attention_s * prefill_pairs
        )

    def decode_run_s(self, seqs: int, context_tokens: int, steps: int) -> float:
        """Total time of ``steps`` pure-decode steps, context growing by ``seqs`` each."""
        per_step = self.base_s + self.seq_s * seqs + self.context_token_s * context_tokens
        growth = self.context_token_s * seqs
        return steps * per_step + growth * steps * (steps - 1) / 2.0

    def decode_steps_within(self, seqs: int, context_tokens: int, seconds: float) -> int:
        """The fewest decode steps whose total time reaches ``seconds`` (at least 1)."""
        if seconds <= 0:
            return 1
        a = self.base_s + self.seq_s * seqs + self.context_token_s * context_tokens
        b = self.context_token_s * seqs / 2.0
        # steps·a + b·steps·(steps−1) ≥ seconds
        lo, hi = 1, 1
        while self.decode_run_s(seqs, context_tokens, hi) < seconds:
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if a * mid + b * mid * (mid - 1) >= seconds:
                hi = mid
            else:
                lo = mid + 1
        return lo


# The batch a policy's per-token service costs are priced at (policy_cost_terms): a decode
# step of this many sequences, each attending over this many tokens of context. The H100
# preset prices that step at 18.75 ms, near autellix's 20 ms default (its decode step under load).
TYPICAL_DECODE_SEQS = 64
TYPICAL_CONTEXT_TOKENS = 2048


def policy_cost_terms(model: StepTimeModel) -> dict[str, float]:
    """The cost terms of ``model`` the policies take: :func:`vllm_router_cost_terms`, and the
    per-token service costs of policies estimating service from usage (autellix's and
    continuum's ``decode_token_s`` and ``prefill_token_s``, continuum's ``reload_token_s``), at
    a typical batch: a decode step of :data:`TYPICAL_DECODE_SEQS` sequences with
    :data:`TYPICAL_CONTEXT_TOKENS` tokens of context each (fewer where the model's
    ``max_num_seqs`` or KV pool holds less).

    - ``decode_token_s``: that whole step, which an output token holds its call in;
    - ``prefill_token_s``: what one more prompt token adds to a step: its matmuls, its KV in the
      step's context, and its attention over the typical context;
    - ``reload_token_s``: one token's KV over the host link (0 for a model without one).
    """
    seqs = min(TYPICAL_DECODE_SEQS, model.max_num_seqs)
    context_each = max(1, min(TYPICAL_CONTEXT_TOKENS, model.kv_capacity_tokens // seqs))
    link = model.host_link_bytes_per_s
    return {
        "decode_token_s": model.step_s(0, seqs, seqs * context_each),
        "prefill_token_s": (model.prefill_token_s + model.context_token_s
                            + model.prefill_attention_s * context_each),
        "reload_token_s": model.kv_bytes_per_token / link if link > 0 else 0.0,
        **vllm_router_cost_terms(model),
    }


def vllm_router_cost_terms(model: StepTimeModel) -> dict[str, float]:
    """vllm_router's calibration coefficients (vllm-project/router docs/program_scheduling.md,
    "Offline calibration models"), read off ``model``'s :meth:`StepTimeModel.step_s`:

    - the cold prefill of ``x`` thousand uncached tokens, in one step of one sequence:
      ``base_s + seq_s + 1000·(prefill_token_s + context_token_s)·x
      + 1e6·prefill_attention_s/2·x²`` (a whole prompt makes ``P²/2`` attention pairs);
    - a decode step of ``B`` sequences over ``C`` context tokens:
      ``base_s + seq_s·B + context_token_s·C``.

    Its ``decode_throughput_alpha`` is not here: the doc's calibration does not derive it either.
    """
    return {
        "prefill_intercept_seconds": model.base_s + model.seq_s,
        "prefill_linear_seconds_per_1k_tokens": 1000.0 * (model.prefill_token_s + model.context_token_s),
        "prefill_quadratic_seconds_per_1k_tokens_squared": 1e6 * model.prefill_attention_s / 2.0,
        "decode_fixed_step_seconds": model.base_s,
        "decode_batch_step_seconds_per_request": model.seq_s,
        "decode_context_step_seconds_per_token": model.context_token_s,
    }


def _preset(name: str, description: str, *, weights_gb: float, active_params_b: float,
            kv_bytes_per_token: int, hbm_gb: float, bandwidth_tb_s: float,
            tflops: float = 989.0, gpus: int = 1) -> StepTimeModel:
    bandwidth = bandwidth_tb_s * _TB * 0.70
    flops = tflops * _TB * 0.45
    kv_pool_bytes = hbm_gb * 1e9 * 0.90 - weights_gb * 1e9
    return StepTimeModel(
        name=name,
        description=description,
        base_s=weights_gb * 1e9 / bandwidth + 0.002,  # + ~2 ms of scheduler/launch overhead
        prefill_token_s=2.0 * active_params_b * 1e9 / flops,
        seq_s=40e-6,
        context_token_s=kv_bytes_per_token / bandwidth,
        kv_capacity_tokens=int(kv_pool_bytes // kv_bytes_per_token),
        kv_bytes_per_token=kv_bytes_per_token,
        # vLLM's --kv-offloading-size is the total over the TP ranks; each GPU has its link
        suggested_host_tier_gib=_HOST_TIER_GIB_PER_GPU * gpus,
        host_link_bytes_per_s=_PCIE_GEN5_X16_BYTES_PER_S * gpus,
    )


# What the simulator, the simworker and the demo model when no preset is named.
DEFAULT_PRESET = "llama3.1-8b-h100"


def presets() -> dict[str, StepTimeModel]:
    """Every named preset, built on call (nothing is built at import time)."""
    built = [
        _preset(DEFAULT_PRESET, "Llama-3.1-8B, BF16, one H100 SXM 80 GB",
                weights_gb=16.1, active_params_b=8.0, kv_bytes_per_token=131072,
                hbm_gb=80, bandwidth_tb_s=3.35),
        _preset("llama3.1-8b-h200", "Llama-3.1-8B, BF16, one H200 141 GB",
                weights_gb=16.1, active_params_b=8.0, kv_bytes_per_token=131072,
                hbm_gb=141, bandwidth_tb_s=4.8),
        _preset("qwen3-30b-a3b-h200", "Qwen3-30B-A3B (MoE), BF16, one H200 141 GB",
                weights_gb=61.1, active_params_b=3.3, kv_bytes_per_token=98304,
                hbm_gb=141, bandwidth_tb_s=4.8),
        _preset("qwen3-30b-a3b-h100x2", "Qwen3-30B-A3B (MoE), BF16, two H100 SXM (TP=2)",
                weights_gb=61.1, active_params_b=3.3, kv_bytes_per_token=98304,
                hbm_gb=160, bandwidth_tb_s=6.7, tflops=1978.0, gpus=2),
    ]
    return {model.name: model for model in built}


def preset(name: str) -> StepTimeModel:
    table = presets()
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(table)}") from None


# What a run is given to model its engines by: a named preset, or a model itself (one read
# from a preset file, sim/preset_file.py, is used exactly as a named one).
PresetSpec = str | StepTimeModel


def model_of(spec: PresetSpec) -> StepTimeModel:
    """The model ``spec`` stands for: the named preset, or ``spec`` itself."""
    return spec if isinstance(spec, StepTimeModel) else preset(spec)
