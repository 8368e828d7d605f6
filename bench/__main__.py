"""``python -m bench``: run the benchmarks; stdout carries only ``BENCH <name> <value> <unit>``.

Targets (for the reader; nothing here enforces them): tick p50/p99 ≤ 5 ms with 64 workers
and 10,000 programs; KV ingest ≥ 1,000,000 hashes/s on one core; the Mooncake conversation
replay on 8 workers ≤ 5 s; SWE-bench CC512 for 30 simulated minutes ≤ 20 s, and on 64
workers with 4,096 programs ≤ 5 min (opt-in: SLUICE_BENCH_FLEET=1); the engine plugin's extra
time per block allocation ≤ 5%; the gateway (on its own core) costs ≤ 400 us of
CPU per non-streaming request and ≤ 40 us per relayed stream chunk, serves ≥ 2,400 req/s, and
adds ≤ 2 ms p50 to a stream at 100 concurrent streams (bench/gateway.py says how each is
measured); ``sluice serve --relays 2`` serves ≥ 1.7× the requests per second of one process
at no more CPU per request (bench/gateway_relays.py); calls without identity are grouped into their programs with pairwise precision and
recall ≥ 0.99, and exactly with an id in any identity source (bench/identity.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from bench import common, gateway, gateway_relays, identity, kv_ingest, plugin, simulator, tick
from bench.common import progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tick", "kv", "sim", "gateway", "plugin", "identity"),
                        action="append",
                        help="run only this benchmark (repeatable); default: all")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes for a smoke run; its lines are named *_quick")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the timed ticks (and an extra, unreported gateway run) and "
                        "print the top functions to stderr")
    parser.add_argument("--ticks", type=int, default=200, help="timed ticks (default 200)")
    args = parser.parse_args(argv)
    which = args.only or ["kv", "tick", "sim", "gateway", "plugin", "identity"]
    progress(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
             f"load average {os.getloadavg()[0]:.2f} (other load on the machine skews timings)")
    if args.quick:
        common.NAME_SUFFIX = "_quick"
    if "kv" in which:
        if args.quick:
            kv_ingest.run(batches=4_000, pool_blocks=10_000, repeats=1)
        else:
            kv_ingest.run(batches=20_000, repeats=5)
    if "tick" in which:
        if args.quick:
            tick.run(workers=8, programs=800, ticks=min(args.ticks, 50), profile=args.profile)
        else:
            tick.run(ticks=args.ticks, profile=args.profile)
    if "sim" in which and not args.quick:
        simulator.run_mooncake()
        simulator.run_cc512()
        simulator.run_fleet()  # only with SLUICE_BENCH_FLEET=1 (bench/simulator.py)
    if "plugin" in which and not args.quick:
        plugin.run()
    if "gateway" in which:
        gateway.run(quick=args.quick, profile=args.profile)
        gateway_relays.run(quick=args.quick)
    if "identity" in which:
        identity.run(groups=24 if args.quick else 120)
    progress(f"done (load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
