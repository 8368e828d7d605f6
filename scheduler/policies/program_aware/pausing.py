"""Which programs pause, which are marked, and which workers are in the soft band
(architecture.md §3 "Pause", "Soft band").

Invariant 1 (the pause pass): on a worker with ``U ≥`` its threshold, ACTING programs pause
smallest first, then REASONING ones are marked smallest first, each only while the
projected ``U`` (marked programs' tokens counted as already gone) is above ``pause_target``;
nothing in flight is aborted (a marked program pauses when its last call ends).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from scheduler.actions import Mark
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.ledger import Ledger
from scheduler.policies.program_aware.capacity import PoolCapacity
from scheduler.programs import Phase, Program


class Pausing:
    """Decides pauses and marks; the policy carries the pauses out. Reads the program table
    (marks are the one change it makes to a program) and the ledger."""

    def __init__(self, config: ProgramAwareConfig, capacity: PoolCapacity, ledger: Ledger,
                 programs: Mapping[SessionId, Program]) -> None:
        self.config = config
        self.capacity = capacity
        self._ledger = ledger
        self._programs = programs
        # workers with pause_target ≤ U < their threshold, as of the last tick
        self.soft_band: frozenset[str] = frozenset()

    def reconfigure(self, config: ProgramAwareConfig, capacity: PoolCapacity) -> None:
        self.config, self.capacity = config, capacity

    def pass_over_workers(self) -> Iterator[Program | Mark]:
        """The pause pass (invariant 1), in order: a program to pause, which the caller
        pauses before it asks for the next (the projection reads the ledger afresh), or a
        :class:`Mark` already made."""
        ledger, target = self._ledger, self.config.pause_target
        for load, utilization in ledger.utilizations():  # each read as its turn comes
            if not load.capacity_tokens or utilization < self.capacity.threshold(load.name):
                continue
            capacity = load.capacity_tokens
            on_worker = [self._programs[s] for s in load.programs]
            # Pausing ACTING programs marks none, so the marked share stays what it is here.
            marked = self._marked_tokens(load.name) / capacity
            projected = utilization - marked
            if projected <= target:
                continue
            acting = sorted(
                (p for p in on_worker if p.phase is Phase.ACTING),
                key=lambda p: (ledger.contribution(p.session_id), p.session_id),
            )
            for program in acting:
                if projected <= target:
                    break
                yield program
                projected = ledger.utilization(load.name) - marked
            if projected <= target:
                continue
            reasoning = sorted(
                (p for p in on_worker if p.phase is Phase.REASONING and not p.marked),
                key=lambda p: (ledger.contribution(p.session_id), p.session_id),
            )
            for program in reasoning:
                if projected <= target:
                    break
                program.mark()
                projected -= ledger.contribution(program.session_id) / capacity
                yield Mark(program.session_id, load.name)

    def projected_utilization(self, worker: str) -> float:
        """``U_w`` with marked programs' tokens counted as already gone (what a pause pass
        brings down to ``pause_target``)."""
        load = self._ledger.worker(worker)
        if not load.capacity_tokens:
            return math.inf
        return self._ledger.utilization(worker) - self._marked_tokens(worker) / load.capacity_tokens

    def _marked_tokens(self, worker: str) -> float:
        programs = self._programs
        return sum(self._ledger.contribution(s) for s in self._ledger.worker(worker).programs
                   if programs[s].marked)

    def update_soft_band(self) -> None:
        """Workers with ``pause_target ≤ U < pause_threshold`` that do not run all their
        programs: calls admitted there go ``soft_band_delay_s`` later in the engine's queue."""
        low, high = self.config.pause_target, self.config.pause_threshold
        self.soft_band = frozenset(
            load.name
            for load, utilization in self._ledger.utilizations()
            if load.capacity_tokens and low <= utilization < high
            and not self.capacity.runs_all(load.name)
        )
