"""What the engine should keep of each program's KV: the retention directives
(architecture.md §3 "Retention", "With a host KV tier").

A placed or resumed program gets ``Retain`` (refreshed before its TTL runs out while it
stays ACTIVE, dormant or not); a paused one ``Demote``, or with a host tier ``Offload`` (its
KV waits in host memory rather than being lost); a resumed one whose KV the tier holds
``Prefetch``. With ``offload_dormant`` a program turning dormant is offloaded too (no
``Retain`` refresh until its next call) and, with ``prefetch_predicted``, prefetched when its
tool call is predicted to end. With a tier and ``held_priority``, a paused program whose call
is held is prefetched too (at that priority, below a resumed one's): a full tier then gives up
first the KV of programs with nothing to run, whose next use is furthest off. Which of these
apply is read from the config once, when it is set.

Invariant 1: a session is in ``_retained_until`` exactly while its latest ``Retain`` is the
directive in force (it leaves on pause, on offload and on release), and then one refresh
entry due at ``sent + ttl_s·(1 − refresh_fraction)`` is live in ``_refresh``.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.actions import Action, Demote, Offload, Prefetch, Retain
from scheduler.config import RetentionConfig
from scheduler.coordinates import SessionId
from scheduler.deadline_heap import DeadlineHeap
from scheduler.kv_index import KVIndex
from scheduler.programs import Program


class Keep:
    """Plans the retention directives. Reads the program table and the KV index's host
    tier; changes neither."""

    def __init__(self, retention: RetentionConfig, index: KVIndex, programs: Mapping[SessionId, Program]) -> None:
        self._index = index
        self._programs = programs
        # session -> when its Retain lapses; (refresh at, session): when to re-send it
        self._retained_until: dict[str, float] = {}
        self._refresh: DeadlineHeap[tuple[float, str]] = DeadlineHeap(self._refresh_wanted, lambda: len(programs))
        # sessions to send a Retain at the next tick, in the order they asked
        self._due: dict[str, None] = {}
        # paused sessions whose call was held since the last tick (to favour in the tier)
        self._held: dict[str, None] = {}
        self.reconfigure(retention)

    def reconfigure(self, retention: RetentionConfig) -> None:
        self.retention = retention
        enabled, tiered = retention.enabled, retention.enabled and retention.host_tier
        # a paused program: Offload with a tier, else Demote, nothing with retention off
        self._offloads_paused = self._prefetches_resumed = tiered
        self._demotes_paused = enabled and not tiered
        self._offloads_dormant = tiered and retention.offload_dormant
        self.prefetches_predicted = self._offloads_dormant and retention.prefetch_predicted
        self._favours_held = tiered and retention.held_priority is not None

    # -- what each move asks the engine to keep ----------------------------------------

    def placed(self, session: str) -> None:
        """``session`` was placed or resumed: retain it at the next tick."""
        self._due[session] = None

    def arrived_home(self, program: Program) -> None:
        """A call of an ACTIVE program goes home: retain it again if it was offloaded while
        dormant."""
        if self._offloads_dormant and program.session_id not in self._retained_until:
            self._due[program.session_id] = None

    def paused(self, program: Program, worker: str) -> list[Action]:
        self._retained_until.pop(program.session_id, None)  # keeps invariant 1
        if self._offloads_paused:
            return [Offload(program.session_id, worker, program.chain_head)]
        if self._demotes_paused:
            return [Demote(program.session_id, worker)]
        return []

    def resumed(self, program: Program, worker: str) -> list[Action]:
        """A paused program resumed on ``worker``, its held calls just admitted: with a tier
        holding its KV, keep it there until they load it back (the Prefetch names their
        prompt)."""
        if self._prefetches_resumed and self._index.host_tokens(worker, program.session_id) > 0:
            return [self._prefetch(program, worker)]
        return []

    def held(self, program: Program) -> None:
        """A call of ``program`` was held: if it is paused, favour its KV in the tier at the
        next tick (its next use is near: it resumes once there is room, or at its wait limit)."""
        if self._favours_held and program.paused:
            self._held[program.session_id] = None

    def turned_dormant(self, program: Program) -> Offload | None:
        """``program`` turned dormant: with ``offload_dormant``, host memory holds its KV
        until its next call."""
        if not self._offloads_dormant or program.home_worker is None:
            return None
        self._retained_until.pop(program.session_id, None)  # no refresh (invariant 1): its next call retains it
        return Offload(program.session_id, program.home_worker, program.chain_head)

    def tool_call_ends(self, program: Program) -> Prefetch:
        """An offloaded dormant program's tool call is predicted to end: load its KV back."""
        assert program.home_worker is not None  # Dormancy.predicted_ends hands over placed programs
        return self._prefetch(program, program.home_worker)

    def _prefetch(self, program: Program, worker: str) -> Prefetch:
        retention = self.retention
        return Prefetch(program.session_id, worker, retention.prefetch_priority, program.chain_head,
                        retention.prefetch_deadline_s)

    # -- the tick ----------------------------------------------------------------------

    def retain(self, now: float) -> list[Action]:
        """The directives due at a tick: ``Retain`` for programs placed or resumed since the
        last tick and refreshes of those whose TTL is running out; ``Prefetch`` for paused
        programs whose call was held since then, where the tier holds their KV."""
        retention = self.retention
        if not retention.enabled:
            self._due.clear()
            self._held.clear()
            return []
        actions: list[Action] = self._favour_held()
        for _, session in self._refresh.pop_due(now):
            if session in self._retained_until and self._retained_until[session] - now <= (
                retention.ttl_s * retention.refresh_fraction
            ):
                self._due[session] = None
        for session in self._due:
            program = self._programs.get(session)
            if program is None or not program.active or program.home_worker is None:
                continue
            actions.append(Retain(session, program.home_worker, retention.active_priority, retention.ttl_s,
                                  program.chain_head))
            self._retained_until[session] = now + retention.ttl_s  # keeps invariant 1
            self._refresh.push((now + retention.ttl_s * (1.0 - retention.refresh_fraction), session))
        self._due.clear()
        return actions

    def _favour_held(self) -> list[Action]:
        actions: list[Action] = []
        priority = self.retention.held_priority
        for session in self._held:
            program = self._programs.get(session)
            # still paused with a call held (a resume since sent its own Prefetch)
            if program is None or not program.paused or not program.waiting:
                continue
            worker = program.home_worker
            if priority is not None and worker is not None and self._index.host_tokens(worker, session) > 0:
                actions.append(Prefetch(session, worker, priority, program.chain_head))
        self._held.clear()
        return actions

    def forget(self, session: str) -> None:
        """The program was released."""
        self._retained_until.pop(session, None)
        self._due.pop(session, None)
        self._held.pop(session, None)
        self._refresh.trim()

    def _refresh_wanted(self, entry: tuple[float, str]) -> bool:
        # the latest refresh of a retained session is due at or after its Retain was sent
        until = self._retained_until.get(entry[1])
        return until is not None and entry[0] >= until - self.retention.ttl_s
