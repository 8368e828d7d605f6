"""Retention on vs off on two real vLLM CPU workers.

Starts two vLLM CPU workers with the tiny dummy-weight model (the e2e tier's fleet:
tests/support/vllm_fleet.py, Sluice plugin loaded, 64 blocks × 32 tokens of KV each), then runs the
gateway in-process (program_aware) with ``retention.enabled`` on and off, alternating, on two
workloads, each run with content no other run uses:

- ``overload``: programs × turns agent loops (short tool sleeps) whose contexts add up to more
  than both pools hold, so program_aware pauses and resumes; retention keeps active programs'
  KV (priority 90) and demotes paused ones.
- ``cotenant``: a few agent programs through the gateway while other traffic floods the same
  workers directly (sessions Sluice does not schedule, at the normal class).

Measured per run from vLLM's own usage (``cached_tokens``): prompt and cached tokens of the
programs' later turns (the first turn has nothing to reuse), hit rate, re-prefill tokens, and
per-call latency. Results go to ``experiments/results/vllm_retention/`` (results.json and a
README table). Needs ``.venv-vllm`` (``make vllm-venv``); about 10 minutes on 2 cores.

    .venv/bin/python -m experiments.vllm_retention --repeats 2
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import typer

from tests.support.gateway_harness import gateway, serve_config, wait_for
from tests.support.vllm_fleet import CAPACITY_TOKENS, MODEL_NAME, Fleet

REPO = Path(__file__).resolve().parents[1]

WORDS = ("agent tool call result session program worker cache block token prompt prefix "
         "model request response user system read write edit file line code test build run "
         "error fix patch diff commit branch merge search query answer plan step think "
         "reason observe act return value function class module import").split()
POLICY_KEYS = {"growth_reserve_tokens": 32, "buffer_per_program": 32, "tick_interval_s": 0.2}
WORKLOADS = {
    # programs, turns, tool seconds, system words, tool-result words, flood requests per worker
    "overload": dict(programs=10, turns=5, tool_s=0.2, system_words=200, tool_words=60, flood=0),
    "cotenant": dict(programs=4, turns=4, tool_s=1.0, system_words=300, tool_words=40, flood=24),
}
OUT_DIR = REPO / "experiments" / "results" / "vllm_retention"

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _flood(url: str, tag: str, requests: int, stop: threading.Event) -> int:
    sent = 0
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as direct:
        for i in range(requests):
            if stop.is_set():
                break
            rng = random.Random(f"{tag}-{i}")
            body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0, "session_id": f"{tag}-{i}",
                    "messages": [{"role": "user", "content": f"{tag} {i}: {_words(rng, 300)}"}]}
            r = direct.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            sent += 1
    return sent


def run_once(fleet: Fleet, workload: str, retain: bool, tag: str) -> dict[str, Any]:
    shape = WORKLOADS[workload]
    records: list[dict] = []
    lock = threading.Lock()
    policy = {"name": "program_aware", **POLICY_KEYS, "retention": {"enabled": retain}}
    config = serve_config([w.gateway_entry() for w in fleet.workers], policy=policy,
                          health_interval_s=0.5, unhealthy_after=1, capacity_retry_s=0.2,
                          upstream={"connect_timeout_s": 2.0, "read_timeout_s": 120.0})

    def program(i: int, url: str) -> None:
        rng = random.Random(f"{tag}-{i}")
        session = f"{tag}-p{i}"
        messages = [{"role": "system", "content": f"{tag} {i}: {_words(rng, shape['system_words'])}"},
                    {"role": "user", "content": _words(rng, 30)}]
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
            for turn in range(shape["turns"]):
                headers = {"x-session-id": session}
                if turn == shape["turns"] - 1:
                    headers["x-dynamo-session-final"] = "true"
                started = time.monotonic()
                r = client.post("/v1/chat/completions", headers=headers,
                                json={"model": MODEL_NAME, "messages": messages, "max_tokens": 8,
                                      "temperature": 0})
                latency = time.monotonic() - started
                r.raise_for_status()
                usage = r.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                with lock:
                    records.append({"turn": turn, "prompt": usage["prompt_tokens"], "cached": cached,
                                    "latency_s": latency})
                messages = [*messages, {"role": "assistant", "content": _words(rng, 30)},
                            {"role": "user", "content": _words(rng, shape["tool_words"])}]
                time.sleep(shape["tool_s"])

    started = time.monotonic()
    stop = threading.Event()
    with gateway(config) as gw:
        wait_for(lambda: all(w["capacity_tokens"] == CAPACITY_TOKENS and w["healthy"]
                             for w in gw.workers().values()), timeout=15, what="workers healthy")
        with ThreadPoolExecutor(shape["programs"] + len(fleet.workers)) as pool:
            floods = [pool.submit(_flood, w.url, f"{tag}-flood-{w.name}", shape["flood"], stop)
                      for w in fleet.workers if shape["flood"]]
            list(pool.map(lambda i: program(i, gw.url), range(shape["programs"])))
            stop.set()
            flooded = sum(f.result() for f in floods)
        stats = gw.parts.admission.policy.stats
        sent = dict(gw.parts.admission.sink.sent)
    later = [r for r in records if r["turn"] > 0]
    prompt = sum(r["prompt"] for r in later)
    cached = sum(r["cached"] for r in later)
    latencies = [r["latency_s"] for r in records]
    return {
        "workload": workload, "retention": retain, "tag": tag,
        "calls": len(records), "later_prompt_tokens": prompt, "later_cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0, "reprefill_tokens": prompt - cached,
        "latency_p50_s": _percentile(latencies, 0.5), "latency_p99_s": _percentile(latencies, 0.99),
        "pauses": stats.pauses, "resumes": stats.resumes, "flood_requests": flooded,
        "directives": sent, "seconds": time.monotonic() - started,
    }


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for workload in WORKLOADS:
        for retain in (False, True):
            mine = [r for r in runs if r["workload"] == workload and r["retention"] == retain]
            if not mine:
                continue
            rows.append({
                "workload": workload, "retention": "on" if retain else "off", "runs": len(mine),
                "hit_rate": statistics.mean(r["hit_rate"] for r in mine),
                "reprefill_tokens": statistics.mean(r["reprefill_tokens"] for r in mine),
                "later_prompt_tokens": statistics.mean(r["later_prompt_tokens"] for r in mine),
                "latency_p50_s": statistics.mean(r["latency_p50_s"] for r in mine),
                "latency_p99_s": statistics.mean(r["latency_p99_s"] for r in mine),
                "pauses": statistics.mean(r["pauses"] for r in mine),
                "seconds": statistics.mean(r["seconds"] for r in mine),
            })
    return rows


def table(rows: list[dict]) -> str:
    head = ("| workload | retention | runs | hit rate (turns ≥ 2) | re-prefill tokens | "
            "prompt tokens (turns ≥ 2) | p50 s | p99 s | pauses | wall s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['retention']} | {r['runs']} | {r['hit_rate']:.1%} | "
                     f"{r['reprefill_tokens']:.0f} | {r['later_prompt_tokens']:.0f} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | {r['pauses']:.0f} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


@app.command()
def main(repeats: int = typer.Option(2, min=1, help="Runs per (workload, retention) pair."),
         workloads: str = typer.Option(",".join(WORKLOADS), help="Comma-separated: overload,cotenant."),
         out: Path = typer.Option(OUT_DIR, help="Directory for results.json and README.md."),
         vllm_python: Path = typer.Option(REPO / ".venv-vllm" / "bin" / "python",
                                          help="Python of the vLLM virtualenv.")) -> None:
    chosen = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        raise typer.BadParameter(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}",
                                 param_hint="--workloads")
    if not vllm_python.exists():
        raise typer.BadParameter(f"{vllm_python} not found (run `make vllm-venv`)", param_hint="--vllm-python")
    with tempfile.TemporaryDirectory(prefix="sluice-vllm-retention-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([str(vllm_python), str(REPO / "scripts" / "make_tiny_model.py"), str(model)],
                       check=True, capture_output=True, timeout=300)
        fleet = Fleet(vllm_python, model, Path(tmp))
        typer.echo("starting 2 vLLM CPU workers ...", err=True)
        fleet.start(("w0", "w1"))
        runs: list[dict] = []
        try:
            for rep in range(repeats):
                for workload in chosen:
                    # alternate which setting goes first, so leftovers of one run favour neither
                    order = (False, True) if rep % 2 == 0 else (True, False)
                    for retain in order:
                        tag = f"x{rep}-{workload}-{'on' if retain else 'off'}"
                        result = run_once(fleet, workload, retain, tag)
                        runs.append(result)
                        typer.echo(f"{tag}: hit {result['hit_rate']:.1%}, re-prefill "
                                   f"{result['reprefill_tokens']} tokens, {result['seconds']:.0f} s",
                                   err=True)
        finally:
            fleet.stop_all()
    rows = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": runs, "summary": rows}, indent=1) + "\n")
    typer.echo(table(rows))


if __name__ == "__main__":
    app()
