"""The Mooncake conversation trace in closed loop at several concurrencies, every policy and
the ceiling on each row: one ``sluice replay`` per concurrency, then one table and the sweep's
plots (hit rate, p99 call latency; output tok/s is the trace's under every policy).

    .venv/bin/python -m experiments.mooncake_concurrency \\
        --concurrency 250,500,1000,2000,3000 --out experiments/results/mooncake_closed_loop/concurrency

A concurrency whose ``ccN.json`` is already in ``--out`` is read, not run again, so an
interrupted sweep resumes where it stopped. Each replay shows its progress as it goes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from sim.sweep import plot_sweep

TRACE = "experiments/data/mooncake/conversation_trace.jsonl.gz"
POLICIES = "program_aware,thunderagent,mori,vllm_router,sticky_kv,least_loaded,kv_aware"


def main(concurrency: str = typer.Option("250,500,1000,2000,3000", help="Comma-separated."),
         workers: int = typer.Option(8, min=1),
         policies: str = typer.Option(POLICIES, help="Comma-separated; the ceiling is added."),
         out: Path = typer.Option(..., help="Results folder: ccN.json per row, results.md, plots.")
         ) -> None:
    levels = [int(level) for level in concurrency.split(",") if level.strip()]
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for level in levels:
        path = out / f"cc{level}.json"
        if not path.exists():
            command = [sys.executable, "-m", "entry.cli", "replay", "--format", "mooncake",
                       "--trace", TRACE, "--workers", str(workers), "--concurrency", str(level),
                       "--policy", policies, "--json", str(path)]
            typer.echo(f"[CC{level}] {' '.join(command[1:])}", err=True)
            subprocess.run(command, check=True)
        rows += [{**row, "concurrency": level} for row in json.loads(path.read_text())["results"]]
    (out / "results.json").write_text(json.dumps({"results": rows}, indent=2) + "\n")
    (out / "results.md").write_text(_table(rows))
    plot_sweep(rows, out, f"Mooncake closed loop, {workers} workers")
    typer.echo(f"wrote {out / 'results.md'} and the plots", err=True)


def _table(rows: list[dict[str, Any]]) -> str:
    """Per concurrency: each policy's output, hit rate, re-prefill and latency, and whether its p99
    is inside the acceptance bound (max(60 s, 1.25 × least_loaded's))."""
    lines = ["| CC | policy | out tok/s | hit rate | re-prefill tok | p50 call s | p99 call s | p99 in bound | pauses |",
             "|---:|---|---:|---:|---:|---:|---:|:---:|---:|"]
    for level in sorted({row["concurrency"] for row in rows}):
        group = [row for row in rows if row["concurrency"] == level]
        least = next(row for row in group if row["policy"] == "least_loaded")
        bound = max(60.0, 1.25 * least["p99_call_s"])
        for row in group:
            inside = "—" if row["policy"] == "ceiling" else ("yes" if row["p99_call_s"] <= bound else "no")
            lines.append(f"| {level} | {row['policy']} | {row['output_tokens_per_s']:.0f} | {row['hit_rate']:.1%} | "
                         f"{row['reprefill_tokens']:,} | {row['p50_call_s']:.1f} | "
                         f"{row['p99_call_s']:.1f} | {inside} | {row['pauses']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    typer.run(main)
