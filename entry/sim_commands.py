"""``sluice sim``, ``sluice replay`` and ``sluice sweep``: the simulator's commands (and
``sluice tune``, from entry/tune_command.py; the options and checks they share are in
entry/sim_options.py).

They are registered on the main ``sluice`` app by :func:`register`. Each prints the report
table; ``--json PATH`` writes ``{"results": [...], "config": {...}}``. Bad input (unknown
policy, workload or preset, a malformed trace line, a bad sweep file) prints ``error: ...``
and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from entry.sim_options import (PresetFileOption, PresetOption, SchedulingPolicyOption,
                               check_scheduling_policy, command_line, policy_costs, step_time_model)
from entry.simworker_command import simworker
from entry.trace_input import load_trace
from entry.tune_command import tune
from entry.usage_error import usage_error
from scheduler.config import POLICY_NAMES, ConfigError, PolicyConfig
from scheduler.config_reading import parse_policy_yaml
from sim.preset_file import read_preset_file
from sim.report import format_table, with_ceiling_ratio, write_json
from sim.runs import (DEFAULT_BLOCK_SIZE, DEFAULT_SCHEDULING_POLICY, WORKLOADS, ends_with_its_programs,
                      preset_record, recorded_policy_costs, run_policies, trace_span_s,
                      workload_feed)
from sim.step_time import StepTimeModel, presets


# Options that sim and replay share, declared once (typer reads them from the annotations).
JsonOption = Annotated[Optional[Path], typer.Option(
    "--json", help="Write the results as JSON here.", dir_okay=False, metavar="PATH")]
CeilingOption = Annotated[bool, typer.Option(
    "--ceiling/--no-ceiling",
    help="Add a `ceiling` row (the same programs with unlimited KV) and each policy's share "
         "of it (`of ceiling`).")]
PolicyConfigOption = Annotated[Optional[Path], typer.Option(
    "--config", dir_okay=False, metavar="PATH",
    help="A Sluice YAML file whose `policy:` section sets the thresholds (as `sluice serve` "
         "reads it); other sections are ignored.")]
KvOffloadOption = Annotated[float, typer.Option(
    "--kv-offload-gb", min=0.0, metavar="GIB",
    help="Give every worker, under every policy, a host KV tier of this many GiB: vLLM's "
         "native CPU offloading (--kv-offloading-size). 0 (default): none.")]
HostTierOption = Annotated[bool, typer.Option(
    "--host-tier",
    help="Turn on the host KV tier at the preset's size (see `sluice presets`); "
         "--kv-offload-gb overrides the size.")]



def _policies(spec: str) -> list[str]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise usage_error("--policy needs at least one policy name")
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown:
        raise usage_error(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    return names


def _host_tier_gib(model: StepTimeModel, kv_offload_gib: float, host_tier: bool) -> float:
    """The host tier size a run asks for: --kv-offload-gb, else the preset's with --host-tier."""
    if kv_offload_gib > 0:
        return kv_offload_gib
    return model.suggested_host_tier_gib if host_tier else 0.0


def _policy_config(path: Path | None):
    """The `policy:` section of ``path`` (None: the defaults); errors name the file and key."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise usage_error(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        return parse_policy_yaml(text, str(path))
    except ConfigError as err:
        raise usage_error(str(err)) from None


def sim(
    workload: str = typer.Option("swebench", "--workload", help=f"One of: {', '.join(WORKLOADS)}."),
    concurrency: int = typer.Option(256, "--concurrency", min=1,
                                    help="Programs alive at once (swebench: closed loop; "
                                         "rl_rollout, rl_swe: programs per GRPO batch, 8 "
                                         "samples per task; rl_swe at 512 is ~2x 8 H100s' KV; "
                                         "burst: programs arriving at once, first contexts "
                                         "spanning 10x, run until they end)."),
    workers: int = typer.Option(8, "--workers", min=1, help="Simulated vLLM workers."),
    preset: PresetOption = None,
    preset_file: PresetFileOption = None,
    duration: float = typer.Option(900.0, "--duration", min=1.0,
                                   help="Simulated seconds (burst: a cap; the run ends with its programs)."),
    policy: str = typer.Option("program_aware,kv_aware,least_loaded", "--policy",
                               help="Comma-separated policies to compare on the same programs."),
    seed: int = typer.Option(7, "--seed", help="Workload seed."),
    block_size: int = typer.Option(DEFAULT_BLOCK_SIZE, "--block-size", min=1,
                                   help="KV block size in tokens."),
    json_path: JsonOption = None,
    ceiling: CeilingOption = True,
    config_path: PolicyConfigOption = None,
    kv_offload_gib: KvOffloadOption = 0.0,
    host_tier: HostTierOption = False,
    scheduling_policy: SchedulingPolicyOption = DEFAULT_SCHEDULING_POLICY,
    shards: int = typer.Option(1, "--shards", min=1,
                               help="Gateways the workers are split between (worker i to gateway "
                                    "i mod K), each with its own policy, every program on the one "
                                    "its root session hashes to, as behind ops/nginx/ "
                                    "(architecture.md §8). The ceiling stays one gateway."),
) -> None:
    """Simulate a synthetic agent workload under each policy and compare them."""
    names = _policies(policy)
    model = step_time_model(preset, preset_file)
    check_scheduling_policy(scheduling_policy)
    policy_config = _policy_config(config_path)
    if workload not in WORKLOADS:
        raise usage_error(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if shards > workers:
        raise usage_error(f"--shards {shards} needs at least as many --workers, got {workers}")
    costs = policy_costs(model, preset_file, policy_config, names)
    results = run_policies(
        names, lambda: workload_feed(workload, concurrency, seed), workers=workers,
        preset=model, duration_s=duration, block_size=block_size, label=f"{workload} CC{concurrency} ",
        stop_when_done=ends_with_its_programs(workload),
        ceiling=ceiling, policy_config=policy_config,
        kv_offload_gib=_host_tier_gib(model, kv_offload_gib, host_tier),
        scheduling_policy=scheduling_policy, policy_costs=costs, shards=shards,
    )
    typer.echo(format_table(with_ceiling_ratio([r.summary() for r in results])))
    if json_path is not None:
        config = {"command": command_line(), "workload": workload, "concurrency": concurrency,
                  "shards": shards,
                  "workers": workers, **preset_record(model, preset_file), "duration_s": duration,
                  "seed": seed, "block_size": block_size, "policies": names, "ceiling": ceiling,
                  "kv_offload_gib": _host_tier_gib(model, kv_offload_gib, host_tier),
                  "scheduling_policy": scheduling_policy,
                  **_costs_record(costs, preset_file, policy_config, names)}
        write_json(json_path, results, config)
        typer.echo(f"wrote {json_path}")


def replay(
    fmt: str = typer.Option(..., "--format", help="mooncake | kvtester | dynamo | sluice."),
    trace: Path = typer.Option(..., "--trace", help="The trace file (or kvtester directory).",
                               metavar="PATH"),
    workers: int = typer.Option(8, "--workers", min=1, help="Simulated vLLM workers."),
    policy: str = typer.Option("program_aware,kv_aware", "--policy",
                               help="Comma-separated policies to compare."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Multiply arrival and think times (0.5 replays twice as fast)."),
    preset: PresetOption = None,
    preset_file: PresetFileOption = None,
    drain: float = typer.Option(1800.0, "--drain", min=0.0,
                                help="Open loop: simulated seconds allowed after the last arrival."),
    concurrency: Optional[int] = typer.Option(
        None, "--concurrency", min=1,
        help="Closed loop: keep N conversations (a top-level session with its sub-agents) in "
             "flight, starting the next in trace order when one ends; each keeps its own "
             "think times and recorded gaps. Without it the replay is open loop: every "
             "session starts at its recorded time."),
    duration: Optional[float] = typer.Option(
        None, "--duration", min=1.0,
        help="Cap on simulated seconds. Default: open loop, the trace's span plus --drain; "
             "with --concurrency, none: the run ends when every conversation has ended."),
    timing: Optional[str] = typer.Option(
        None, "--timing", metavar="think|recorded",
        help="kvtester only. think (default, the tool's think-only timing): a request goes "
             "think_time after the previous response; recorded: at its recorded time."),
    warm_prefix: Optional[float] = typer.Option(
        None, "--warm-prefix", min=0.0, max=1.0,
        help="kvtester only: the fraction (default 0.5, 0: off) of the largest tool_tokens + "
             "system_tokens that every session shares as a warm prefix."),
    json_path: JsonOption = None,
    ceiling: CeilingOption = True,
    config_path: PolicyConfigOption = None,
    kv_offload_gib: KvOffloadOption = 0.0,
    host_tier: HostTierOption = False,
    scheduling_policy: SchedulingPolicyOption = DEFAULT_SCHEDULING_POLICY,
) -> None:
    """Replay a recorded trace (each session keeps its own timing) under each policy."""
    import math

    from sim.feeds import ConversationLoop, OpenLoop, ProgramFeed

    names = _policies(policy)
    policy_config = _policy_config(config_path)
    model = step_time_model(preset, preset_file)
    check_scheduling_policy(scheduling_policy)
    if time_scale <= 0:
        raise usage_error(f"--time-scale must be > 0, got {time_scale}")
    loader_options = _replay_loader_options(fmt, timing, warm_prefix)
    programs, block_size = load_trace(fmt, trace, time_scale, model, **loader_options)
    span = trace_span_s(programs)
    typer.echo(f"{trace}: {sum(len(p.calls) for p in programs):,} calls in {len(programs):,} "
               f"sessions over {span:,.0f} s (block size {block_size})", err=True)
    if concurrency is None:
        def feed_for() -> ProgramFeed:
            return OpenLoop(_fresh(programs))

        cap = span + drain if duration is None else duration
    else:
        def feed_for() -> ProgramFeed:
            return ConversationLoop(programs, concurrency)

        cap = math.inf if duration is None else duration
        typer.echo(f"closed loop: {ConversationLoop(programs, concurrency).conversations:,} "
                   f"conversations, {concurrency:,} in flight at a time", err=True)

    costs = policy_costs(model, preset_file, policy_config, names)
    results = run_policies(
        names, feed_for, workers=workers, preset=model, duration_s=cap, block_size=block_size,
        stop_when_done=True, label=f"replay {fmt} ", ceiling=ceiling, policy_config=policy_config,
        kv_offload_gib=_host_tier_gib(model, kv_offload_gib, host_tier),
        scheduling_policy=scheduling_policy, policy_costs=costs,
    )
    typer.echo(format_table(with_ceiling_ratio([r.summary() for r in results])))
    if json_path is not None:
        config = {"command": command_line(), "format": fmt, "trace": str(trace), "workers": workers,
                  **preset_record(model, preset_file), "time_scale": time_scale, "block_size": block_size,
                  "policies": names, "ceiling": ceiling, "concurrency": concurrency, "duration_s": duration,
                  "scheduling_policy": scheduling_policy, **loader_options,
                  **_costs_record(costs, preset_file, policy_config, names)}
        write_json(json_path, results, config)
        typer.echo(f"wrote {json_path}")


def _costs_record(costs: dict[str, float], preset_file: Optional[Path],
                  policy_config: PolicyConfig | None, names: list[str]) -> dict[str, object]:
    """What a result's ``config`` records of the policy cost terms its preset gave
    (:func:`~sim.runs.recorded_policy_costs`)."""
    recorded = recorded_policy_costs(costs, preset_file, policy_config, names)
    return {} if recorded is None else {"policy_costs": recorded}


def _replay_loader_options(fmt: str, timing: Optional[str], warm_prefix: Optional[float]
                           ) -> dict[str, object]:
    """The kvtester loader's options from ``--timing`` / ``--warm-prefix`` (other formats
    have a single timing and no declared shared prefix, so the options are refused)."""
    from sim.traces import KV_TIMINGS

    if fmt != "kvtester":
        given = [flag for flag, value in (("--timing", timing), ("--warm-prefix", warm_prefix))
                 if value is not None]
        if given:
            raise usage_error(f"{' and '.join(given)} apply only to --format kvtester")
        return {}
    if timing is not None and timing not in KV_TIMINGS:
        raise usage_error(f"--timing must be one of {', '.join(KV_TIMINGS)}, got {timing!r}")
    options: dict[str, object] = {"timing": timing or "think"}
    if warm_prefix is not None:
        options["warm_prefix_fraction"] = warm_prefix
    return options


def _fresh(programs):
    """Programs carry a lazily grown hash stream; give each run its own copies."""
    import dataclasses

    return [dataclasses.replace(p, _stream=[]) for p in programs]


def sweep(
    config: Path = typer.Argument(..., help="Sweep YAML (see experiments/concurrency_sweep.yaml); "
                                            "its engines are a named `preset:` or a `preset_file:` "
                                            "(a path relative to the YAML's folder).",
                                  metavar="CONFIG.yaml"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1,
                                       help="Parallel runs (default: the file's `jobs`)."),
) -> None:
    """Run a concurrency × policy grid and write a Markdown table, JSON and plots."""
    from sim.sweep import load_sweep, run_sweep

    try:
        text = config.read_text(encoding="utf-8")
    except OSError as err:
        raise usage_error(f"{config}: cannot read ({err.strerror or err})") from None
    try:
        spec, policy_config = load_sweep(text, str(config))
    except ConfigError as err:
        raise usage_error(str(err)) from None
    if jobs is not None:
        spec = spec.model_copy(update={"jobs": jobs})
    out = run_sweep(spec, policy_config, command_line())
    typer.echo((out / "results.md").read_text())
    typer.echo(f"wrote {out}/results.md, results.json, throughput.png, hit_rate.png, p99_latency.png")


ShownFileOption = Annotated[Path | None, typer.Option(
    "--file", dir_okay=False, metavar="PATH",
    help="Show the preset in this file (what --preset-file would use) instead of the named ones.")]


def list_presets(preset_file: ShownFileOption = None) -> None:
    """List the step-time presets: each one's KV pool, its decode and prefill costs, and where
    its numbers come from (datasheets, or measured: on what, by what command, how well the fit
    held)."""
    if preset_file is None:
        shown = list(presets().values())
    else:
        try:
            shown = [read_preset_file(preset_file)]
        except ConfigError as err:
            raise usage_error(str(err)) from None
    for model in shown:
        typer.echo(f"{model.name:<22} {model.description}; KV pool {model.kv_capacity_tokens:,} tokens")
        typer.echo(f"{'':<22} {_costs_line(model)}")
        typer.echo(f"{'':<22} {_provenance_line(model)}")


def _costs_line(model: StepTimeModel) -> str:
    """What ``model`` charges a step: a decode step's fixed part and its KV reads, a prefill's
    per prompt token and, where the model prices it, per attention pair (each new token over the
    context before it)."""
    attention = (f" + {model.prefill_attention_s * 1e9:.3g} ns/attention pair"
                 if model.prefill_attention_s > 0 else " (no attention term)")
    return (f"decode step {model.base_s * 1e3:.1f} ms + {model.context_token_s * 1e9:.0f} ns/context token; "
            f"prefill {model.prefill_token_s * 1e6:.3g} µs/prompt token{attention}")


def _provenance_line(model: StepTimeModel) -> str:
    """Where ``model``'s numbers come from, on one line: ``datasheet: ...`` or ``measured: ...``
    with the fit's quality where the file gives it."""
    source = model.provenance
    fit = [f"R² {source.r_squared:.3f}" if source.r_squared is not None else "",
           f"max relative error {source.max_relative_error:.1%}"
           if source.max_relative_error is not None else "",
           f"{source.samples:,} samples" if source.samples is not None else ""]
    fit_text = ", ".join(part for part in fit if part)
    return f"{source.kind}: {source.where}; {source.how}" + (f"; fit {fit_text}" if fit_text else "")


def register(app: typer.Typer) -> None:
    app.command("sim")(sim)
    app.command("replay")(replay)
    app.command("sweep")(sweep)
    app.command("tune")(tune)
    app.command("presets")(list_presets)
    app.command("simworker")(simworker)
