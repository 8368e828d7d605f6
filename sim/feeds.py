"""Program feeds: which programs a simulation starts, and when (sim/simulation.py asks its feed
for the first programs and for what follows each program's end).

A closed loop keeps a number of generated programs alive, an open loop plays a trace at its
own times, a conversation loop replays a trace's conversations (each with its sub-agents) a
number at a time, and batches start the next batch of RL rollouts when the last one has
ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from sim.programs import ProgramSpec


class ProgramFeed:
    """Decides which programs start when: closed loop, open loop or batches with barriers."""

    # Whether a run of this feed reports how long each program waited for its first call to
    # start, by size (a burst's fairness: :attr:`SimResult.start_waits`).
    reports_start_waits: bool = False

    def initial(self) -> list[ProgramSpec]:
        raise NotImplementedError

    def on_program_end(self, spec: ProgramSpec, now: float) -> list[ProgramSpec]:
        return []

    def batch_makespans_s(self) -> list[float]:
        """Seconds from each finished batch's start to its last program's end (feeds
        with a batch barrier; none for the others)."""
        return []

    def fraction_done(self) -> float | None:
        """How much of a feed that runs out has ended (0 to 1): what a run's progress shows
        when it ends with its programs, not at a set time. None for a feed that never runs
        out (its run ends at its duration)."""
        return None


class ClosedLoop(ProgramFeed):
    """Keep ``concurrency`` programs alive: a new one starts as soon as one ends. The first
    ones start spread over ``ramp_s`` so they do not all send their first call at once."""

    def __init__(self, make_program: Callable[[int], ProgramSpec], concurrency: int,
                 ramp_s: float = 30.0) -> None:
        if concurrency <= 0:
            raise ValueError(f"concurrency must be > 0, got {concurrency}")
        self._make = make_program
        self._concurrency = concurrency
        self._ramp_s = ramp_s
        self._next = 0

    def _new(self, start_at: float) -> ProgramSpec:
        spec = self._make(self._next)
        self._next += 1
        spec.start_at = start_at
        return spec

    def initial(self) -> list[ProgramSpec]:
        n = self._concurrency
        return [self._new(self._ramp_s * i / n) for i in range(n)]

    def on_program_end(self, spec: ProgramSpec, now: float) -> list[ProgramSpec]:
        return [self._new(now)]


class OpenLoop(ProgramFeed):
    """Play a fixed set of programs (a trace) at their own start times."""

    def __init__(self, programs: Iterable[ProgramSpec], *, report_start_waits: bool = False) -> None:
        self._programs = list(programs)
        self._ended = 0
        self.reports_start_waits = report_start_waits

    def initial(self) -> list[ProgramSpec]:
        return self._programs

    def on_program_end(self, spec: ProgramSpec, now: float) -> list[ProgramSpec]:
        self._ended += 1
        return []

    def fraction_done(self) -> float | None:
        return self._ended / len(self._programs) if self._programs else 1.0


class ConversationLoop(ProgramFeed):
    """Closed-loop trace replay: ``concurrency`` conversations in flight, the next (in trace
    order) starting the moment one ends.

    A conversation is a top-level session with all its sub-agents: the programs linked to it
    through ``parent_session_id`` (a parent that is not among the programs makes a program
    top-level). It has ended when every one of its programs has. Conversations are taken in
    the order of their top-level program in ``programs``; the first ``concurrency`` start at
    time 0. Each keeps its own timing relative to its start: ``think_s`` gaps are relative
    already, and its ``start_at`` and recorded ``at`` times are shifted by its start minus
    its recorded start (its earliest ``start_at``). Throughput then depends on how fast the
    fleet serves the calls, not on the trace's longest conversation.
    """

    def __init__(self, programs: Iterable[ProgramSpec], concurrency: int) -> None:
        if concurrency <= 0:
            raise ValueError(f"concurrency must be > 0, got {concurrency}")
        self._conversations = group_conversations(list(programs))
        self._concurrency = concurrency
        self._next = 0
        self._conversation_of: dict[str, int] = {}  # live session → its conversation
        self._programs_left: dict[int, int] = {}  # live conversation → programs not ended
        self._ended = 0  # conversations every program of which has ended

    @property
    def conversations(self) -> int:
        return len(self._conversations)

    def initial(self) -> list[ProgramSpec]:
        programs: list[ProgramSpec] = []
        for _ in range(min(self._concurrency, len(self._conversations))):
            programs += self._start_next(0.0)
        return programs

    def on_program_end(self, spec: ProgramSpec, now: float) -> list[ProgramSpec]:
        number = self._conversation_of.pop(spec.session_id)
        self._programs_left[number] -= 1
        if self._programs_left[number]:
            return []
        del self._programs_left[number]
        self._ended += 1
        if self._next == len(self._conversations):
            return []
        return self._start_next(now)

    def fraction_done(self) -> float | None:
        return self._ended / len(self._conversations) if self._conversations else 1.0

    def _start_next(self, now: float) -> list[ProgramSpec]:
        number = self._next
        self._next += 1
        recorded = self._conversations[number]
        recorded_start = min(spec.start_at for spec in recorded)
        programs = [shifted_program(spec, recorded_start, now) for spec in recorded]
        for spec in programs:
            self._conversation_of[spec.session_id] = number
        self._programs_left[number] = len(programs)
        return programs


def group_conversations(programs: list[ProgramSpec]) -> list[list[ProgramSpec]]:
    """Programs grouped by their top-level session (a conversation: it and its sub-agents),
    groups in the order of that session."""
    by_id = {spec.session_id: spec for spec in programs}
    groups: dict[str, list[ProgramSpec]] = {}
    for spec in programs:
        groups.setdefault(_top_level(spec, by_id), []).append(spec)
    position = {spec.session_id: i for i, spec in enumerate(programs)}
    return [groups[top] for top in sorted(groups, key=position.__getitem__)]


def _top_level(spec: ProgramSpec, by_id: dict[str, ProgramSpec]) -> str:
    seen = {spec.session_id}
    while spec.parent_session_id in by_id and spec.parent_session_id not in seen:
        spec = by_id[spec.parent_session_id]
        seen.add(spec.session_id)
    return spec.session_id


def shifted_program(spec: ProgramSpec, recorded_start: float, start: float) -> ProgramSpec:
    """A fresh copy of ``spec`` (its own hash stream) with its recorded times moved from
    ``recorded_start`` to ``start`` (offsets first, so the conversation starts exactly then)."""
    calls = [call if call.at is None
             else dataclasses.replace(call, at=start + (call.at - recorded_start))
             for call in spec.calls]
    return dataclasses.replace(spec, calls=calls, start_at=start + (spec.start_at - recorded_start),
                               _stream=[])


class Batches(ProgramFeed):
    """RL rollouts: batch ``b+1`` starts when every program of batch ``b`` has ended."""

    def __init__(self, make_batch: Callable[[int], list[ProgramSpec]]) -> None:
        self._make_batch = make_batch
        self._batch = 0
        self._left = 0
        self._started_at = 0.0
        self._makespans_s: list[float] = []

    def _start_batch(self, now: float) -> list[ProgramSpec]:
        programs = self._make_batch(self._batch)
        self._batch += 1
        self._left = len(programs)
        self._started_at = now
        for spec in programs:
            spec.start_at = now
        return programs

    def initial(self) -> list[ProgramSpec]:
        return self._start_batch(0.0)

    def on_program_end(self, spec: ProgramSpec, now: float) -> list[ProgramSpec]:
        self._left -= 1
        if self._left:
            return []
        self._makespans_s.append(now - self._started_at)
        return self._start_batch(now)

    def batch_makespans_s(self) -> list[float]:
        return list(self._makespans_s)
