"""``sluice sweep CONFIG.yaml``: a grid of concurrency × policy runs, with a Markdown table,
a JSON file and plots (throughput and hit rate against concurrency).

Runs are independent, so they go to a process pool (``jobs``); each run is deterministic
given its seed, so the result does not depend on the number of processes.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from scheduler.config import POLICY_NAMES, ConfigError, PolicyConfig, load_yaml_text

from scheduler.config_reading import parse_policy_config
from sim.preset_file import read_preset_file
from sim.report import format_markdown, with_ceiling_ratio
from sim.runs import (CEILING, DEFAULT_BLOCK_SIZE, DEFAULT_SCHEDULING_POLICY, WORKLOADS,
                      ends_with_its_programs, policy_cost_notes, preset_policy_costs, preset_record,
                      recorded_policy_costs,
                      run_policies, workload_feed)
from sim.step_time import DEFAULT_PRESET, StepTimeModel, presets


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    workload: str = "swebench"
    workers: Annotated[int, Field(gt=0)] = 8
    preset: str = DEFAULT_PRESET
    # a preset file (sluice calibrate's, bench/gpu_profile.py's) instead of a named preset,
    # relative to the sweep file's folder; load_sweep resolves and reads it
    preset_file: str | None = None
    duration_s: Annotated[float, Field(gt=0)] = 1800.0
    seed: int = 7
    # Seeds run on the same grid beside ``seed`` and reported in a table of their own: the
    # policies' settings were chosen on ``seed``, so a result must also hold on these.
    held_back_seeds: list[int] = []
    block_size: Annotated[int, Field(gt=0)] = DEFAULT_BLOCK_SIZE
    concurrency: list[Annotated[int, Field(gt=0)]]
    policies: list[str]
    output_dir: str
    jobs: Annotated[int, Field(gt=0)] = 2
    # a `ceiling` row per concurrency (unlimited KV; see sim.runs.CEILING_KV_FACTOR)
    ceiling: bool = True
    # GiB of host KV tier per worker under every policy (vLLM's native CPU offloading); 0: none
    kv_offload_gib: Annotated[float, Field(ge=0)] = 0.0
    # the engines' vLLM --scheduling-policy (sluice sim --scheduling-policy): priority orders
    # each engine's queue by the policy's admission priority; fcfs ignores it
    scheduling_policy: Literal["fcfs", "priority"] = DEFAULT_SCHEDULING_POLICY
    policy: dict[str, Any] = {}
    # the preset file's model, read once by load_sweep (and carried to the worker processes)
    _file_model: StepTimeModel | None = PrivateAttr(default=None)

    @property
    def step_time_model(self) -> StepTimeModel:
        """The model every run uses: the preset file's, else the named preset's."""
        if self.preset_file is None:
            return presets()[self.preset]
        if self._file_model is None:
            self._file_model = read_preset_file(Path(self.preset_file))
        return self._file_model

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        if value not in WORKLOADS:
            raise ValueError(f"unknown workload {value!r}; choose from {', '.join(WORKLOADS)}")
        return value

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in presets():
            raise ValueError(f"unknown preset {value!r}; choose from {', '.join(presets())}")
        return value

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        return value


def load_sweep(text: str, source: str) -> tuple[SweepConfig, PolicyConfig]:
    data = load_yaml_text(text, source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        sweep = SweepConfig.model_validate(data)
    except ValidationError as err:
        problems = "\n".join(
            f"{source}: {'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in err.errors()
        )
        raise ConfigError(problems) from None
    if sweep.preset_file is not None:
        _read_preset_file(sweep, data, source)
    try:
        policy_config = parse_policy_config(sweep.policy, "policy")
    except ConfigError as err:
        # name the file on every line, like the errors in the rest of the sweep file
        raise ConfigError("\n".join(f"{source}: {line}" for line in str(err).splitlines())) from None
    return sweep, policy_config


def _read_preset_file(sweep: SweepConfig, data: dict[str, Any], source: str) -> None:
    """Resolve ``preset_file`` against the sweep file's folder and read it now, so a bad
    file stops the sweep before any run; errors name the sweep file and the key."""
    if "preset" in data:
        raise ConfigError(f"{source}: preset_file: preset and preset_file both choose the "
                          "step-time model; give one")
    sweep.preset_file = str(Path(source).parent / sweep.preset_file)
    try:
        sweep._file_model = read_preset_file(Path(sweep.preset_file))
    except ConfigError as err:
        raise ConfigError(f"{source}: preset_file: {err}") from None


def _one(args: tuple[SweepConfig, PolicyConfig, int, str, int]) -> dict[str, Any]:
    sweep, policy_config, concurrency, policy, seed = args
    is_ceiling = policy == CEILING
    [result] = run_policies(
        [] if is_ceiling else [policy],
        lambda: workload_feed(sweep.workload, concurrency, seed),
        workers=sweep.workers, preset=sweep.step_time_model, duration_s=sweep.duration_s,
        block_size=sweep.block_size, policy_config=policy_config, show_progress=False,
        stop_when_done=ends_with_its_programs(sweep.workload), ceiling=is_ceiling, kv_offload_gib=sweep.kv_offload_gib,
        scheduling_policy=sweep.scheduling_policy,
        policy_costs=preset_policy_costs(sweep.step_time_model, sweep.preset_file),
    )
    row = {"concurrency": concurrency, "seed": seed, **result.summary(),
           "marks": result.marks, "forced_resumes": result.forced_resumes,
           "preemptions": result.preemptions, "calls": result.calls_completed}
    return row


def run_sweep(sweep: SweepConfig, policy_config: PolicyConfig, command: str) -> Path:
    out = Path(sweep.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = list(sweep.policies) + ([CEILING] if sweep.ceiling else [])
    model = sweep.step_time_model
    # the preset prices the policies' cost terms (a named one only vllm_router's; explicit keys
    # in `policy:` win)
    costs = preset_policy_costs(model, sweep.preset_file)
    source = "the preset file" if sweep.preset_file is not None else f"the {model.name} preset"
    cost_notes = policy_cost_notes(policy_config, sweep.policies, costs, source)
    for note in cost_notes:
        sys.stderr.write(f"{note}\n")
    seeds = [sweep.seed, *(s for s in sweep.held_back_seeds if s != sweep.seed)]
    grid = [(sweep, policy_config, cc, policy, seed)
            for seed in seeds for cc in sweep.concurrency for policy in policies]
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=sweep.jobs) as pool:
        for n, row in enumerate(pool.map(_one, grid), start=1):
            rows.append(row)
            held_back = f" seed {row['seed']}" if row["seed"] != sweep.seed else ""
            sys.stderr.write(f"[{n}/{len(grid)}]{held_back} CC{row['concurrency']} {row['policy']}: "
                             f"{row['output_tokens_per_s']:.0f} tok/s, hit {row['hit_rate']:.1%}\n")
            sys.stderr.flush()
    # each row is read against the ceiling of its own seed and concurrency
    rows = [ratioed for seed in seeds for ratioed in
            with_ceiling_ratio([row for row in rows if row["seed"] == seed], group="concurrency")]
    main = [row for row in rows if row["seed"] == sweep.seed]
    held = [row for row in rows if row["seed"] != sweep.seed]
    recorded = recorded_policy_costs(costs, sweep.preset_file, policy_config, sweep.policies)
    config = {**sweep.model_dump(), **preset_record(model, sweep.preset_file),
              **({} if recorded is None else {"policy_costs": recorded})}
    (out / "results.json").write_text(json.dumps({"results": rows, "config": config}, indent=2) + "\n")
    table = format_markdown(main, extra=("concurrency",))
    if held:
        table += (f"\n\nHeld-back seeds ({', '.join(str(s) for s in seeds[1:])}), the same grid:\n\n"
                  + format_markdown(held, extra=("seed", "concurrency")))
    (out / "results.md").write_text(
        f"# {sweep.name}\n\nMade by `{command}`.\n\n"
        f"Workload `{sweep.workload}`, {sweep.workers} workers, preset `{model.name}` "
        f"({_preset_origin(model, sweep.preset_file)}), "
        f"{sweep.duration_s:.0f} s of simulated time per run, seed {sweep.seed}, "
        f"block size {sweep.block_size}, engines' scheduling policy {sweep.scheduling_policy}."
        + "".join(f"\n\nCost terms: {note}." for note in cost_notes)
        + f"\n\n{table}\n"
    )
    plot_sweep(main, out, sweep.name)
    return out


def _preset_origin(model: StepTimeModel, preset_file: str | None) -> str:
    """Where the preset came from, for the table's heading: its file (if any) and its kind."""
    return model.provenance.kind if preset_file is None else f"{preset_file}, {model.provenance.kind}"


def plot_sweep(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(row["policy"] for row in rows))
    for key, label, filename in (
        ("output_tokens_per_s", "output tokens/s", "throughput.png"),
        ("hit_rate", "prefix-cache hit rate", "hit_rate.png"),
        ("p99_call_s", "p99 call latency (s)", "p99_latency.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            points = sorted((r["concurrency"], r[key]) for r in rows if r["policy"] == policy)
            style = {"color": "black", "linestyle": "--"} if policy == CEILING else {}
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy, **style)
        ax.set_xlabel("concurrent programs")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
