"""Live against simulated, the long run: each policy's scripted workload through the gateway on
simworkers and through the simulator, side by side (design notes "Live against simulated").

Per policy, one live run (tests/support/parity.py ``run_live``: the gateway in a process of its
own on the simworkers' scaled clock, the simworkers in one process or one each, a client playing
each program) and the simulator's band of runs (the same programs with the first ones' start
times a few milliseconds apart); the table gives each metric live, simulated (the band's mean and
range) and their difference, and a second table what the live shell cost (event-loop lag, CPU,
the hops outside the gateway, KV events' transport delay, the host's load). ``--calibrate``
adds two measurements of the shells' differences: the gateway's prompt-token estimate against
the exact counts of the workload's calls, and the wall time an idle call spends in the HTTP
hops, direct to a simworker and through the gateway, beyond the engine model's step time.

Results go to experiments/results/parity/ (``results<label>.md`` with the command at the top,
``results<label>.json``)::

    .venv/bin/python -m experiments.parity                       # 3 policies × 300 s, ~16 min
    .venv/bin/python -m experiments.parity --policies program_aware --duration 60 \\
        --time-scale 0.25 --label -ts0.25
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

from controller.identity import resolve_identity
from sim.tokens import PseudoTokenizer
from tests.support.parity import (
    LAYOUTS,
    MODEL,
    Comparison,
    ParitySetup,
    ServerProcess,
    compare,
    comparison_table,
    serve_config,
    simworker_configs_json,
    wait_ready,
    worker_configs,
)

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "experiments" / "results" / "parity"
DEFAULT_POLICIES = "program_aware,least_loaded,kv_aware"
DEFAULTS = ParitySetup()

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


# -- calibration ------------------------------------------------------------------------------


def prompt_estimates(setup: ParitySetup, programs: int = 40) -> dict[str, Any]:
    """The gateway's prompt-token estimate (controller/identity.py, what the policy sees on
    arrival) against the exact count (what the simulator's CallRequest carries), over every
    call of the first ``programs`` programs, each built as the live client builds it (a reply
    of the script's length from the simworker's filler, whose words it samples)."""
    workload = setup.workload()
    tokenizer = PseudoTokenizer()
    errors: list[float] = []
    relative: list[float] = []
    for index in range(programs):
        program = workload.program(index)
        messages = workload.opening(program)
        for k in range(program.calls):
            body = {"model": MODEL, "messages": messages, "max_tokens": program.output_tokens[k]}
            identity, _ = resolve_identity("/v1/chat/completions", {"x-session-id": program.session_id}, body)
            exact = program.prompt_tokens[k]
            errors.append(identity.prompt_tokens - exact)
            relative.append((identity.prompt_tokens - exact) / exact)
            if k + 1 < program.calls:
                _, reply = tokenizer.filler(program.output_tokens[k], index + k, leading_space=False)
                messages = [*messages, {"role": "assistant", "content": "".join(reply)},
                            program.tool_message(k)]
    tokens, shares = np.asarray(errors), np.asarray(relative)
    return {"calls": len(errors),
            "estimate_minus_exact_tokens": {"p1": float(np.quantile(tokens, 0.01)),
                                            "p50": float(np.quantile(tokens, 0.5)),
                                            "p99": float(np.quantile(tokens, 0.99))},
            "relative": {"p1": round(float(np.quantile(shares, 0.01)), 4),
                         "p50": round(float(np.quantile(shares, 0.5)), 4),
                         "p99": round(float(np.quantile(shares, 0.99)), 4),
                         "mean": round(float(shares.mean()), 4)}}


def idle_call_overhead(setup: ParitySetup, calls: int = 60) -> dict[str, Any]:
    """Wall milliseconds an idle one-token call takes beyond the engine model's step time for
    its prompt, sent one at a time straight to a simworker and through the gateway: the HTTP
    hops, JSON, tokenization and event-loop wake-ups a call pays live and not simulated."""
    model = setup.engine_model()
    fleet = ServerProcess("simworkers", simworker_configs_json(worker_configs(setup)[:1])).start()
    gateway: ServerProcess | None = None
    results: dict[str, Any] = {}
    try:
        worker = fleet.wait_serving()[0]
        log = Path(os.devnull)
        gateway = ServerProcess("gateway", json.dumps(serve_config(setup, "least_loaded", [worker], log)),
                                str(setup.time_scale)).start()
        gateway_url = gateway.wait_serving()["url"]
        wait_ready(gateway_url, 1, setup.scheduling_policy)
        for route, url in (("direct", worker["url"]), ("gateway", gateway_url)):
            beyond: list[float] = []
            with httpx.Client(base_url=url, trust_env=False, timeout=10.0) as http:
                for i in range(calls):
                    body = {"model": MODEL, "max_tokens": 1,
                            "messages": [{"role": "user", "content": f"{route} call {i}"}]}
                    sent = time.monotonic()
                    response = http.post("/v1/chat/completions", json=body,
                                         headers={"x-session-id": f"calibration-{route}-{i}"})
                    wall = time.monotonic() - sent
                    response.raise_for_status()
                    prompt = response.json()["usage"]["prompt_tokens"]
                    engine = model.step_s(prompt, 1, prompt) * setup.time_scale
                    if i >= 10:  # the first calls warm connections and memos
                        beyond.append((wall - engine) * 1000.0)
                    time.sleep(0.02)
            results[route] = {"calls": len(beyond), "p50_ms": round(statistics.median(beyond), 2),
                              "min_ms": round(min(beyond), 2),
                              "p90_ms": round(float(np.quantile(beyond, 0.9)), 2)}
    finally:
        if gateway is not None:
            gateway.stop()
        fleet.stop()
    return results


# -- the report -------------------------------------------------------------------------------


def cost_table(comparisons: list[Comparison]) -> list[str]:
    """What each live run cost the host and how far its loops fell behind."""
    lines = ["| policy | load avg (start → end) | loop lag p99 / max, ms: client · gateway · workers | "
             "CPU s: client · gateway · workers | skipped lag s | client↔gateway p50 / p99 ms | "
             "paired latency live − sim p50 / p99 ms | KV event delay p50 / p99 ms |",
             "|---|---|---|---|---:|---|---|---|"]
    for comparison in comparisons:
        d = comparison.live.diagnostics
        lags = d["loop_lag_wall_s"]

        def lag(summary: dict[str, float] | None) -> str:
            if not summary or not summary.get("samples"):
                return "n/a"
            return f"{summary['p99_s'] * 1000:.1f}/{summary['max_s'] * 1000:.0f}"

        workers = ", ".join(lag(w) for w in lags["workers"])
        cpu = d["cpu_s"]
        outside = d["client_outside_gateway_s"]
        paired = comparison.paired_latency_difference_s()
        kv = d.get("kv_event_delay_s")
        lines.append(
            f"| {comparison.policy} | {d['load_average'][0]:.2f} → {d['load_average'][1]:.2f} | "
            f"{lag(lags['client'])} · {lag(lags['gateway'])} · {workers} | "
            f"{cpu['client']:.1f} · {cpu['gateway']:.1f} · {', '.join(f'{c:.1f}' for c in cpu['workers'])} | "
            f"{d['skipped_lag_s']:.2f} | {outside['p50'] * 1000:.1f} / {outside['p99'] * 1000:.1f} | "
            f"{paired.get('p50', float('nan')) * 1000:.0f} / {paired.get('p99', float('nan')) * 1000:.0f} | "
            + (f"{kv['p50'] * 1000:.2f} / {kv['p99'] * 1000:.2f} |" if kv else "n/a |"))
    return lines


def report(command: str, setup: ParitySetup, comparisons: list[Comparison],
           calibration: dict[str, Any] | None) -> str:
    lines = [
        "# Live against simulated",
        "",
        "Made by:",
        "",
        "```sh",
        command,
        "```",
        "",
        f"{setup.workers} workers × {setup.blocks} blocks × {setup.block_size} tokens, preset "
        f"`{setup.preset}` (prefill × {setup.prefill_scale:g}), time scale {setup.time_scale:g}, "
        f"{setup.concurrency} programs in closed loop (ramp {setup.ramp_s:g} s), {setup.duration_s:g} "
        f"virtual s per run, seed {setup.seed}, engines `{setup.scheduling_policy}`, simworkers "
        f"`{setup.layout}`; host: {os.cpu_count()} CPUs. `sim (mean)` and `sim (range)`: the "
        "simulator's runs with the first programs' start times 0–4 ms apart.",
        "",
        *comparison_table(comparisons),
        "",
        "What the live runs cost (wall milliseconds; CPU seconds over the run):",
        "",
        *cost_table(comparisons),
    ]
    if calibration is not None:
        estimate = calibration["prompt_estimate"]
        overhead = calibration["idle_call_overhead_wall_ms"]
        lines += [
            "",
            "Calibration:",
            "",
            f"- the gateway's prompt-token estimate against the exact count, over {estimate['calls']} "
            f"calls: estimate − exact p1 / p50 / p99 = {estimate['estimate_minus_exact_tokens']['p1']:+.0f} / "
            f"{estimate['estimate_minus_exact_tokens']['p50']:+.0f} / "
            f"{estimate['estimate_minus_exact_tokens']['p99']:+.0f} tokens "
            f"({estimate['relative']['p1']:+.1%} / {estimate['relative']['p50']:+.1%} / "
            f"{estimate['relative']['p99']:+.1%});",
            "- an idle one-token call's wall time beyond the model's step time, p50 (min, p90): "
            f"{overhead['direct']['p50_ms']} ms ({overhead['direct']['min_ms']}, "
            f"{overhead['direct']['p90_ms']}) straight to a simworker, {overhead['gateway']['p50_ms']} ms "
            f"({overhead['gateway']['min_ms']}, {overhead['gateway']['p90_ms']}) through the gateway.",
        ]
    return "\n".join(lines) + "\n"


@app.command()
def main(policies: str = typer.Option(DEFAULT_POLICIES, help="Comma-separated policies."),
         duration: float = typer.Option(300.0, min=10.0, help="Virtual seconds per run."),
         time_scale: float = typer.Option(1.0, min=0.01, help="Wall seconds per virtual second, live."),
         layout: str = typer.Option("one_process", help=f"Simworkers: {', '.join(LAYOUTS)}."),
         concurrency: int = typer.Option(DEFAULTS.concurrency, min=1, help="Programs in closed loop."),
         blocks: int = typer.Option(DEFAULTS.blocks, min=2, help="KV blocks per worker."),
         seed: int = typer.Option(DEFAULTS.seed, min=0, help="The workload's seed."),
         scheduling_policy: str = typer.Option(DEFAULTS.scheduling_policy,
                                               help="Every engine's queue order: fcfs or priority."),
         kv_probe: bool = typer.Option(True, help="Measure the KV events' transport delay."),
         calibrate: bool = typer.Option(True, help="Measure the prompt estimate and idle call overhead."),
         label: str = typer.Option("", help="Suffix of the result files (e.g. -ts0.25)."),
         out: Path = typer.Option(OUT_DIR, help="Directory of the result files.")) -> None:
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    command = " ".join(["python -m experiments.parity", *map(shlex.quote, sys.argv[1:])])
    try:
        setup = ParitySetup(seed=seed, blocks=blocks, time_scale=time_scale, concurrency=concurrency,
                            duration_s=duration, layout=layout, scheduling_policy=scheduling_policy)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    comparisons = []
    for policy in chosen:
        typer.echo(f"{policy}: live {duration:g} virtual s (≈ {duration * time_scale:.0f} wall s), "
                   "then the simulator", err=True)
        comparisons.append(compare(setup, policy, kv_probe=kv_probe))
        typer.echo("\n".join(comparison_table(comparisons[-1:])), err=True)
    calibration = None
    if calibrate:
        calibration = {"prompt_estimate": prompt_estimates(setup),
                       "idle_call_overhead_wall_ms": idle_call_overhead(setup)}
    text = report(command, setup, comparisons, calibration)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results{label}.md").write_text(text)
    (out / f"results{label}.json").write_text(json.dumps({
        "command": command, "setup": {name: getattr(setup, name) for name in setup.__dataclass_fields__},
        "comparisons": [comparison.summary() for comparison in comparisons],
        "calibration": calibration}, indent=1) + "\n")
    typer.echo(text)
    typer.echo(f"wrote {out / f'results{label}.md'}", err=True)


if __name__ == "__main__":
    app()
