"""A soak's settings (:class:`SoakSetup`), the fault kinds it knows, and the admin token and
edge bounds it writes into the gateway's config."""

from __future__ import annotations

from dataclasses import dataclass

ADMIN_TOKEN = "sluice-soak-admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FAULT_KINDS = ("worker_kill", "worker_hang", "worker_restart", "gateway_reload", "bad_input")
# The gateway's edge bounds in the soak's config: short, so that the slow clients of a
# bad-input burst are refused within the burst rather than minutes later.
HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 1024 * 1024
SHUTDOWN_GRACE_S = 20.0


@dataclass(frozen=True, slots=True)
class SoakSetup:
    duration_s: float = 3600.0
    sessions: int = 512
    workers: int = 4
    fault_every_s: float = 300.0
    faults: tuple[str, ...] = FAULT_KINDS
    # Simulated engine time runs this much faster than real time, and tool pauses shrink by
    # the same factor, so calls and pauses last tenths of a second.
    time_scale: float = 0.1
    # Each worker's KV pool: 512 sessions on 4 workers oversubscribe it a few times over, so
    # the policy pauses, holds and resumes programs throughout.
    blocks: int = 2048
    block_size: int = 16
    # A call with no answer after this long is lost (the gateway's own bounds, max_hold_s
    # and the hang fault, all end well before it).
    call_timeout_s: float = 300.0
    # The policy's longest wait for a paused program, in workload time (the default's 60 s);
    # the gateway's is this times time_scale, so that waits shrink with the calls and pauses
    # they stand between (60 s of real time would be ten minutes of the scaled workload, and
    # held calls, stretched by the oversubscription, would run into max_hold_s).
    policy_max_wait_s: float = 60.0
    # The RSS baseline is taken this long into the run (capped at a third of a short run).
    rss_baseline_s: float = 600.0
    seed: int = 11

    def validate(self) -> None:
        unknown = [kind for kind in self.faults if kind not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {FAULT_KINDS}")
        if self.duration_s <= 0 or self.sessions <= 0 or self.workers <= 0 or self.fault_every_s <= 0:
            raise ValueError("duration, sessions, workers and the fault period must be > 0")

    @property
    def scaled_max_wait_s(self) -> float:
        return self.policy_max_wait_s * self.time_scale

    @property
    def effective_rss_baseline_s(self) -> float:
        return min(self.rss_baseline_s, self.duration_s / 3.0)

    @property
    def fault_span_s(self) -> float:
        """How long a worker stays down (kill) or hung: past the gateway's health checks
        (every 1 s, down after 2 failures), and short of the next fault."""
        return max(5.0, min(20.0, self.fault_every_s / 2.5))
