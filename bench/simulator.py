"""Simulator speed: wall-clock seconds to simulate two reference loads with program_aware.

- ``sim_mooncake_conversation_s``: replay the Mooncake conversation trace (12,031 requests,
  ~59 min) on 8 workers. The trace (public, Apache-2.0) ships in
  ``experiments/data/mooncake/``; if it is missing this line is skipped with a note on stderr.
- ``sim_cc512_30min_s``: SWE-bench workload, 512 programs in a closed loop, 8 workers,
  1,800 simulated seconds.
- ``sim_64x4096_30min_s``: the same at fleet scale, 4,096 programs on 64 workers for 1,800
  simulated seconds. It takes longer than the rest of ``make bench`` together (321 s on the
  2-core development machine, 2026-12-05; design notes "Simulator speed"), so it runs only
  when asked:
  ``SLUICE_BENCH_FLEET=1 python -m bench --only sim`` (or ``make bench`` with it set);
  otherwise a note on stderr says it was skipped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import progress, result
from sim.feeds import OpenLoop
from sim.runs import replay_programs, run_policies, trace_span_s, workload_feed

MOONCAKE = (Path(__file__).resolve().parent.parent / "experiments" / "data" / "mooncake"
            / "conversation_trace.jsonl.gz")


def run_mooncake(path: Path = MOONCAKE) -> None:
    if not path.exists():
        progress(f"skipping sim_mooncake_conversation_s: {path} not found")
        return
    start = time.perf_counter()
    programs, block_size = replay_programs("mooncake", path, 1.0)
    [outcome] = run_policies(["program_aware"], lambda: OpenLoop(programs), workers=8,
                             preset="llama3.1-8b-h100", duration_s=trace_span_s(programs) + 1800,
                             block_size=block_size, stop_when_done=True, show_progress=False)
    elapsed = time.perf_counter() - start
    progress(f"mooncake replay: {outcome.calls_completed:,} calls, "
             f"{outcome.output_tokens_per_s:.0f} out tok/s simulated (load included)")
    result("sim_mooncake_conversation_s", elapsed, "s")


def run_cc512() -> None:
    _closed_loop("sim_cc512_30min_s", "CC512", programs=512, workers=8)


# The environment variable that turns the fleet-scale line on.
FLEET_ENV = "SLUICE_BENCH_FLEET"


def run_fleet() -> None:
    """``sim_64x4096_30min_s``, only when :data:`FLEET_ENV` is set to 1."""
    if os.environ.get(FLEET_ENV) != "1":
        progress(f"skipping sim_64x4096_30min_s (~5-6 min): set {FLEET_ENV}=1 to run it")
        return
    _closed_loop("sim_64x4096_30min_s", "64x4096", programs=4096, workers=64)


def _closed_loop(name: str, label: str, *, programs: int, workers: int) -> None:
    start = time.perf_counter()
    [outcome] = run_policies(["program_aware"], lambda: workload_feed("swebench", programs, 7),
                             workers=workers, preset="llama3.1-8b-h100", duration_s=1800.0,
                             show_progress=False)
    elapsed = time.perf_counter() - start
    progress(f"{label}: {outcome.calls_completed:,} calls, {outcome.output_tokens_per_s:.0f} out tok/s simulated")
    result(name, elapsed, "s")
