"""``python -m bench.soak``: the command line of a soak (``make soak``)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench import soak
from bench.soak.config import FAULT_KINDS, SoakSetup
from bench.soak.report import summary_markdown
from bench.soak.run import run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=soak.__doc__.splitlines()[0])
    defaults = SoakSetup()
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--fault-every-s", type=float, default=defaults.fault_every_s)
    parser.add_argument("--faults", default=",".join(defaults.faults),
                        help=f"the cycle of faults, comma-separated (default: {','.join(FAULT_KINDS)})")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument("--call-timeout-s", type=float, default=defaults.call_timeout_s)
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    args = parser.parse_args(argv)
    setup = SoakSetup(duration_s=args.duration_s, sessions=args.sessions, workers=args.workers,
                      fault_every_s=args.fault_every_s, faults=tuple(filter(None, args.faults.split(","))),
                      time_scale=args.time_scale, call_timeout_s=args.call_timeout_s)
    try:
        setup.validate()
    except ValueError as err:
        parser.error(str(err))
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the soak stops its workers and
    # its gateway on the way out instead of leaving them running
    signal.signal(signal.SIGTERM, _interrupt)
    summary = run_soak(setup, args.out)
    print(summary_markdown(summary))
    print(f"wrote {args.out / 'summary.json'}, {args.out / 'summary.md'}, {args.out / 'rss.csv'}",
          file=sys.stderr)
    return 0 if summary["acceptance"]["passed"] else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
