"""How much power a directive has over the engine that receives it: the bounds both receivers
apply, the simworker's directive socket (``simworker/directive_socket.py``) and the engine
plugin's (:mod:`sluice_vllm_plugin.directives`, :mod:`sluice_vllm_plugin.retention`), so a
directive does the same on either engine.

A directive is a hint from the gateway, but anything that can reach the socket can send one, so
the receiver, not the sender, decides what one may do:

* a retain's ``ttl_s`` and a prefetch's ``deadline_s`` are clamped to ``max_ttl_s`` (``inf``
  too); NaN or a negative value (which the envelope already rejects, but an action posted in
  process is not decoded) refuses the action;
* a ``priority`` is clamped into ``[priority_min, priority_max]``;
* at most ``max_sessions`` sessions hold directive state; a directive that would add one more
  is refused (a ``kv.release`` is always taken: it removes state);
* a session's state is forgotten ``forget_after_s`` after its latest directive: the receiver
  releases it (its blocks go back to plain LRU, the host tier forgets its favour), so a
  demotion or a prefetch without a deadline cannot last for ever; ``max_ttl_s`` ≤
  ``forget_after_s``, so forgetting never cuts a retain short (the simworker looks at every
  message and once a second while idle, the plugin whenever it drains its inbox);
* a retain above the normal class is refused when the session holds more than
  ``max_session_retained_blocks`` cached blocks, or when the retained sessions' blocks would
  exceed ``max_retained_blocks`` (blocks counted when each retain arrives; a retain stops
  counting when its TTL ends; None: no budget, the pool is the bound);
* a message over ``max_message_bytes`` is cut off by ZMQ (``MAXMSGSIZE``: the sender is
  disconnected) or, where ZMQ does not apply the option, dropped by the handler; a session id
  is at most 256 characters (the envelope's own rule, the gateway's);
* the plugin's inbox (directives waiting for the scheduler's thread) holds at most
  ``max_queued``; more are refused.

Each receiver reads its :class:`DirectiveLimits` where it reads its settings: the simworker from
its ``SimWorkerConfig``, the plugin from ``SLUICE_DIRECTIVE_<FIELD>`` environment variables
(:func:`limits_from_environment`). :class:`DirectiveGovernor` is the per-receiver state that
applies them; :class:`ThrottledLog` keeps a flood of bad input from becoming a flood of log lines.

Standard library and the envelope only: this runs in vLLM's environment.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import math
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from .directive_envelope import KvAction, verb_of
from .zmq_auth import ServerKeys, server_options

# A retain's priority is its eviction class; above this one it holds blocks against everyone
# else's (the engines' NORMAL_CLASS: sim/block_pool.py, retention.py).
NORMAL_PRIORITY = 50

ENV_PREFIX = "SLUICE_DIRECTIVE_"

logger = logging.getLogger("sluice.vllm_plugin.directive_limits")

# Reasons an action is refused (counted by reason in DirectiveGovernor.refused).
REFUSED_INVALID = "invalid"                  # NaN or negative time
REFUSED_SESSIONS = "sessions"                # max_sessions reached
REFUSED_SESSION_BLOCKS = "session_blocks"    # the session holds too many blocks to retain
REFUSED_RETAINED_BLOCKS = "retained_blocks"  # the total retained-block budget is spent
REFUSED_QUEUED = "queued"                    # the plugin's inbox is full

# A heap of (time, session) entries is rebuilt from the live ones once its stale entries
# exceed the live ones by this many.
HEAP_SLACK = 64


@dataclass(frozen=True, slots=True)
class DirectiveLimits:
    """What a directive may do to the engine that receives it (see the module's doc)."""

    max_ttl_s: float = 3600.0
    priority_min: int = 0
    priority_max: int = 100
    max_sessions: int = 20_000
    forget_after_s: float = 7200.0
    max_session_retained_blocks: int | None = None
    max_retained_blocks: int | None = None
    # One directive is a few hundred bytes (the gateway sends one action per envelope).
    max_message_bytes: int = 65_536
    max_queued: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ttl_s) and self.max_ttl_s > 0):
            raise ValueError(f"max_ttl_s must be a finite number > 0, got {self.max_ttl_s}")
        if not (math.isfinite(self.forget_after_s) and self.forget_after_s >= self.max_ttl_s):
            raise ValueError(f"forget_after_s must be finite and ≥ max_ttl_s ({self.max_ttl_s}), "
                             f"got {self.forget_after_s}")
        if not 0 <= self.priority_min <= self.priority_max <= 100:
            raise ValueError("priority_min and priority_max must satisfy 0 ≤ min ≤ max ≤ 100, "
                             f"got {self.priority_min} and {self.priority_max}")
        for name in ("max_sessions", "max_message_bytes", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("max_session_retained_blocks", "max_retained_blocks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be ≥ 0 or None, got {value}")

    @property
    def counts_blocks(self) -> bool:
        return self.max_session_retained_blocks is not None or self.max_retained_blocks is not None


DEFAULT_LIMITS = DirectiveLimits()


def env_name(field: str) -> str:
    """``SLUICE_DIRECTIVE_MAX_TTL_S`` for ``max_ttl_s``."""
    return ENV_PREFIX + field.upper()


def limits_from_environment(environ: Mapping[str, str] = os.environ) -> tuple[DirectiveLimits, list[str]]:
    """The limits the ``SLUICE_DIRECTIVE_<FIELD>`` variables set, and what was wrong with any
    (each such variable keeps its default; a set that does not hold together keeps every
    default). A bad setting must not stop the engine: the caller logs the problems."""
    values: dict[str, object] = {}
    problems: list[str] = []
    for field in dataclasses.fields(DirectiveLimits):
        raw = environ.get(env_name(field.name), "").strip()
        if not raw:
            continue
        try:
            if raw.lower() == "none" and field.default is None:
                values[field.name] = None
            elif isinstance(field.default, float):
                values[field.name] = float(raw)
            else:
                values[field.name] = int(raw)
        except ValueError:
            problems.append(f"{env_name(field.name)}={raw!r} is not a number; default kept")
    try:
        return DirectiveLimits(**values), problems  # type: ignore[arg-type]
    except ValueError as err:
        return DirectiveLimits(), problems + [f"{err}; every default kept"]


@functools.lru_cache(maxsize=1)
def environment_limits() -> DirectiveLimits:
    """This process's limits from its environment, read (and its problems logged) once: the
    engine plugin's directive socket and every block pool's retention share them."""
    limits, problems = limits_from_environment()
    for problem in problems:
        logger.warning("sluice directive limits: %s", problem)
    return limits


class ThrottledLog:
    """When to log a bad directive: the first at once, then at most one line per
    ``interval_s``, which says how many were not logged since the last one."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._logged_at = -math.inf
        self._unlogged = 0

    def due(self) -> int | None:
        """None: stay quiet (the event is counted); else log now, mentioning this many unlogged."""
        now = self._clock()
        if now - self._logged_at < self.interval_s:
            self._unlogged += 1
            return None
        self._logged_at = now
        unlogged, self._unlogged = self._unlogged, 0
        return unlogged


class DirectiveGovernor:
    """One receiver's directive state, as far as the limits need it: which sessions hold state
    and since when, and (only when a block budget is set) the blocks each retain holds.

    :meth:`admit` is asked before each action is applied: it returns the action to apply
    (clamped) or None (refused, counted in ``refused``). :meth:`lapsed` names the sessions to
    forget, which the receiver then releases. Single-threaded: the receiver calls it where it
    applies directives. ``blocks_of(session)`` counts a session's cached blocks."""

    def __init__(self, limits: DirectiveLimits, blocks_of: Callable[[str], int] | None = None) -> None:
        if limits.counts_blocks and blocks_of is None:
            raise ValueError("a retained-block budget needs a way to count a session's blocks")
        self.limits = limits
        self._blocks_of = blocks_of
        # session -> time of its latest directive, oldest first (every directive moves it last)
        self._latest: OrderedDict[str, float] = OrderedDict()
        # retained above the normal class, while a block budget is set:
        # session -> (blocks counted, when the retain ends), and those ends as a heap
        self._retained: dict[str, tuple[int, float]] = {}
        self._retained_ends: list[tuple[float, str]] = []
        self.retained_blocks = 0
        self.refused: Counter[str] = Counter()
        self.clamped = 0
        self.forgotten = 0

    @property
    def sessions(self) -> int:
        """Sessions holding directive state."""
        return len(self._latest)

    def admit(self, action: KvAction, now: float) -> KvAction | None:
        """The action to apply (its values clamped), or None when it is refused."""
        verb = verb_of(action)
        payload = action.payload
        session = payload.session_id
        if verb == "release":
            self._forget(session)
            return action
        if session not in self._latest and len(self._latest) >= self.limits.max_sessions:
            self.refused[REFUSED_SESSIONS] += 1
            return None
        clamped = self._clamp(payload)
        if clamped is None:
            self.refused[REFUSED_INVALID] += 1
            return None
        if clamped is not payload:
            self.clamped += 1
            action = msgspec.structs.replace(action, payload=clamped)
        if self.limits.counts_blocks:
            if verb == "retain":
                if not self._within_block_budgets(session, clamped.priority, clamped.ttl_s, now):
                    return None
            elif verb in ("demote", "offload"):
                self._unretain(session)      # its blocks go first now: they hold nothing back
        self._latest[session] = now
        self._latest.move_to_end(session)
        return action

    def lapsed(self, now: float) -> list[str]:
        """Sessions whose latest directive is ``forget_after_s`` old: forgotten here, for the
        receiver to release."""
        horizon = now - self.limits.forget_after_s
        latest = self._latest
        gone = []
        while latest:
            session, at = next(iter(latest.items()))
            if at > horizon:
                break
            del latest[session]
            self._unretain(session)
            gone.append(session)
        self.forgotten += len(gone)
        return gone

    def _clamp(self, payload: msgspec.Struct) -> msgspec.Struct | None:
        """The payload with its times and priority in bounds (the same object when they were);
        None when a time is NaN or negative."""
        limits = self.limits
        changes: dict[str, object] = {}
        for name in ("ttl_s", "deadline_s"):
            value = getattr(payload, name, None)
            if value is None:
                continue
            value = float(value)
            if math.isnan(value) or value < 0:
                return None
            if value > limits.max_ttl_s:
                changes[name] = limits.max_ttl_s
        priority = getattr(payload, "priority", None)
        if priority is not None:
            bounded = max(limits.priority_min, min(limits.priority_max, int(priority)))
            if bounded != priority:
                changes["priority"] = bounded
        return msgspec.structs.replace(payload, **changes) if changes else payload

    def _within_block_budgets(self, session: str, priority: int, ttl_s: float, now: float) -> bool:
        """Whether a retain fits the block budgets; if it does, its blocks are counted."""
        if priority <= NORMAL_PRIORITY:
            self._unretain(session)          # not held above anyone: nothing to count
            return True
        self._end_retains(now)
        limits = self.limits
        blocks = self._blocks_of(session)    # type: ignore[misc]
        if limits.max_session_retained_blocks is not None and blocks > limits.max_session_retained_blocks:
            self.refused[REFUSED_SESSION_BLOCKS] += 1
            return False
        previous = self._retained.get(session)
        total = self.retained_blocks - (previous[0] if previous else 0) + blocks
        if limits.max_retained_blocks is not None and total > limits.max_retained_blocks:
            self.refused[REFUSED_RETAINED_BLOCKS] += 1
            return False
        ends = now + ttl_s
        self._retained[session] = (blocks, ends)
        self.retained_blocks = total
        heap = self._retained_ends
        heapq.heappush(heap, (ends, session))
        if len(heap) > 2 * len(self._retained) + HEAP_SLACK:
            # a session retained again leaves its earlier end behind: drop those
            heap[:] = [(end, s) for s, (_, end) in self._retained.items()]
            heapq.heapify(heap)
        return True

    def _end_retains(self, now: float) -> None:
        heap = self._retained_ends
        while heap and heap[0][0] <= now:
            ends, session = heapq.heappop(heap)
            entry = self._retained.get(session)
            if entry is not None and entry[1] == ends:
                self._unretain(session)

    def _unretain(self, session: str) -> None:
        entry = self._retained.pop(session, None)
        if entry is not None:
            self.retained_blocks -= entry[0]

    def _forget(self, session: str) -> None:
        self._latest.pop(session, None)
        self._unretain(session)


def receiver_socket_options(limits: DirectiveLimits, server_keys: ServerKeys | None = None
                            ) -> list[tuple[int, int | bytes]]:
    """The ZMQ options every directive receiving socket sets before it binds or connects; with
    ``server_keys``, those of a CURVE server too (its context then needs a ZAP handler,
    :class:`~sluice_vllm_plugin.zmq_auth.ServerAuth`, to turn away unknown clients)."""
    import zmq
    options: list[tuple[int, int | bytes]] = [(zmq.LINGER, 0),
                                              (zmq.MAXMSGSIZE, limits.max_message_bytes)]
    if server_keys is not None:
        options += server_options(server_keys)
    return options
