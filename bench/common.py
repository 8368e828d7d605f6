"""What the benchmarks share: results on stdout, everything else on stderr, percentiles, and
an asyncio runner on uvloop."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# set by ``--quick``: smoke-run numbers get their own names so nobody mistakes them
NAME_SUFFIX = ""


def result(name: str, value: float, unit: str) -> None:
    print(f"BENCH {name}{NAME_SUFFIX} {value:.6g} {unit}", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (same as numpy's default 'linear')."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run`` on uvloop when it is installed (the ``live`` extra brings it)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
