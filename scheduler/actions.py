"""Decisions the core returns as data; the shells carry them out.

Priorities in :class:`Admit` order an engine's waiting queue: lower runs sooner. A plain
admission carries its arrival time; a resumed one carries its arrival time minus the
resume boost, so it jumps ahead of requests that arrived up to that many seconds earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.coordinates import ContinuationId, SessionId

WorkerName = str


@dataclass(frozen=True, slots=True)
class Admit:
    """Send ``request_id`` to ``worker`` now."""

    request_id: str
    session_id: SessionId
    worker: WorkerName
    priority: float
    resumed: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep ``request_id`` waiting; a later :class:`Admit` releases it."""

    request_id: str
    session_id: SessionId
    reason: str


@dataclass(frozen=True, slots=True)
class Resume:
    session_id: SessionId
    worker: WorkerName
    forced: bool = False


@dataclass(frozen=True, slots=True)
class Pause:
    session_id: SessionId
    worker: WorkerName


@dataclass(frozen=True, slots=True)
class Mark:
    """Pause this program when its in-flight work completes (never abort it)."""

    session_id: SessionId
    worker: WorkerName


@dataclass(frozen=True, slots=True)
class Retain:
    """Ask ``worker`` to prefer keeping the session's KV (a bias, not a pin)."""

    session_id: SessionId
    worker: WorkerName
    priority: int
    ttl_s: float
    continuation_id: ContinuationId | None = None


@dataclass(frozen=True, slots=True)
class Demote:
    """The session's KV on ``worker`` may go first."""

    session_id: SessionId
    worker: WorkerName


@dataclass(frozen=True, slots=True)
class Release:
    """The program is over (final, idle, or released by an operator); forget its KV bias."""

    session_id: SessionId
    worker: WorkerName | None
    reason: str


@dataclass(frozen=True, slots=True)
class Offload:
    """Park the session's KV on ``worker`` in its host tier and let the GPU copy go first
    (``kv.offload``: it replaces a :class:`Demote`, which it includes)."""

    session_id: SessionId
    worker: WorkerName
    continuation_id: ContinuationId | None = None


@dataclass(frozen=True, slots=True)
class Prefetch:
    """The session is about to run on ``worker`` again: keep its host-tier KV ahead of
    others' (lower ``priority`` gives way first) until ``deadline_s`` seconds from now (None:
    until its next call loads it or a :class:`Release`), and undo a GPU demotion
    (``kv.prefetch``)."""

    session_id: SessionId
    worker: WorkerName
    priority: int
    continuation_id: ContinuationId | None = None
    deadline_s: float | None = None


Action = Admit | Hold | Resume | Pause | Mark | Retain | Demote | Release | Offload | Prefetch
Decision = Admit | Hold
