"""Output helpers shared by the benchmarks: results on stdout, everything else on stderr."""

from __future__ import annotations

import sys
import time


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
