"""``sluice tune``: search the policy's keys on the simulator, check the best on held-back
data, write a ``policy:`` section (sim/tuning.py has the search space, the objective and the
split; this module reads the flags, prints and writes).

Two forms: a synthetic workload (``--workload``), checked on a second seed, or a trace
(``--format F --trace T``: Mooncake, kv-cache-tester, Dynamo's or the gateway's own request
log), checked on the trace's last conversations. Progress goes to stderr, one line per trial;
the comparison, the verdict and the written paths to stdout. Bad input exits with status 2.
"""

from __future__ import annotations

import json
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from entry.sim_options import (PresetFileOption, PresetOption, SchedulingPolicyOption,
                               check_scheduling_policy, command_line, step_time_model)
from entry.trace_input import load_trace
from entry.usage_error import usage_error
from sim import tuning
from sim.report import format_table, with_ceiling_ratio
from sim.runs import DEFAULT_BLOCK_SIZE, DEFAULT_SCHEDULING_POLICY, WORKLOADS, preset_record
from sim.step_time import StepTimeModel

DEFAULT_WORKLOAD = "swebench"
DEFAULT_CONCURRENCY = 256
DEFAULT_DURATION_S = 900.0
DEFAULT_HELD_BACK_FRACTION = 0.3
DEFAULT_P99_SLACK = 1.25
DEFAULT_BATCH = 8
# Below this held-back gain the verdict calls the result a tie: one run's throughput moves by
# about this much between seeds (design-notes "Choosing max_wait_s": a few percent between
# seeds of rl_swe; SWE-bench closed loops vary less).
SMALL_GAIN = 0.01


def tune(
    workload: Optional[str] = typer.Option(
        None, "--workload",
        help=f"Tune on a synthetic workload ({', '.join(WORKLOADS)}; default {DEFAULT_WORKLOAD} "
             "unless --format/--trace is given). Checked on --holdout-seed."),
    fmt: Optional[str] = typer.Option(
        None, "--format", help="Tune on a trace of this format: mooncake | kvtester | dynamo | "
                               "sluice (the gateway's own request log). Needs --trace."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="PATH",
                                         help="The trace file (or kvtester directory)."),
    concurrency: Optional[int] = typer.Option(
        None, "--concurrency", min=1,
        help=f"Workload: programs alive at once (default {DEFAULT_CONCURRENCY}). Trace: closed "
             "loop with N conversations in flight; without it the trace replays open loop."),
    workers: int = typer.Option(8, "--workers", min=1, help="Simulated vLLM workers."),
    trials: int = typer.Option(40, "--trials", min=1,
                               help="Configs to try; trial 0 is the policy's defaults."),
    duration: Optional[float] = typer.Option(
        None, "--duration", min=1.0,
        help=f"Simulated seconds per run. Workload: default {DEFAULT_DURATION_S:.0f}. Trace: a "
             "cap (default: open loop, each part's span plus --drain; closed loop, none)."),
    seed: int = typer.Option(7, "--seed", help="Workload seed of the tuning runs; also seeds "
                                               "the sampler (both forms)."),
    holdout_seed: Optional[int] = typer.Option(
        None, "--holdout-seed", help="Workload seed the best and the defaults are checked on "
                                     "(default --seed + 1; must differ from --seed)."),
    holdout_fraction: float = typer.Option(
        DEFAULT_HELD_BACK_FRACTION, "--holdout-fraction",
        help="Trace: the share of conversations, the last by start time, held back for the "
             "check; the search sees only the others."),
    p99_limit: Optional[float] = typer.Option(
        None, "--p99-limit-s", help="A trial whose p99 call latency is above this many seconds "
                                    "is infeasible (default: the defaults' own p99 on the "
                                    "tuning data × --p99-slack)."),
    p99_slack: float = typer.Option(
        DEFAULT_P99_SLACK, "--p99-slack",
        help="Without --p99-limit-s: how far (×) a trial's p99 may exceed the defaults' own "
             "(≥ 1); the held-back check applies the same rule to the held-back data."),
    policy: str = typer.Option("program_aware", "--policy",
                               help="The policy whose keys are searched (one with a search "
                                    "space: program_aware)."),
    preset: PresetOption = None,
    preset_file: PresetFileOption = None,
    block_size: int = typer.Option(DEFAULT_BLOCK_SIZE, "--block-size", min=1,
                                   help="Workload: KV block size in tokens (a trace brings its own)."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Trace: multiply arrival and think times."),
    drain: float = typer.Option(1800.0, "--drain", min=0.0,
                                help="Trace, open loop: simulated seconds after the last arrival."),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1,
                                       help="Parallel simulation processes (default: CPU count)."),
    batch: int = typer.Option(
        DEFAULT_BATCH, "--batch", min=1,
        help="Trials proposed per round; the sampler learns from a round once all of it has run. "
             "Fixed, so the result does not depend on --jobs."),
    executor: str = typer.Option(
        "process", "--executor",
        help="Where trials run: process (local processes, --jobs of them) or ray (Ray tasks: "
             "on the cluster RAY_ADDRESS names, else a local Ray with --jobs CPUs; the `ray` "
             "extra). The study is the same either way."),
    ceiling: bool = typer.Option(False, "--ceiling/--no-ceiling",
                                 help="Also run the ceiling (the same programs with unlimited KV) "
                                      "on the tuning and held-back data, for context."),
    out: Path = typer.Option(Path("tuned.yaml"), "--out", dir_okay=False, metavar="PATH",
                             help="Where the tuned `policy:` section is written (a policy file "
                                  "`sluice check-config` accepts; paste it into the serve config "
                                  "and the gateway hot-reloads it)."),
    json_path: Optional[Path] = typer.Option(None, "--json", dir_okay=False, metavar="PATH",
                                             help="Also write every trial and the check as JSON."),
    scheduling_policy: SchedulingPolicyOption = DEFAULT_SCHEDULING_POLICY,
) -> None:
    """Search a policy's keys on the simulator (Optuna): maximise output tokens/s subject to a
    p99 call-latency limit, check the best against the defaults on held-back data, write a
    `policy:` section."""
    model = step_time_model(preset, preset_file)
    check_scheduling_policy(scheduling_policy)
    if policy not in tuning.SEARCH_SPACES:
        raise usage_error(f"--policy {policy!r} has no search space; tunable: "
                          f"{', '.join(tuning.SEARCH_SPACES)}")
    if p99_limit is not None and not p99_limit > 0:
        raise usage_error(f"--p99-limit-s must be > 0, got {p99_limit}")
    if not p99_slack >= 1.0:
        raise usage_error(f"--p99-slack must be ≥ 1 (the defaults must be feasible), got {p99_slack}")
    jobs = jobs or os.cpu_count() or 1
    if executor not in ("process", "ray"):
        raise usage_error(f"--executor must be process or ray, got {executor!r}")
    pool = tuning.process_pool
    if executor == "ray":
        if importlib.util.find_spec("ray") is None:
            raise usage_error("--executor ray needs Ray: pip install 'agent-sluice[ray]'")
        pool = RayTasks

    if fmt is not None or trace is not None:
        tuning_data, held_back = _trace_scenarios(
            workload, fmt, trace, holdout_seed, holdout_fraction, concurrency, workers, model,
            time_scale, drain, duration, scheduling_policy)
    else:
        tuning_data, held_back = _workload_scenarios(
            workload or DEFAULT_WORKLOAD, concurrency or DEFAULT_CONCURRENCY, seed, holdout_seed,
            workers, model, duration or DEFAULT_DURATION_S, block_size, scheduling_policy)

    typer.echo(f"tuning {policy} on {tuning_data.label}: {trials} trials, {jobs} processes, "
               f"rounds of {batch}", err=True)
    try:
        study = tuning.run_study(policy, tuning_data, trials=trials, jobs=jobs, batch=batch,
                                 sampler_seed=seed, p99_limit_s=p99_limit, p99_slack=p99_slack,
                                 on_trial=lambda record, study: _report_trial(record, study, trials),
                                 pool=pool)
    except ValueError as err:
        raise usage_error(str(err)) from None

    best = study.best
    defaults = study.defaults
    chosen = best if best is not None else min(study.records, key=lambda r: r.p99_excess_s)
    tasks: list[tuple[Any, dict[str, Any] | None]] = [(held_back, defaults.keys)]
    if chosen is not defaults:
        tasks.append((held_back, chosen.keys))
    if ceiling:
        tasks += [(tuning_data, None), (held_back, None)]
    typer.echo(f"checking on {held_back.label}", err=True)
    measured = tuning.measure_all(tasks, jobs, pool)
    held_defaults = measured[0]
    held_best = measured[1] if chosen is not defaults else held_defaults
    ceilings = measured[-2:] if ceiling else []
    held_limit = p99_limit if p99_limit is not None else held_defaults.p99_call_s * p99_slack
    check = tuning.HeldBackCheck(defaults=held_defaults, best=held_best, p99_limit_s=held_limit)

    rows = _rows(defaults, chosen, held_defaults, held_best, ceilings)
    typer.echo(format_table(rows, extra=("data",)))
    verdict = _verdict(study, chosen, check)
    for line in verdict:
        typer.echo(line)

    comments = [f"made by: {command_line()}",
                f"tuning data: {tuning_data.label}; held-back data: {held_back.label}",
                f"p99 limit {study.p99_limit_s:.2f} s on the tuning data, {held_limit:.2f} s held back",
                _figures("tuning data", defaults.measurement, chosen.measurement),
                _figures("held-back data", held_defaults, held_best),
                *verdict]
    text = tuning.policy_yaml(chosen.keys, comments)
    _check_policy_file(text, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as err:
        raise usage_error(f"{out}: cannot write ({err.strerror or err})") from None
    typer.echo(f"wrote {out}")
    if json_path is not None:
        doc = {"config": {"command": command_line(), "policy": policy, "tuning_data": tuning_data.label,
                          "held_back_data": held_back.label, "trials": trials, "batch": batch,
                          "sampler_seed": seed, "scheduling_policy": scheduling_policy,
                          **preset_record(model, preset_file),
                          "p99_limit_s": study.p99_limit_s,
                          "held_back_p99_limit_s": held_limit},
               "trials": [record.as_json() for record in study.records],
               "best_trial": best.number if best is not None else None,
               "results": rows,
               "generalized": best is not None and chosen is not defaults and check.generalized}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")
        typer.echo(f"wrote {json_path}")


def _workload_scenarios(workload: str, concurrency: int, seed: int, holdout_seed: Optional[int],
                        workers: int, model: StepTimeModel, duration: float, block_size: int,
                        scheduling_policy: str):
    if workload not in WORKLOADS:
        raise usage_error(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    held_seed = seed + 1 if holdout_seed is None else holdout_seed
    if held_seed == seed:
        raise usage_error(f"--holdout-seed must differ from --seed ({seed}): the check needs "
                          "programs the search never saw")
    common = dict(workload=workload, concurrency=concurrency, workers=workers, preset=model,
                  duration_s=duration, block_size=block_size, scheduling_policy=scheduling_policy)
    where = f"{workload} CC{concurrency}, {workers} workers, {duration:.0f} s"
    return (tuning.WorkloadScenario(label=f"{where}, seed {seed}", seed=seed, **common),
            tuning.WorkloadScenario(label=f"{where}, seed {held_seed}", seed=held_seed, **common))


def _trace_scenarios(workload: Optional[str], fmt: Optional[str], trace: Optional[Path],
                     holdout_seed: Optional[int], fraction: float, concurrency: Optional[int],
                     workers: int, model: StepTimeModel, time_scale: float, drain: float,
                     duration: Optional[float], scheduling_policy: str):

    if workload is not None:
        raise usage_error("--workload and --format/--trace are two forms: give one")
    if fmt is None or trace is None:
        raise usage_error("a trace needs both --format and --trace")
    if holdout_seed is not None:
        raise usage_error("--holdout-seed applies to --workload; a trace is checked on its "
                          "last conversations (--holdout-fraction)")
    if not 0.0 < fraction < 1.0:
        raise usage_error(f"--holdout-fraction must be between 0 and 1, got {fraction}")
    if time_scale <= 0:
        raise usage_error(f"--time-scale must be > 0, got {time_scale}")
    programs, block_size = load_trace(fmt, trace, time_scale, model)
    try:
        tuning_part, held_part = tuning.held_back_split(programs, fraction)
    except ValueError as err:
        raise usage_error(f"{trace}: {err}") from None
    loop = "open loop" if concurrency is None else f"closed loop at {concurrency}"
    if concurrency is None:
        typer.echo("open loop: every session arrives at its recorded time, so output tokens/s is "
                   "the trace's own unless the fleet falls behind; --concurrency N (closed loop) "
                   "or --time-scale < 1 makes the throughput depend on the policy", err=True)
    common = dict(workers=workers, preset=model, block_size=block_size, concurrency=concurrency,
                  drain_s=drain, duration_cap_s=duration, scheduling_policy=scheduling_policy)
    name = f"{fmt} {trace.name}, {workers} workers, {loop}"
    return (tuning.TraceScenario(label=f"{name}, first {len(tuning_part)} sessions",
                          programs=tuple(tuning_part), **common),
            tuning.TraceScenario(label=f"{name}, last {len(held_part)} sessions (held back)",
                          programs=tuple(held_part), **common))


def _report_trial(record, study, trials: int) -> None:
    best = study.best
    best_text = (f"best {best.value:.0f} tok/s (trial {best.number})" if best is not None
                 else "no feasible trial yet")
    tag = " (defaults)" if record.number == 0 else ""
    state = "ok" if record.feasible else "over the limit"
    sys.stderr.write(f"trial {record.number + 1}/{trials}{tag}: {record.value:.0f} tok/s, p99 "
                     f"{record.measurement.p99_call_s:.1f} s ({state}; limit "
                     f"{study.p99_limit_s:.1f} s); {best_text}\n")
    sys.stderr.flush()


def _rows(defaults, chosen, held_defaults, held_best, ceilings) -> list[dict[str, Any]]:
    rows = [{**defaults.measurement.summary, "policy": "defaults", "data": "tuning"}]
    if chosen is not defaults:
        rows.append({**chosen.measurement.summary, "policy": f"trial {chosen.number}", "data": "tuning"})
    rows.append({**held_defaults.summary, "policy": "defaults", "data": "held back"})
    if chosen is not defaults:
        rows.append({**held_best.summary, "policy": f"trial {chosen.number}", "data": "held back"})
    for data, ceiling in zip(("tuning", "held back"), ceilings):
        rows.append({**ceiling.summary, "policy": "ceiling", "data": data})
    if ceilings:
        return (with_ceiling_ratio([row for row in rows if row["data"] == "tuning"])
                + with_ceiling_ratio([row for row in rows if row["data"] == "held back"]))
    return rows


def _figures(data: str, defaults, best) -> str:
    return (f"{data}: defaults {defaults.output_tokens_per_s:.0f} tok/s, p99 "
            f"{defaults.p99_call_s:.1f} s; tuned {best.output_tokens_per_s:.0f} tok/s, p99 "
            f"{best.p99_call_s:.1f} s ({best.output_tokens_per_s / defaults.output_tokens_per_s - 1:+.1%})")


def _verdict(study, chosen, check) -> list[str]:
    """What the run shows, plainly: no claim of success unless the held-back data shows it."""
    if study.best is None:
        return ["NO trial met the p99 limit on the tuning data (not even the defaults): the file "
                f"holds trial {chosen.number}, the one closest to the limit; it is not a tuned "
                "config; raise --p99-limit-s or drop it."]
    if chosen is study.defaults:
        return ["no trial beat the defaults on the tuning data: the file holds the defaults."]
    if check.generalized:
        small = (f" A gain under {SMALL_GAIN:.0%} is within what one more seed or trace part "
                 "can move; read it as a tie." if check.gain < SMALL_GAIN else "")
        return [f"the tuned config (trial {chosen.number}) beats the defaults on the held-back "
                f"data too: {check.gain:+.1%} output tokens/s, p99 "
                f"{check.best.p99_call_s:.1f} s within its limit of {check.p99_limit_s:.1f} s.{small}"]
    why = (f"{check.gain:+.1%} output tokens/s" if check.best.output_tokens_per_s
           <= check.defaults.output_tokens_per_s
           else f"p99 {check.best.p99_call_s:.1f} s over its limit of {check.p99_limit_s:.1f} s")
    return [f"did NOT generalize: the tuned config (trial {chosen.number}) beats the defaults on "
            f"the tuning data but not on the held-back data ({why}); keep the defaults unless "
            "more data says otherwise."]


def _check_policy_file(text: str, out: Path) -> None:
    """The file must be one `check-config` and `serve` accept; a failure here is a bug in
    the search space, so it is raised, not reported as the user's error."""
    from scheduler.config_reading import parse_policy_yaml

    parse_policy_yaml(text, str(out))


__all__ = ["tune"]


class RayTasks:
    """Trials as Ray tasks, one CPU each: on a Ray cluster (``RAY_ADDRESS``) they spread over
    its nodes; without one, a local Ray with ``jobs`` CPUs. Results come back in order, so
    the study does not depend on where they ran."""

    def __init__(self, jobs: int) -> None:
        self._jobs = jobs
        self._started_ray = False

    def __enter__(self) -> RayTasks:
        import ray

        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                # a local cluster on this machine: its node binds and advertises loopback only
                ray.init(_node_ip_address="127.0.0.1", num_cpus=self._jobs, include_dashboard=False,
                         log_to_driver=False)
            self._started_ray = True
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        if self._started_ray:
            ray.shutdown()

    def map(self, fn: Any, items: Any) -> list[Any]:
        import ray

        task = ray.remote(num_cpus=1)(fn)
        return ray.get([task.remote(item) for item in items])
