"""A read-only picture of a policy's state, for the shells' metrics and admin views.

The shells must not reach into a policy's mutable insides (its program table, ledger or
index): what they show is taken here, as frozen values, by :meth:`Policy.snapshot`, so no
view can change the policy, and the policy can change its insides without breaking a shell.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ProgramView:
    session_id: str
    parent_session_id: str | None
    lifecycle: str  # pending | active | paused
    phase: str      # reasoning | acting
    marked: bool
    home_worker: str | None
    context_tokens: int
    in_flight: int
    waiting: int
    steps: int
    created_at: float
    last_activity: float
    group_id: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    name: str
    healthy: bool
    capacity_tokens: int | None
    utilization: float | None  # None while the capacity is unknown
    programs: int              # programs counted in U on it
    calls_in_flight: int
    kv_events: bool            # U uses the KV index (its events flow), else the estimate
    evicted_tokens: int
    unknown_removals: int
    attributed_removals: int


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    name: str
    programs: tuple[ProgramView, ...]
    workers: tuple[WorkerView, ...]
    stats: dict[str, int] = field(default_factory=dict)       # PolicyStats by field name
    adaptive: dict[str, float] = field(default_factory=dict)  # Policy.adaptive_settings()
