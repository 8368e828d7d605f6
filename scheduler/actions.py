"""Decisions the core returns as data; the shells carry them out.

:attr:`Admit.priority` is the time, on the policy's clock, at which the call counts as having
arrived in the engine's queue (lower runs sooner, ties by arrival at the engine): a plain
admission carries the call's arrival; a resumed program's call its arrival minus
``resume_priority_boost_s``; a call admitted to a soft-band worker its arrival plus
``soft_band_delay_s``; autellix adds its queue index times a tier so wide that queues never
mix (scheduler/policies/autellix.py). An engine is not on the policy's clock, so both shells
hand it :func:`engine_priority`: the same time as milliseconds relative to the moment of
dispatch, the integer vLLM's ``priority`` field takes (architecture.md §3).

A :data:`Directive` is for the engine of its ``worker``: each has a ``verb``, the name of its
action in the directive envelope (``kv.retain`` for ``retain``;
``sluice_vllm_plugin/directive_envelope.py``), whose payload is read off the directive's
fields of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from scheduler.coordinates import ContinuationId, SessionId

WorkerName = str


@dataclass(frozen=True, slots=True)
class Admit:
    """Send ``request_id`` to ``worker`` now, ``priority`` (policy-clock seconds; see the
    module docstring) placing it in the engine's queue."""

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

    verb: ClassVar[str] = "retain"
    session_id: SessionId
    worker: WorkerName
    priority: int
    ttl_s: float
    continuation_id: ContinuationId | None = None


@dataclass(frozen=True, slots=True)
class Demote:
    """The session's KV on ``worker`` may go first."""

    verb: ClassVar[str] = "demote"
    session_id: SessionId
    worker: WorkerName


@dataclass(frozen=True, slots=True)
class Release:
    """The program is over (final, idle, or released by an operator); forget its KV bias."""

    verb: ClassVar[str] = "release"
    session_id: SessionId
    worker: WorkerName | None
    reason: str


@dataclass(frozen=True, slots=True)
class Offload:
    """Park the session's KV on ``worker`` in its host tier and let the GPU copy go first
    (``kv.offload``: it replaces a :class:`Demote`, which it includes)."""

    verb: ClassVar[str] = "offload"
    session_id: SessionId
    worker: WorkerName
    continuation_id: ContinuationId | None = None


@dataclass(frozen=True, slots=True)
class Prefetch:
    """The session is about to run on ``worker`` again: keep its host-tier KV ahead of
    others' (lower ``priority`` gives way first) until ``deadline_s`` seconds from now (None:
    until its next call loads it or a :class:`Release`), and undo a GPU demotion
    (``kv.prefetch``)."""

    verb: ClassVar[str] = "prefetch"
    session_id: SessionId
    worker: WorkerName
    priority: int
    continuation_id: ContinuationId | None = None
    deadline_s: float | None = None


def engine_priority(priority: float, dispatched_at: float) -> int:
    """The integer an engine's request carries for an :class:`Admit` of ``priority``
    dispatched at ``dispatched_at`` (both on the policy's clock): milliseconds from the
    dispatch to the moment the call counts as having arrived. A call neither held, boosted
    nor delayed gets 0 (vLLM's default, and what a call gets where the priority is not sent);
    a held or resumed one a negative value (ahead of later arrivals); a soft-band one a
    positive value. Relative, because an engine orders its queue by ``(priority, its own
    arrival time)`` and knows nothing of the policy's clock (vllm/v1/request.py
    ``Request.__lt__``, 0.32)."""
    return round((priority - dispatched_at) * 1000.0)


# What a shell sends on to an engine (the others it carries out itself, or only logs).
Directive = Retain | Demote | Release | Offload | Prefetch
Action = Admit | Hold | Resume | Pause | Mark | Directive
Decision = Admit | Hold
