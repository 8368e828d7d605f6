"""Simulator speed: wall-clock seconds to simulate two reference loads with program_aware.

- ``sim_mooncake_conversation_s``: replay the Mooncake conversation trace (12,031 requests,
  ~59 min) on 8 workers. The trace (public, Apache-2.0) ships in
  ``experiments/data/mooncake/``; if it is missing this line is skipped with a note on stderr.
- ``sim_cc512_30min_s``: SWE-bench workload, 512 programs in a closed loop, 8 workers,
  1,800 simulated seconds.
"""

from __future__ import annotations

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
    start = time.perf_counter()
    [outcome] = run_policies(["program_aware"], lambda: workload_feed("swebench", 512, 7),
                             workers=8, preset="llama3.1-8b-h100", duration_s=1800.0,
                             show_progress=False)
    elapsed = time.perf_counter() - start
    progress(f"CC512: {outcome.calls_completed:,} calls, {outcome.output_tokens_per_s:.0f} out tok/s simulated")
    result("sim_cc512_30min_s", elapsed, "s")
