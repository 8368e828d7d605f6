"""``make fuzz``: the fuzz tier's long run, its targets run side by side.

Each target (one pytest node of tests/fuzz) runs in a pytest process of its own under the
``long`` profile (tests/fuzz/profiles.py), at most ``--jobs`` at a time: the targets are
independent (each HTTP target starts its own gateway and simworker on free loopback ports),
and one target of 100,000 inputs takes from minutes to more than an hour on one core, so a
run in series would take the sum of them. Each target's output goes to ``--logs``/NAME.log;
a line per target says when it starts and how it ended (inputs run, minutes), and the exit
status is 1 when any target failed.

    .venv/bin/python -m tests.fuzz.long_run --jobs 2
    SLUICE_FUZZ_EXAMPLES=2000 .venv/bin/python -m tests.fuzz.long_run tests/fuzz/test_kv_event_frames.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.fuzz.profiles import EXAMPLES_VARIABLE, PROFILE_VARIABLE, long_run_examples

# Hypothesis's statistics: "- 100000 passing, 0 failing, and 12 invalid test cases"
_PASSING = re.compile(r"(\d+) passing, (\d+) failing")


def targets(paths: list[str]) -> list[str]:
    """The pytest node ids under ``paths``."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *paths],
                            capture_output=True, text=True, check=False)
    nodes = [line for line in listed.stdout.splitlines() if "::" in line]
    if listed.returncode != 0 or not nodes:
        raise SystemExit(f"no fuzz targets under {paths}:\n{listed.stdout}{listed.stderr}")
    return nodes


def run_target(node: str, logs: Path, started: float) -> bool:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", node.split("::", 1)[1])
    log = logs / f"{name}.log"
    _say(started, f"start {node}")
    begun = time.monotonic()
    with log.open("w") as handle:
        status = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxX",
             "--hypothesis-show-statistics", node],
            stdout=handle, stderr=subprocess.STDOUT,
            env={**os.environ, PROFILE_VARIABLE: "long"}, check=False).returncode
    counts = _PASSING.findall(log.read_text(errors="replace"))
    # Hypothesis prints its counts only for a target that ends without an error
    inputs = (", ".join(f"{passing} passing {failing} failing" for passing, failing in counts)
              or ("no input counts (the log has the failing input)" if status else "not a Hypothesis target"))
    verdict = "passed" if status == 0 else f"FAILED (exit {status}; see {log})"
    _say(started, f"{verdict}: {node}: {inputs}, {(time.monotonic() - begun) / 60:.1f} min")
    return status == 0


def _say(started: float, line: str) -> None:
    print(f"[fuzz {(time.monotonic() - started) / 60:6.1f} min] {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.long_run",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests/fuzz"],
                        help="files or node ids (default: tests/fuzz)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="targets at a time (default: the CPUs)")
    parser.add_argument("--logs", type=Path, default=Path(".fuzz-logs"),
                        help="a log per target (default: .fuzz-logs)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be ≥ 1")
    examples = long_run_examples()  # a bad SLUICE_FUZZ_EXAMPLES stops the run here
    args.logs.mkdir(parents=True, exist_ok=True)
    # the HTTP targets first: they are the longest (an input is several calls through a
    # gateway), and the others then fill the remaining jobs around them
    nodes = sorted(targets(args.paths), key=lambda node: "test_http_routes" not in node)
    started = time.monotonic()
    _say(started, f"{len(nodes)} targets, {examples:,} inputs each ({EXAMPLES_VARIABLE}), "
                  f"{args.jobs} at a time, logs in {args.logs}/")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        passed = list(pool.map(lambda node: run_target(node, args.logs, started), nodes))
    _say(started, f"{sum(passed)} of {len(nodes)} targets passed")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
