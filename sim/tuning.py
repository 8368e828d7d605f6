"""``sluice tune``: search a policy's keys on the simulator (Optuna), then check the best on
data the search never saw.

What is searched, and why these ranges
--------------------------------------
The program-aware keys that change admission decisions (architecture.md §3); each range is
a step grid, so a sampled value is exactly the value written to the YAML file:

=======================  ==============  ======  ===============================================
key                      range           step    why the bounds
=======================  ==============  ======  ===============================================
pause_threshold          0.85 – 1.30     0.01    below 0.85 holds >15% of the pool back (v1, measured
                                                 worse); far past 1.0 most active KV cannot stay
                                                 resident and every call re-prefills
pause_target_gap         0.00 – 0.20     0.01    pause_target = pause_threshold − gap (so the target
                                                 never passes the threshold)
resume_hysteresis        0.00 – 0.15     0.01    resume only below threshold − this; v1's 0.10 was
                                                 already a wide band
soft_band_delay_s        0 – 10          0.5     a queue delay; past 10 s it is a hold by another name
buffer_per_program       0 – 1000        50      tokens; a typical output is ~500
growth_reserve_tokens    0 – 2048        64      tokens a call in flight may still add (its output)
acting_token_weight      0.50 – 1.00     0.05    below half, idle KV barely counts and pauses stop
max_wait_s               15 – 240        5       the tail bound; below 15 s every wait is cut short
dormant_min_s            10 – 300        5       SWE-bench tool calls run seconds to minutes
dormant_quantile         0.10 – 0.95     0.05    a quantile of recent tool-call durations
dormant_token_weight     0.00 – 1.00     0.05    the whole range (0: off, 1: dormancy has no effect)
resume_aging_halflife_s  10 – 300        10      aging of the resume order
=======================  ==============  ======  ===============================================

Every default lies on its grid, so the defaults are trial 0 exactly.

The objective and the constraint
--------------------------------
Objective: output tokens/s of the simulation (:func:`objective`). Constraint: the p99 call
latency must not exceed a limit (:func:`p99_excess_s` ≤ 0), given to Optuna as a trial
constraint (``Trial.set_constraint``): the TPE sampler then models feasible and infeasible
trials apart, and an infeasible trial is never the best (no penalty is folded into the
value, so every reported throughput is the simulation's own). :func:`best_record` applies
the same rule to the records.

Determinism
-----------
Trial 0 is the defaults and runs alone (its p99 sets the default limit). The others are
proposed in rounds of ``batch`` trials by a seeded sampler; a round's results are told to the
sampler in trial order once the whole round has run. Each simulation is deterministic, so
the study depends on the seed and the round size, not on how many processes ran it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from scheduler.config import PolicyConfig

from scheduler.config_reading import make_policy_config
from sim.programs import ProgramSpec
from sim.runs import (DEFAULT_BLOCK_SIZE, DEFAULT_SCHEDULING_POLICY, run_policies, trace_span_s,
                      workload_feed)
from sim.feeds import ConversationLoop, OpenLoop, ProgramFeed, group_conversations, shifted_program
from sim.simulation import SimResult
from sim.step_time import PresetSpec


# -- the search space ----------------------------------------------------------------------


@dataclass(frozen=True)
class Dimension:
    """One searched key: a grid from ``low`` to ``high`` in steps of ``step``."""

    key: str
    low: float
    high: float
    step: float
    integer: bool = False

    @property
    def digits(self) -> int:
        """Decimals that show every point of the grid (0.05 → 2, 5 → 0)."""
        digits = 0
        while round(self.step * 10 ** digits) != self.step * 10 ** digits and digits < 6:
            digits += 1
        return digits

    def snap(self, value: float) -> float | int:
        """``value`` as written: an int for integer keys, else rounded to the grid's decimals."""
        return int(round(value)) if self.integer else round(float(value), self.digits)

    def contains(self, value: float) -> bool:
        points = (value - self.low) / self.step
        return self.low <= value <= self.high and abs(points - round(points)) < 1e-6


# pause_target is searched as its gap below pause_threshold, so every point is valid.
PAUSE_TARGET_GAP = "pause_target_gap"

PROGRAM_AWARE_SPACE: tuple[Dimension, ...] = (
    Dimension("pause_threshold", 0.85, 1.30, 0.01),
    Dimension(PAUSE_TARGET_GAP, 0.0, 0.20, 0.01),
    Dimension("resume_hysteresis", 0.0, 0.15, 0.01),
    Dimension("soft_band_delay_s", 0.0, 10.0, 0.5),
    Dimension("buffer_per_program", 0, 1000, 50, integer=True),
    Dimension("growth_reserve_tokens", 0, 2048, 64, integer=True),
    Dimension("acting_token_weight", 0.5, 1.0, 0.05),
    Dimension("max_wait_s", 15.0, 240.0, 5.0),
    Dimension("dormant_min_s", 10.0, 300.0, 5.0),
    Dimension("dormant_quantile", 0.10, 0.95, 0.05),
    Dimension("dormant_token_weight", 0.0, 1.0, 0.05),
    Dimension("resume_aging_halflife_s", 10.0, 300.0, 10.0),
)

# The policies with a search space; `sluice tune --policy` accepts these.
SEARCH_SPACES: dict[str, tuple[Dimension, ...]] = {"program_aware": PROGRAM_AWARE_SPACE}


def search_space(policy: str) -> tuple[Dimension, ...]:
    try:
        return SEARCH_SPACES[policy]
    except KeyError:
        raise ValueError(f"no search space for policy {policy!r}; tunable: "
                         f"{', '.join(SEARCH_SPACES)}") from None


def default_params(policy: str) -> dict[str, float | int]:
    """The search parameters of the policy's default section (trial 0)."""
    defaults = make_policy_config({"name": policy})
    params: dict[str, float | int] = {}
    for dim in search_space(policy):
        if dim.key == PAUSE_TARGET_GAP:
            value = defaults.pause_threshold - defaults.pause_target  # type: ignore[attr-defined]
        else:
            value = getattr(defaults, dim.key)
        params[dim.key] = dim.snap(value)
        if not dim.contains(params[dim.key]):
            raise ValueError(f"{policy}: the default {dim.key} = {value} is off its search grid "
                             f"({dim.low}–{dim.high} step {dim.step})")
    return params


def policy_keys(policy: str, params: dict[str, float | int]) -> dict[str, Any]:
    """The ``policy:`` section of a point of the search space (``name`` first)."""
    keys: dict[str, Any] = {"name": policy}
    for dim in search_space(policy):
        value = dim.snap(params[dim.key])
        if dim.key == PAUSE_TARGET_GAP:
            keys["pause_target"] = round(max(0.0, keys["pause_threshold"] - value), dim.digits)
        else:
            keys[dim.key] = value
    return keys


def policy_config(keys: dict[str, Any]) -> PolicyConfig:
    return make_policy_config(keys)


# -- the objective and the constraint -------------------------------------------------------


def objective(result: SimResult) -> float:
    """What the search maximises: output tokens per simulated second."""
    return result.output_tokens_per_s


def p99_excess_s(p99_call_s: float, limit_s: float) -> float:
    """Seconds the p99 call latency is over ``limit_s`` (≤ 0: feasible). A run with no
    completed call has no p99 and is infeasible."""
    if math.isnan(p99_call_s):
        return math.inf
    return p99_call_s - limit_s


def default_p99_limit_s(defaults_p99_s: float, slack: float) -> float:
    """The default limit: the defaults' own p99 on the same data times ``slack``."""
    if slack < 1.0:
        raise ValueError(f"the p99 slack must be ≥ 1 (the defaults must be feasible), got {slack}")
    return defaults_p99_s * slack


# -- the data a config is measured on --------------------------------------------------------


class Scenario(Protocol):
    label: str
    workers: int
    preset: PresetSpec  # a named preset or a model (one read from a preset file)
    block_size: int
    scheduling_policy: str  # the engines' vLLM --scheduling-policy

    def feed(self) -> ProgramFeed: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def stop_when_done(self) -> bool: ...


@dataclass(frozen=True)
class WorkloadScenario:
    """A synthetic workload at one seed (a closed loop or GRPO batches)."""

    label: str
    workload: str
    concurrency: int
    seed: int
    workers: int
    preset: PresetSpec
    duration_s: float
    block_size: int = DEFAULT_BLOCK_SIZE
    stop_when_done: bool = False
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY

    def feed(self) -> ProgramFeed:
        return workload_feed(self.workload, self.concurrency, self.seed)


@dataclass(frozen=True)
class TraceScenario:
    """A part of a trace: open loop (each session at its recorded time, the run capped at
    the part's span plus ``drain_s``) or closed loop at ``concurrency`` conversations."""

    label: str
    programs: tuple[ProgramSpec, ...]
    workers: int
    preset: PresetSpec
    block_size: int
    concurrency: int | None = None
    drain_s: float = 1800.0
    duration_cap_s: float | None = None
    stop_when_done: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY

    @property
    def duration_s(self) -> float:
        if self.duration_cap_s is not None:
            return self.duration_cap_s
        if self.concurrency is None:
            return trace_span_s(self.programs) + self.drain_s
        return math.inf

    def feed(self) -> ProgramFeed:
        if self.concurrency is None:
            # each run gets its own copies: a program grows its hash stream as it plays
            return OpenLoop(dataclasses.replace(spec, _stream=[]) for spec in self.programs)
        return ConversationLoop(self.programs, self.concurrency)


def held_back_split(programs: Sequence[ProgramSpec], fraction: float
                    ) -> tuple[list[ProgramSpec], list[ProgramSpec]]:
    """The trace's conversations (a top-level session with its sub-agents) ordered by start
    time: the first ``1 − fraction`` to tune on, the last ``fraction`` (at least one, never
    all) held back. Each part is moved to start at time 0, so both replay from their first
    arrival and an open-loop run does not idle through the other part's span."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-back fraction must be in (0, 1), got {fraction}")
    conversations = group_conversations(list(programs))
    if len(conversations) < 2:
        raise ValueError(f"a held-back part needs at least 2 conversations; the trace has "
                         f"{len(conversations)}")
    conversations.sort(key=lambda group: min(spec.start_at for spec in group))
    held = min(len(conversations) - 1, max(1, round(len(conversations) * fraction)))
    cut = len(conversations) - held
    return _rebased(conversations[:cut]), _rebased(conversations[cut:])


def _rebased(conversations: list[list[ProgramSpec]]) -> list[ProgramSpec]:
    programs = [spec for group in conversations for spec in group]
    start = min(spec.start_at for spec in programs)
    moved = [shifted_program(spec, start, 0.0) for spec in programs]
    return sorted(moved, key=lambda spec: (spec.start_at, spec.index))


# -- measuring a config ------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """What a run of one config on one scenario gave (picklable: crosses processes)."""

    output_tokens_per_s: float
    p99_call_s: float
    hit_rate: float
    summary: dict[str, Any]


def measure(scenario: Scenario, keys: dict[str, Any] | None) -> Measurement:
    """Run ``scenario`` under the policy section ``keys``; None: the ceiling (unlimited KV)."""
    if keys is None:
        [result] = run_policies([], scenario.feed, workers=scenario.workers, preset=scenario.preset,
                                duration_s=scenario.duration_s, block_size=scenario.block_size,
                                stop_when_done=scenario.stop_when_done, show_progress=False,
                                ceiling=True, scheduling_policy=scenario.scheduling_policy)
    else:
        config = policy_config(keys)
        [result] = run_policies([config.name], scenario.feed, workers=scenario.workers,
                                preset=scenario.preset, duration_s=scenario.duration_s,
                                block_size=scenario.block_size, policy_config=config,
                                stop_when_done=scenario.stop_when_done, show_progress=False,
                                scheduling_policy=scenario.scheduling_policy)
    return Measurement(output_tokens_per_s=objective(result),
                       p99_call_s=result.latency_quantile(0.99), hit_rate=result.hit_rate,
                       summary=result.summary())


def _measure_task(task: tuple[Scenario, dict[str, Any] | None]) -> Measurement:
    scenario, keys = task
    return measure(scenario, keys)


# -- the study -----------------------------------------------------------------------------------


@dataclass
class TrialRecord:
    number: int
    params: dict[str, float | int]
    keys: dict[str, Any]
    measurement: Measurement
    p99_excess_s: float = math.nan

    @property
    def feasible(self) -> bool:
        return self.p99_excess_s <= 0.0

    @property
    def value(self) -> float:
        return self.measurement.output_tokens_per_s

    def as_json(self) -> dict[str, Any]:
        return {"number": self.number, "params": self.params, "policy": self.keys,
                "output_tokens_per_s": round(self.value, 2),
                "p99_call_s": round(self.measurement.p99_call_s, 3),
                "hit_rate": round(self.measurement.hit_rate, 4), "feasible": self.feasible}


def best_record(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The feasible trial with the highest throughput (ties: the earlier trial, so the
    defaults win a tie); None when no trial is feasible."""
    feasible = [record for record in records if record.feasible]
    if not feasible:
        return None
    return max(feasible, key=lambda record: (record.value, -record.number))


@dataclass
class Study:
    records: list[TrialRecord] = field(default_factory=list)
    p99_limit_s: float = math.nan

    @property
    def defaults(self) -> TrialRecord:
        return self.records[0]

    @property
    def best(self) -> TrialRecord | None:
        return best_record(self.records)


def round_sizes(trials: int, batch: int) -> list[int]:
    """Trial 0 alone, then rounds of ``batch`` (the last one what is left)."""
    rest = trials - 1
    return [1] + [batch] * (rest // batch) + ([rest % batch] if rest % batch else [])


def process_pool(jobs: int) -> ProcessPoolExecutor:
    """The default place trials run: ``jobs`` local processes."""
    return ProcessPoolExecutor(max_workers=jobs)


def run_study(policy: str, scenario: Scenario, *, trials: int, jobs: int, batch: int,
              sampler_seed: int, p99_limit_s: float | None, p99_slack: float,
              on_trial: Callable[[TrialRecord, Study], None],
              pool: Callable[[int], Any] = process_pool) -> Study:
    """Trial 0 (the defaults) first, then rounds of ``batch`` trials on ``jobs`` processes
    (``pool(jobs)``: a context manager with ``map``, e.g. a process pool or Ray tasks);
    ``on_trial`` is called after each trial is told, in trial order."""
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution

    if trials < 1 or jobs < 1 or batch < 1:
        raise ValueError(f"trials, jobs and batch must be ≥ 1, got {trials}, {jobs}, {batch}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = {
        dim.key: IntDistribution(int(dim.low), int(dim.high), step=int(dim.step)) if dim.integer
        else FloatDistribution(dim.low, dim.high, step=dim.step)
        for dim in search_space(policy)
    }
    with warnings.catch_warnings():
        # multivariate TPE is marked experimental; it models the keys' interactions
        # (threshold with gap and hysteresis), which independent sampling would not
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=sampler_seed, multivariate=True, constant_liar=True)
    optuna_study = optuna.create_study(direction="maximize", sampler=sampler)
    optuna_study.enqueue_trial(default_params(policy))
    study = Study()

    with pool(jobs) as workers:
        for size in round_sizes(trials, batch):
            asked = [optuna_study.ask(distributions) for _ in range(size)]
            points = [(trial, policy_keys(policy, trial.params)) for trial in asked]
            results = workers.map(_measure_task, [(scenario, keys) for _, keys in points])
            for (trial, keys), measurement in zip(points, results):
                if trial.number == 0:
                    if math.isnan(measurement.p99_call_s):
                        raise ValueError("the defaults completed no call on the tuning data; "
                                         "give the runs more simulated time")
                    study.p99_limit_s = (p99_limit_s if p99_limit_s is not None
                                         else default_p99_limit_s(measurement.p99_call_s, p99_slack))
                record = TrialRecord(number=trial.number, params=dict(trial.params), keys=keys,
                                     measurement=measurement,
                                     p99_excess_s=p99_excess_s(measurement.p99_call_s,
                                                               study.p99_limit_s))
                trial.set_user_attr("p99_call_s", measurement.p99_call_s)
                # Optuna wants a finite constraint; a run without a p99 is just very infeasible
                trial.set_constraint("p99_excess_s", min(record.p99_excess_s, 1e9))
                optuna_study.tell(trial, record.value)
                study.records.append(record)
                on_trial(record, study)
    return study


def measure_all(tasks: Sequence[tuple[Scenario, dict[str, Any] | None]], jobs: int,
                pool: Callable[[int], Any] = process_pool) -> list[Measurement]:
    """Each (scenario, keys) measured, in parallel; None keys: the ceiling."""
    with pool(max(1, min(jobs, len(tasks)))) as workers:
        return list(workers.map(_measure_task, tasks))


# -- the verdict and the file --------------------------------------------------------------------


@dataclass(frozen=True)
class HeldBackCheck:
    defaults: Measurement
    best: Measurement
    p99_limit_s: float

    @property
    def gain(self) -> float:
        """The best's throughput over the defaults' on the held-back data, minus 1."""
        return self.best.output_tokens_per_s / self.defaults.output_tokens_per_s - 1.0

    @property
    def generalized(self) -> bool:
        """The best beats the defaults on the held-back data and keeps its p99 limit there."""
        return (self.best.output_tokens_per_s > self.defaults.output_tokens_per_s
                and p99_excess_s(self.best.p99_call_s, self.p99_limit_s) <= 0.0)


def policy_yaml(keys: dict[str, Any], comments: Sequence[str]) -> str:
    """A policy file: ``# comment`` lines, then ``policy: {name: ..., key: value ...}``."""
    header = "".join(f"# {line}\n" for comment in comments for line in comment.splitlines())
    body = yaml.safe_dump({"policy": keys}, sort_keys=False, default_flow_style=False)
    return header + body


__all__ = ["Dimension", "HeldBackCheck", "Measurement", "PROGRAM_AWARE_SPACE",
           "SEARCH_SPACES", "Study", "TraceScenario", "TrialRecord", "WorkloadScenario",
           "best_record", "default_p99_limit_s", "default_params", "held_back_split", "measure",
           "measure_all", "objective", "p99_excess_s", "policy_config", "policy_keys",
           "policy_yaml", "round_sizes", "run_study", "search_space"]
