"""A GRPO-style rollout through the Sluice gateway on Ray: agent programs as Ray tasks.

For each policy compared (one gateway actor per policy, in front of fresh simworker actors
unless ``--engines`` names real ones), ``--steps`` rollout steps run one after another. A step
is one training batch: ``--prompts`` tasks × ``--samples`` samples each (GRPO's group), every
sample one agent program run as a Ray task, and the step ends when its last program does
(the trainer's barrier). A program is a few turns of chat completions through the gateway
with the official ``openai`` SDK: its context grows turn by turn (the shared system prompt,
the task, then each reply and a tool observation), a simulated tool call sleeps between
turns, and ``x-session-id`` names the program (``x-dynamo-session-final`` on its last call).

Per step it prints the batch makespan (submit to barrier) and the rollout throughput (output
tokens / makespan); at the end, a comparison of the policies and what each gateway's own
``/metrics`` counted. The programs are :class:`sim.workloads.RlSweWorkload` episodes scaled
down to small simulated KV pools (as ``sluice demo`` scales its agents), the same programs
under every policy.

    python -m ray_fleet.rollout                         # 2 simworkers, 3 steps x 32 programs
    python -m ray_fleet.rollout --workers 4 --prompts 16 --samples 8 --steps 5
    python -m ray_fleet.rollout --address auto --engines sluice.yaml --model M   # a cluster

Locally Ray is started with as many logical CPUs as the run holds tasks and actors at once
(the programs mostly wait on the network and their tools), so the machine's own core count
does not throttle them. Before the measured steps of each policy a warm-up batch of empty
tasks starts the Ray worker processes the programs will reuse, so the first step's makespan
is not Ray's process start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from entry.agent_client import filler
from sim.step_time import DEFAULT_PRESET
from sim.workloads import LogNormal, RlSweWorkload

DEFAULT_POLICIES = ("program_aware", "least_loaded")
# The gateway checks no API key; the openai SDK insists on one.
API_KEY = "sluice-local"
CHAT_ROUTE = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class RolloutSetup:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    workers: int = 2
    steps: int = 3
    prompts: int = 8            # P tasks per step
    samples: int = 4            # G samples per task (GRPO's group)
    blocks: int = 640           # KV blocks per simworker (null block included)
    block_size: int = 16
    preset: str = DEFAULT_PRESET
    time_scale: float = 0.25    # wall seconds per model second, simworkers and tool calls alike
    # A re-prefill of these short contexts costs what a long one does on a GPU (the live
    # demo's reasoning: entry/live_demo.py, DemoSetup.prefill_scale).
    prefill_scale: float = 20.0
    system_tokens: int = 512
    min_turns: int = 3
    max_turns: int = 6
    seed: int = 7
    model: str = "sluice-sim"
    # Ray resources: a program spends its time waiting on the gateway or its tool.
    program_cpus: float = 1.0
    gateway_cpus: float = 1.0
    simworker_cpus: float = 1.0
    client_retries: int = 0     # the openai SDK's own retries; 0 so every failure shows
    call_timeout_s: float = 300.0
    # The default reserve (512, sized for real agent turns) would hold back much of these
    # small pools for calls in flight (the live demo's reasoning).
    growth_reserve_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "prompts", "samples", "min_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"max_turns must be ≥ min_turns, got {self.max_turns} < {self.min_turns}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not self.policies:
            raise ValueError("name at least one policy")

    @property
    def programs_per_step(self) -> int:
        return self.prompts * self.samples

    @property
    def capacity_tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def workload(self) -> RlSweWorkload:
        """rl_swe episodes scaled to the simworkers' small pools: a 512-token system prompt,
        short tasks, a few turns of short replies and observations."""
        return RlSweWorkload(
            self.seed, self.prompts, self.samples,
            shared_prefix_tokens=self.system_tokens,
            task_tokens=LogNormal(200, 0.5, 64, 1024),
            min_turns=self.min_turns,
            max_turns=self.max_turns,
            extra_turns=LogNormal(1.5, 0.8, 0, 100),
            output_tokens=LogNormal(64, 0.5, 16, 256),
            observation_tokens=LogNormal(150, 0.8, 16, 1024),
            tool_latency_s=LogNormal(2.0, 0.8, 0.2, 20.0),
            test_run_probability=0.05,
            test_run_latency_s=LogNormal(8.0, 0.5, 2.0, 20.0),
            max_context_tokens=self.capacity_tokens // 2,
        )

    def gateway_config(self, policy: str, *, simulated: bool) -> dict[str, Any]:
        """The gateway actor's config (it adds ``listen`` and ``workers`` itself). The
        growth reserve is scaled down only for the simworkers' small pools."""
        section: dict[str, Any] = {"name": policy}
        if simulated:
            section["growth_reserve_tokens"] = self.growth_reserve_tokens
        return {
            "admin_token_env": None,
            "health_interval_s": 1.0,
            "capacity_retry_s": 0.5,
            "reload_poll_s": 0,
            "log_level": "warning",
            # Short: a gateway is stopped only once its step barrier has passed.
            "shutdown_grace_s": 5.0,
            "policy": section,
        }

    def simworker_settings(self) -> dict[str, Any]:
        return {"model": self.model, "preset": self.preset, "num_blocks": self.blocks,
                "block_size": self.block_size, "time_scale": self.time_scale,
                "prefill_scale": self.prefill_scale}


@dataclass(frozen=True, slots=True)
class Turn:
    output_tokens: int
    observation_tokens: int  # the tool's output appended before this turn's call (0 for the first)
    tool_s: float            # model seconds of the tool call before this turn's call


@dataclass(frozen=True, slots=True)
class AgentProgram:
    """What one Ray task plays: the conversation's shape, its texts drawn from the keys."""

    session_id: str
    system_tokens: int
    task_key: str            # the same for a task's G samples: they share the prompt
    task_tokens: int
    turns: tuple[Turn, ...]


def agent_programs(setup: RolloutSetup, step: int) -> list[AgentProgram]:
    workload = setup.workload()
    programs = []
    for spec in workload.batch(step):
        calls = spec.calls
        turns = [Turn(calls[0].output_tokens, 0, 0.0)]
        for previous, call in zip(calls, calls[1:]):
            observed = call.prompt_tokens - previous.prompt_tokens - previous.output_tokens
            turns.append(Turn(call.output_tokens, max(1, observed), call.think_s))
        programs.append(AgentProgram(
            session_id=spec.session_id, system_tokens=setup.system_tokens,
            task_key=f"task-{spec.family}",
            task_tokens=max(1, spec.shared_prefix_tokens - setup.system_tokens),
            turns=tuple(turns)))
    return programs


@dataclass(slots=True)
class ProgramOutcome:
    session_id: str
    calls: int = 0
    failed_calls: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    duration_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.failed_calls == 0


def play_agent_program(gateway_url: str, program: AgentProgram, *, model: str, time_scale: float,
                       client_retries: int, call_timeout_s: float) -> ProgramOutcome:
    """One agent program through the gateway with the openai SDK (the body of a Ray task).
    A failed call ends the program (its later turns would build on the missing reply) and
    is reported in the outcome."""
    import openai

    outcome = ProgramOutcome(program.session_id)
    started = time.monotonic()
    messages: list[dict[str, str]] = [
        {"role": "system", "content": filler(program.system_tokens, "system")},
        {"role": "user", "content": filler(program.task_tokens, program.task_key)},
    ]
    last = len(program.turns) - 1
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=API_KEY, max_retries=client_retries,
                       timeout=call_timeout_s) as client:
        for k, turn in enumerate(program.turns):
            if k > 0:
                time.sleep(turn.tool_s * time_scale)  # the tool call
                messages.append({"role": "user", "content": filler(
                    turn.observation_tokens, f"{program.session_id}/{k}")})
            headers = {"x-session-id": program.session_id}
            if k == last:
                headers["x-dynamo-session-final"] = "true"
            try:
                answer = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=turn.output_tokens,
                    extra_headers=headers)
            except openai.APIError as err:
                outcome.failed_calls += 1
                outcome.errors.append(f"{program.session_id} call {k}: {type(err).__name__}: {err}")
                break
            outcome.calls += 1
            usage = answer.usage
            if usage is not None:
                outcome.output_tokens += usage.completion_tokens
                outcome.prompt_tokens += usage.prompt_tokens
                details = usage.prompt_tokens_details
                outcome.cached_tokens += (details.cached_tokens or 0) if details else 0
            messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    outcome.duration_s = time.monotonic() - started
    return outcome


def start_worker_process() -> int:
    """A warm-up task: import what a program needs, so the Ray worker running it is ready."""
    import os

    import openai  # noqa: F401  (the import is the point: it is the slow part of a cold start)

    time.sleep(0.2)  # held a moment, so the warm-up batch's tasks run side by side
    return os.getpid()


@dataclass(slots=True)
class StepReport:
    step: int
    programs: int
    completed_programs: int
    calls: int
    failed_calls: int
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    makespan_s: float
    mean_program_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "hit_rate": round(self.hit_rate, 4)}


def step_report(step: int, outcomes: Sequence[ProgramOutcome], makespan_s: float) -> StepReport:
    return StepReport(
        step=step, programs=len(outcomes),
        completed_programs=sum(o.completed for o in outcomes),
        calls=sum(o.calls for o in outcomes),
        failed_calls=sum(o.failed_calls for o in outcomes),
        output_tokens=sum(o.output_tokens for o in outcomes),
        prompt_tokens=sum(o.prompt_tokens for o in outcomes),
        cached_tokens=sum(o.cached_tokens for o in outcomes),
        makespan_s=makespan_s,
        mean_program_s=statistics.fmean(o.duration_s for o in outcomes) if outcomes else 0.0)


def gateway_counts(metrics_text: str) -> dict[str, float]:
    """What the gateway's /metrics counted: chat completions answered 200 and otherwise,
    pauses, resumes and holds."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"chat_ok": 0.0, "other_answers": 0.0, "pauses": 0.0, "resumes": 0.0, "holds": 0.0}
    wanted = {"sluice_pauses_total": "pauses", "sluice_resumes_total": "resumes",
              "sluice_holds_total": "holds"}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "sluice_requests_total":
                ok = sample.labels.get("route") == CHAT_ROUTE and sample.labels.get("status") == "200"
                counts["chat_ok" if ok else "other_answers"] += sample.value
            elif sample.name in wanted:
                counts[wanted[sample.name]] += sample.value
    return counts


@dataclass(slots=True)
class PolicyReport:
    policy: str
    gateway_url: str
    engines: list[str]
    steps: list[StepReport] = field(default_factory=list)
    gateway_metrics: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.steps)

    @property
    def failed_calls(self) -> int:
        return sum(s.failed_calls for s in self.steps)

    def summary(self) -> dict[str, float]:
        makespans = [s.makespan_s for s in self.steps]
        output = sum(s.output_tokens for s in self.steps)
        prompt = sum(s.prompt_tokens for s in self.steps)
        return {
            "output_tokens_per_s": round(output / sum(makespans), 1) if sum(makespans) else 0.0,
            "makespan_mean_s": round(statistics.fmean(makespans), 2),
            "makespan_max_s": round(max(makespans), 2),
            "hit_rate": round(sum(s.cached_tokens for s in self.steps) / prompt, 4) if prompt else 0.0,
            "calls": self.calls,
            "failed_calls": self.failed_calls,
            "gateway_chat_ok": self.gateway_metrics.get("chat_ok", 0.0),
            "pauses": self.gateway_metrics.get("pauses", 0.0),
            "resumes": self.gateway_metrics.get("resumes", 0.0),
        }

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "gateway_url": self.gateway_url, "engines": self.engines,
                "summary": self.summary(), "steps": [s.as_dict() for s in self.steps],
                "gateway_metrics": self.gateway_metrics, "error_samples": self.error_samples}


def format_step(report: StepReport, steps: int) -> str:
    return (f"  step {report.step + 1}/{steps}: makespan {report.makespan_s:6.2f} s  "
            f"rollout {report.output_tokens_per_s:7.1f} output tokens/s  "
            f"({report.output_tokens:,} tokens, {report.calls} calls, {report.failed_calls} failed, "
            f"{report.completed_programs}/{report.programs} programs, hit rate {report.hit_rate:.1%}, "
            f"mean program {report.mean_program_s:.2f} s)")


def format_comparison(reports: Sequence[PolicyReport]) -> list[str]:
    rows = [("output_tokens_per_s", "rollout output tokens/s", "{:.1f}"),
            ("makespan_mean_s", "batch makespan mean (s)", "{:.2f}"),
            ("makespan_max_s", "batch makespan max (s)", "{:.2f}"),
            ("hit_rate", "prefix-cache hit rate", "{:.1%}"),
            ("calls", "calls", "{}"), ("failed_calls", "failed calls", "{}"),
            ("gateway_chat_ok", "gateway /metrics 200s", "{:.0f}"),
            ("pauses", "pauses", "{:.0f}"), ("resumes", "resumes", "{:.0f}")]
    summaries = [report.summary() for report in reports]
    lines = ["", "summary (the same programs under each policy):",
             f"  {'':<26}" + "".join(f"{report.policy:>16}" for report in reports)]
    for key, label, fmt in rows:
        lines.append(f"  {label:<26}" + "".join(f"{fmt.format(s[key]):>16}" for s in summaries))
    return lines


class Fleet:
    """The actors of one policy's run: its engines (simworkers unless given) and gateway."""

    def __init__(self, setup: RolloutSetup, policy: str, engines: list[dict[str, Any]] | None) -> None:
        self.setup = setup
        self.policy = policy
        self.given_engines = engines
        self.simworkers: list[Any] = []
        self.gateway: Any = None

    def start(self) -> tuple[str, dict[str, int]]:
        """Start the actors; the gateway's URL and each engine's capacity once it is ready."""
        import ray

        from ray_fleet.actors import start_gateway, start_simworker

        setup = self.setup
        engines: list[Any]
        if self.given_engines is not None:
            engines = list(self.given_engines)
        else:
            self.simworkers = [
                start_simworker(f"w{i}", setup.simworker_settings(), num_cpus=setup.simworker_cpus,
                                scheduling_strategy="SPREAD")
                for i in range(setup.workers)]
            engines = self.simworkers
        config = setup.gateway_config(self.policy, simulated=self.given_engines is None)
        self.gateway = start_gateway(config, engines, num_cpus=setup.gateway_cpus)
        url = ray.get(self.gateway.url.remote())
        capacities = ray.get(self.gateway.wait_ready.remote(60.0))
        return url, capacities

    def stop(self) -> None:
        import ray

        actors = [actor for actor in [self.gateway, *self.simworkers] if actor is not None]
        # A graceful stop first (the gateway drains, the simworkers close their sockets);
        # then the processes go, even when an actor failed to stop (or to start).
        try:
            ray.get([actor.stop.remote() for actor in actors], timeout=60.0)
        finally:
            for actor in actors:
                ray.kill(actor)


def warm_up(setup: RolloutSetup) -> None:
    import ray

    task = ray.remote(start_worker_process).options(num_cpus=setup.program_cpus)
    ray.get([task.remote() for _ in range(setup.programs_per_step)])


def run_steps(setup: RolloutSetup, gateway_url: str, emit: Callable[[str], None]) -> tuple[list[StepReport], list[str]]:
    import ray

    task = ray.remote(play_agent_program).options(num_cpus=setup.program_cpus, max_retries=0)
    reports: list[StepReport] = []
    errors: list[str] = []
    for step in range(setup.steps):
        programs = agent_programs(setup, step)
        started = time.monotonic()
        refs = [task.remote(gateway_url, program, model=setup.model, time_scale=setup.time_scale,
                            client_retries=setup.client_retries, call_timeout_s=setup.call_timeout_s)
                for program in programs]
        outcomes: list[ProgramOutcome] = ray.get(refs)  # the barrier: the trainer waits for all
        report = step_report(step, outcomes, time.monotonic() - started)
        reports.append(report)
        errors.extend(error for outcome in outcomes for error in outcome.errors)
        emit(format_step(report, setup.steps))
    return reports, errors


def run_policy(setup: RolloutSetup, policy: str, engines: list[dict[str, Any]] | None,
               emit: Callable[[str], None]) -> PolicyReport:
    import httpx

    fleet = Fleet(setup, policy, engines)
    try:
        url, capacities = fleet.start()
        kv = ", ".join(f"{name} {tokens:,}" for name, tokens in capacities.items())
        emit(f"\n== {policy}: gateway actor at {url}; engines (tokens of KV): {kv}; "
             f"{setup.steps} steps x {setup.programs_per_step} programs "
             f"({setup.prompts} tasks x {setup.samples} samples), time scale {setup.time_scale}")
        warm_up(setup)
        steps, errors = run_steps(setup, url, emit)
        metrics_text = httpx.get(f"{url}/metrics", timeout=10.0).text
        report = PolicyReport(policy, url, list(capacities), steps, gateway_counts(metrics_text),
                              errors[:5])
        made = report.calls + report.failed_calls
        emit(f"  gateway /metrics: {report.gateway_metrics['chat_ok']:.0f} chat completions answered "
             f"200 ({made} made by the programs), {report.gateway_metrics['other_answers']:.0f} other "
             f"answers; pauses {report.gateway_metrics['pauses']:.0f}, "
             f"resumes {report.gateway_metrics['resumes']:.0f}")
        for error in report.error_samples:
            emit(f"  failed: {error}")
        return report
    finally:
        fleet.stop()


def local_cpus(setup: RolloutSetup) -> int:
    """Logical CPUs for a local Ray: room for a whole step's programs and the actors at once."""
    import math
    import os

    needed = (setup.programs_per_step * setup.program_cpus + setup.gateway_cpus
              + setup.workers * setup.simworker_cpus)
    return max(os.cpu_count() or 1, math.ceil(needed))


def load_engines(path: Path) -> list[dict[str, Any]]:
    """The ``workers`` list of a sluice.yaml: real engines to use instead of simworkers."""
    import yaml

    data = yaml.safe_load(path.read_text())
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, list) or not workers:
        raise ValueError(f"{path}: no workers list")
    return [dict(worker) for worker in workers]


def run_rollout(setup: RolloutSetup, *, address: str | None, engines: list[dict[str, Any]] | None,
                emit: Callable[[str], None], actor_logs: bool = False) -> list[PolicyReport]:
    import ray

    from ray_fleet.actors import NODE_ADDRESS_ENV

    if address is None:
        cpus = local_cpus(setup)
        # a local cluster: its node, and the actors that bind its address, stay on loopback
        ray.init(_node_ip_address="127.0.0.1", num_cpus=cpus, include_dashboard=False,
                 log_to_driver=actor_logs, runtime_env={"env_vars": {NODE_ADDRESS_ENV: "127.0.0.1"}})
        emit(f"local Ray: {cpus} logical CPUs (programs wait on the network and their tools)")
    else:
        ray.init(address=address, log_to_driver=actor_logs)
    try:
        return [run_policy(setup, policy, engines, emit) for policy in setup.policies]
    finally:
        ray.shutdown()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = RolloutSetup()
    parser = argparse.ArgumentParser(prog="python -m ray_fleet.rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(defaults.policies),
                        help="policies to compare, one gateway each (comma-separated)")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="simworker actors")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="rollout steps (batches)")
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="tasks per step (P)")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="samples per task (G)")
    parser.add_argument("--blocks", type=int, default=defaults.blocks, help="KV blocks per simworker")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale,
                        help="wall seconds per model second (simworkers and tool calls)")
    parser.add_argument("--min-turns", type=int, default=defaults.min_turns)
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--program-cpus", type=float, default=defaults.program_cpus,
                        help="Ray CPUs per program task (fractions pack more per node)")
    parser.add_argument("--client-retries", type=int, default=defaults.client_retries,
                        help="the openai SDK's retries per call")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (e.g. auto) instead of starting a local Ray; "
                             "every node needs agent-sluice[ray] installed")
    parser.add_argument("--engines", type=Path, default=None,
                        help="a sluice.yaml whose workers (real vLLM engines) every gateway fronts "
                             "instead of simworkers")
    parser.add_argument("--model", default=defaults.model, help="the model the programs ask for")
    parser.add_argument("--json", type=Path, default=None, help="write the reports here")
    parser.add_argument("--actor-logs", action="store_true",
                        help="forward the actors' logs to this terminal")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("error: this example needs Ray: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    setup = RolloutSetup(policies=tuple(p for p in args.policies.split(",") if p),
                         workers=args.workers, steps=args.steps, prompts=args.prompts,
                         samples=args.samples, blocks=args.blocks, time_scale=args.time_scale,
                         min_turns=args.min_turns, max_turns=args.max_turns, seed=args.seed,
                         program_cpus=args.program_cpus, client_retries=args.client_retries,
                         model=args.model)
    engines = load_engines(args.engines) if args.engines is not None else None

    def emit(line: str) -> None:
        print(line, flush=True)

    reports = run_rollout(setup, address=args.address, engines=engines, emit=emit,
                          actor_logs=args.actor_logs)
    for line in format_comparison(reports):
        emit(line)
    if args.json is not None:
        payload = {"setup": asdict(setup), "results": [report.as_dict() for report in reports]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        emit(f"\nwrote {args.json}")
    return 1 if any(report.failed_calls for report in reports) else 0


if __name__ == "__main__":
    # Run from the module's importable name, not ``__main__``: Ray pickles the task functions
    # and their dataclasses by reference then, and the worker processes import them.
    from ray_fleet.rollout import main as rollout_main

    sys.exit(rollout_main())
