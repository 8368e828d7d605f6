"""What vllm_router keeps of each program beyond Sluice's :class:`~scheduler.programs.Program`:
the source's per-program decision facts (vllm-project/router
``src/program_scheduling/scheduler_state.rs``, ``ProgramDecisionState``), those its rules read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PauseReason(enum.Enum):
    """Why a program was last paused (the source's ``ProgramPauseReason``; ``WORKER_LOST`` is
    Sluice's: its worker failed)."""

    TTL_EXPIRED = "ttl_expired"
    CAPACITY_REPAIR = "capacity_repair"
    SEGMENT_YIELD = "max_segment_yield"
    REQUEST_FAILED = "request_failed"
    WORKER_LOST = "worker_lost"


@dataclass(slots=True)
class ProgramFacts:
    # the worker the program was bound to at first sight, or last ran on (its "previous rank");
    # None while no worker is healthy
    last_target: str | None
    # when it entered the request pool, and when it is forced back (None: not queued)
    queued_at: float | None = None
    force_deadline: float | None = None
    # its last completed call: when, its prompt, and what recomputing it would cost
    last_finished_at: float | None = None
    last_prompt_tokens: int | None = None
    last_cache_miss_impact_s: float = 0.0
    # tokens of its prompt it shares with others (cached at its first completed call)
    shared_prefix_tokens: int | None = None
    # cache-continuous rounds since it was last admitted, and since its last TTL pause
    rounds_since_activation: int = 0
    rounds_since_ttl_pause: int = 0
    # when its current cache-continuous segment began (capacity repair's score)
    segment_started_at: float | None = None
    # ACTIVE and acting: when its acting TTL runs out
    ttl_deadline: float | None = None
    # the TTL its last completed call earned (None: the call failed)
    earned_ttl_s: float | None = None
    last_pause_reason: PauseReason | None = None
