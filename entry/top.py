"""``sluice top``: a live terminal view of a running gateway, read from its admin API.

One screen per refresh: each worker (health, U as a bar, capacity, programs), the programs by
lifecycle and phase, calls held, and the largest programs. It reads ``GET /sluice/workers``,
``GET /sluice/programs`` and ``GET /metrics`` — nothing the gateway does not already export —
so it can watch a production gateway without touching it.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

BAR_WIDTH = 20
TOP_PROGRAMS = 10
CLEAR_SCREEN = "\x1b[H\x1b[2J"
_HELD = re.compile(r"^sluice_calls_held (\S+)$", re.MULTILINE)
_REQUESTS = re.compile(r'^sluice_requests_total\{route="[^"]*",status="(\d+)"\} (\S+)$', re.MULTILINE)


class TopError(RuntimeError):
    """The gateway could not be read (unreachable, or the token was refused)."""


@dataclass(frozen=True)
class Snapshot:
    workers: list[dict[str, Any]]
    programs: list[dict[str, Any]]
    held: int
    requests_by_status: dict[str, float]
    taken_at: float


def read_snapshot(client: httpx.Client, clock: Callable[[], float] = time.time) -> Snapshot:
    """One consistent-enough reading of the gateway's admin API and metrics."""
    try:
        workers = client.get("/sluice/workers")
        programs = client.get("/sluice/programs")
        metrics = client.get("/metrics")
    except httpx.HTTPError as err:
        raise TopError(f"cannot reach the gateway at {client.base_url}: {err}") from None
    for response in (workers, programs):
        if response.status_code in (401, 403):
            raise TopError(f"the gateway refused the admin token ({response.status_code}): set "
                           "--token or the environment variable --token-env names")
        if response.status_code != 200:
            raise TopError(f"{response.request.url.path} answered {response.status_code}")
    held = _HELD.search(metrics.text)
    by_status: Counter[str] = Counter()
    for status, value in _REQUESTS.findall(metrics.text):
        by_status[status] += float(value)
    return Snapshot(workers.json()["workers"], programs.json()["programs"],
                    int(float(held.group(1))) if held else 0, dict(by_status), clock())


def _bar(fraction: float | None) -> str:
    if fraction is None:
        return "?".ljust(BAR_WIDTH)
    filled = max(0, min(BAR_WIDTH, round(fraction * BAR_WIDTH)))
    return "#" * filled + "." * (BAR_WIDTH - filled)


def render(snapshot: Snapshot, url: str) -> str:
    """The screen for one snapshot, as plain text (no terminal control)."""
    lines = [f"sluice top — {url} — {time.strftime('%H:%M:%S', time.localtime(snapshot.taken_at))}", ""]
    lines.append(f"{'worker':<16} {'health':<9} {'U':>6}  {'':<{BAR_WIDTH}}  {'capacity':>11} {'programs':>8}  source")
    for worker in snapshot.workers:
        u = worker.get("utilization")
        capacity = worker.get("capacity_tokens")
        lines.append(
            f"{worker['name']:<16} {'up' if worker['healthy'] else 'DOWN':<9} "
            f"{(f'{u:.3f}' if u is not None else '-'):>6}  {_bar(u)}  "
            f"{(f'{capacity:,}' if capacity else 'unknown'):>11} {worker['programs']:>8}  "
            f"{worker.get('utilization_source', '')}")
        if not worker["healthy"] and worker.get("last_error"):
            lines.append(f"{'':<16} last error: {worker['last_error']}")
    states = Counter((p["lifecycle"], p["phase"]) for p in snapshot.programs)
    lines += ["", f"programs {len(snapshot.programs)}: " + (", ".join(
        f"{lifecycle}+{phase} {n}" for (lifecycle, phase), n in sorted(states.items())) or "none"),
        f"calls held {snapshot.held}; in flight {sum(p['in_flight'] for p in snapshot.programs)}; "
        "answered " + (", ".join(f"{status}: {n:,.0f}" for status, n in
                                 sorted(snapshot.requests_by_status.items())) or "none")]
    largest = sorted(snapshot.programs, key=lambda p: p["context_tokens"], reverse=True)[:TOP_PROGRAMS]
    if largest:
        lines += ["", f"{'session':<28} {'state':<18} {'worker':<12} {'context':>9} {'steps':>6} {'idle s':>8}"]
        for p in largest:
            state = f"{p['lifecycle']}+{p['phase']}" + ("*" if p["marked"] else "")
            lines.append(f"{p['session_id'][:28]:<28} {state:<18} {str(p['home_worker'] or '-'):<12} "
                         f"{p['context_tokens']:>9,} {p['steps']:>6} {p['idle_s']:>8.1f}")
    return "\n".join(lines)


def run_top(url: str, token: str | None, interval_s: float, once: bool,
            emit: Callable[[str], None]) -> None:
    """Refresh every ``interval_s`` until interrupted (or print one screen with ``once``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, headers=headers, timeout=5, trust_env=False) as client:
        while True:
            screen = render(read_snapshot(client), url)
            emit(screen if once else CLEAR_SCREEN + screen)
            if once:
                return
            time.sleep(interval_s)
