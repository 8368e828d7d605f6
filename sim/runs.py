"""Build and run simulations from the options the CLI and the sweep take.

Every policy of a comparison replays the *same* programs: the feed is rebuilt per policy
from the same seed, so differences come from the policy alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scheduler.config import PolicyConfig, ProgramAwareConfig
from scheduler.policies import make_policy
from sim.engine import SCHEDULING_POLICIES
from sim.feeds import Batches, ClosedLoop, OpenLoop, ProgramFeed
from sim.programs import ProgramSpec
from sim.report import Progress
from sim.simulation import SimResult, Simulation
from sim.shards import ShardedPolicy
from sim.step_time import PresetSpec, StepTimeModel, model_of, policy_cost_terms, vllm_router_cost_terms

# The simulator's default block size. vLLM's GPU default is 16; 64 gives the same hit and
# eviction pattern up to the last partial block of each prompt at a quarter of the cost
# (measured: least_loaded, SWE-bench CC256, 8 workers, 300 s: 3,861 vs 3,864 output
# tokens/s and 68.8% vs 68.7% hit rate at 16 vs 64).
DEFAULT_BLOCK_SIZE = 64

WORKLOADS = ("swebench", "rl_rollout", "rl_swe", "burst")

# The simulated engines' vLLM --scheduling-policy unless a run says otherwise: "priority",
# where the policy's Admit priority orders each engine's queue (what every committed result
# was measured with). "fcfs" is vLLM's own default: the engines ignore the priority, as a
# fleet whose vLLM runs without --scheduling-policy priority does.
DEFAULT_SCHEDULING_POLICY = "priority"

# The ceiling row: the same programs on the same fleet with a KV pool this many times the
# preset's, placed by least_loaded. The pool never fills on the committed runs (its only
# re-prefill is the partial last block of each previous sequence, which vLLM does not
# cache either), so it bounds what any admission policy can reach on that fleet; every
# policy's ``of_ceiling`` is its share of it.
CEILING = "ceiling"
CEILING_POLICY = "least_loaded"
CEILING_KV_FACTOR = 100


def workload_feed(workload: str, concurrency: int, seed: int) -> ProgramFeed:
    """A closed loop at ``concurrency`` (swebench), GRPO batches of that many programs
    (rl_rollout, rl_swe: ``concurrency // 8`` prompts × 8 samples), or that many programs at
    once whose first contexts span 10× (burst: it ends with them, and reports their start
    waits by size)."""
    from sim.workloads import BurstWorkload, RlRolloutWorkload, RlSweWorkload, SwebenchWorkload

    if workload == "swebench":
        return ClosedLoop(SwebenchWorkload(seed=seed).make_program, concurrency)
    if workload == "rl_rollout":
        samples = 8 if concurrency >= 8 else 1
        prompts = max(1, concurrency // samples)
        rl = RlRolloutWorkload(seed=seed, prompts_per_batch=prompts, samples_per_prompt=samples)
        return Batches(rl.batch)
    if workload == "rl_swe":
        samples = 8 if concurrency >= 8 else 1
        swe = RlSweWorkload(seed=seed, prompts_per_batch=max(1, concurrency // samples),
                            samples_per_prompt=samples)
        return Batches(swe.batch)
    if workload == "burst":
        return OpenLoop(BurstWorkload(seed=seed).programs(concurrency), report_start_waits=True)
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def ends_with_its_programs(workload: str) -> bool:
    """Whether a run of ``workload`` ends when its programs have (its duration a cap), not at
    its duration."""
    return workload == "burst"


def scale_times(programs: Sequence[ProgramSpec], time_scale: float) -> list[ProgramSpec]:
    """Multiply every arrival time and think time by ``time_scale`` (< 1 compresses)."""
    if time_scale <= 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    if time_scale == 1.0:
        return list(programs)
    scaled = []
    for spec in programs:
        calls = [
            dataclasses.replace(
                call,
                think_s=call.think_s * time_scale,
                at=None if call.at is None else call.at * time_scale,
            )
            for call in spec.calls
        ]
        scaled.append(dataclasses.replace(spec, calls=calls, start_at=spec.start_at * time_scale,
                                          _stream=[]))
    return scaled


def trace_span_s(programs: Sequence[ProgramSpec]) -> float:
    last = 0.0
    for spec in programs:
        t = spec.start_at
        for call in spec.calls:
            t = call.at if call.at is not None else t + call.think_s
            last = max(last, t)
    return last


def run_policies(
    policies: Sequence[str],
    feed_for: Callable[[], ProgramFeed],
    *,
    workers: int,
    preset: PresetSpec,
    duration_s: float,
    block_size: int | None = DEFAULT_BLOCK_SIZE,
    policy_config: PolicyConfig | None = None,
    stop_when_done: bool = False,
    show_progress: bool = True,
    label: str = "",
    ceiling: bool = False,
    kv_offload_gib: float = 0.0,
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY,
    policy_costs: Mapping[str, float] | None = None,
    shards: int = 1,
) -> list[SimResult]:
    """One result per policy, in order; with ``ceiling``, a last result named
    :data:`CEILING`: the same programs with unlimited KV (see :data:`CEILING_KV_FACTOR`).
    ``kv_offload_gib`` > 0 gives every worker, under every policy, a host KV tier of that size
    (vLLM's native CPU offloading, ``--kv-offloading-size``), and tells the policies that know
    the tier (program_aware's ``retention.host_tier``, mori's ``host_tier_tokens``, unless the
    config set them).
    ``scheduling_policy`` is every engine's vLLM ``--scheduling-policy`` (the ceiling's too).
    ``preset`` is a named preset or a model (one read from a preset file). ``policy_costs``
    (:func:`~sim.step_time.policy_cost_terms` of the preset) sets the cost terms of each
    policy that has them and whose config leaves them unset (:func:`policy_costs_taken`).
    ``shards`` > 1 splits the workers between that many gateways, each with its own policy,
    every program on the one its root session hashes to (:class:`~sim.shards.ShardedPolicy`);
    the ceiling stays one gateway."""
    if shards < 1:
        raise ValueError(f"shards must be ≥ 1, got {shards}")
    if shards > workers:
        raise ValueError(f"{shards} shards need at least as many workers, got {workers}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                         f"got {scheduling_policy!r}")
    model = model_of(preset).with_host_tier(kv_offload_gib)
    runs: list[tuple[str, str, int | None]] = [(name, name, None) for name in policies]
    if ceiling:
        size = block_size or model.block_size
        runs.append((CEILING, CEILING_POLICY, model.kv_capacity_tokens // size * CEILING_KV_FACTOR))
    results = []
    for shown, name, num_blocks in runs:
        policy_for_run = (policy_config or ProgramAwareConfig()).for_policy(name)
        if policy_costs is not None:
            policy_for_run = policy_for_run.model_copy(
                update=policy_costs_taken(policy_for_run, policy_costs))
        if model.kv_offload_gib > 0:
            policy_for_run = policy_for_run.for_host_tier()  # the policy knows its fleet's tier
            policy_for_run = policy_for_run.model_copy(update=host_tier_taken(
                policy_for_run, host_tier_tokens(model, block_size)))
        policy = make_policy(policy_for_run)
        if shards > 1 and shown != CEILING:
            policy = ShardedPolicy([policy] + [make_policy(policy_for_run) for _ in range(shards - 1)])
        progress = Progress(f"{label}{shown}") if show_progress else None
        simulation = Simulation(policy, feed_for(), workers=workers, model=model,
                                duration_s=duration_s, block_size=block_size,
                                num_blocks=num_blocks, progress=progress,
                                stop_when_done=stop_when_done,
                                scheduling_policy=scheduling_policy)
        result = simulation.run()
        if shown != name:
            result = dataclasses.replace(result, policy=shown)
        results.append(result)
        if progress is not None:
            progress.close()
    return results


def preset_policy_costs(model: StepTimeModel, preset_file: Path | str | None) -> dict[str, float]:
    """The cost terms a run gives its policies from its preset: a preset file's model's (the
    engine it was fitted to or written for), :func:`~sim.step_time.policy_cost_terms`. A named
    preset gives only vllm_router's (:func:`~sim.step_time.vllm_router_cost_terms`: its source
    tells operators to calibrate them on their deployment, and the preset is the simulator's);
    the other policies keep their configured costs (autellix's and continuum's defaults
    are the llama3.1-8b-h100 preset's), so their runs on the named presets stay as they were."""
    return vllm_router_cost_terms(model) if preset_file is None else policy_cost_terms(model)


def policy_costs_taken(config: PolicyConfig, costs: Mapping[str, float]) -> dict[str, float]:
    """The cost terms ``config`` takes from a preset's ``costs``: those its section has and its
    file left unset (keys set explicitly win), where the preset prices them above 0, or at 0
    for a key that admits 0 (a positive cost a fit put at 0 leaves the configured one)."""
    section = type(config)
    return {key: value for key, value in costs.items()
            if key in section.model_fields and key not in config.model_fields_set
            and (value > 0 or (value == 0 and not _positive_only(section, key)))}


def recorded_policy_costs(costs: Mapping[str, float], preset_file: Path | str | None,
                          policy_config: PolicyConfig | None, policies: Sequence[str]
                          ) -> dict[str, float] | None:
    """What a result's ``config`` records of the cost terms its preset gave: all of a preset
    file's; a named preset's only when one of ``policies`` has such terms (vllm_router), so the
    runs of the other policies on named presets record what they always did."""
    if preset_file is not None:
        return dict(costs)
    base = policy_config or ProgramAwareConfig()
    takers = [name for name in policies if any(key in type(base.for_policy(name)).model_fields
                                               for key in costs)]
    return dict(costs) if takers else None


def _positive_only(section: type[PolicyConfig], key: str) -> bool:
    """Does ``section``'s ``key`` refuse 0 (a ``gt=0`` bound)?"""
    return any(getattr(bound, "gt", None) is not None for bound in section.model_fields[key].metadata)


def host_tier_tokens(model: StepTimeModel, block_size: int | None) -> int:
    """Tokens each worker's host tier holds: its whole chunks (one GPU block each,
    sim/offloading.py) of ``model.kv_offload_gib``."""
    size = block_size or model.block_size
    return int(model.kv_offload_gib * (1 << 30)) // (model.kv_bytes_per_token * size) * size


def host_tier_taken(config: PolicyConfig, tokens: int) -> dict[str, int]:
    """What ``config`` takes of its fleet's host tier: ``host_tier_tokens`` = ``tokens`` for a
    section that has the key (mori's) and whose file left it unset."""
    if "host_tier_tokens" in type(config).model_fields and "host_tier_tokens" not in config.model_fields_set:
        return {"host_tier_tokens": tokens}
    return {}


def policy_cost_notes(policy_config: PolicyConfig | None, policies: Sequence[str],
                      costs: Mapping[str, float], source: str) -> list[str]:
    """A line for each of ``policies`` that has cost terms: the ones it takes from ``source``
    (the preset) and the ones it keeps as configured."""
    notes = []
    for name in policies:
        config = (policy_config or ProgramAwareConfig()).for_policy(name)
        terms = [key for key in costs if key in type(config).model_fields]
        if not terms:
            continue
        taken = policy_costs_taken(config, costs)
        parts = [f"{key} {value:.4g} from {source}" for key, value in taken.items()]
        parts += [f"{key} {getattr(config, key):.4g} as configured" for key in terms if key not in taken]
        notes.append(f"{name}: " + ", ".join(parts))
    return notes


def preset_record(model: StepTimeModel, preset_file: Path | str | None) -> dict[str, Any]:
    """What a result's ``config`` records of the step-time model it ran on: the preset's name,
    the file it was read from (None: a named preset) and whether its numbers were measured or
    come from datasheets."""
    return {"preset": model.name, "preset_file": None if preset_file is None else str(preset_file),
            "preset_provenance": model.provenance.kind}


def replay_programs(fmt: str, path: Path, time_scale: float, **loader_options: Any
                    ) -> tuple[list[ProgramSpec], int]:
    """A trace's programs with times scaled; ``loader_options`` go to its loader."""
    from sim.traces import load_trace

    programs, block_size = load_trace(fmt, path, **loader_options)
    return scale_times(programs, time_scale), block_size


__all__ = ["CEILING", "DEFAULT_BLOCK_SIZE", "DEFAULT_SCHEDULING_POLICY", "WORKLOADS", "host_tier_taken",
           "host_tier_tokens", "policy_cost_notes", "policy_costs_taken", "preset_policy_costs",
           "preset_record", "recorded_policy_costs", "replay_programs", "run_policies", "scale_times",
           "trace_span_s", "workload_feed"]
