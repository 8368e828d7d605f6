"""The gateway's graceful shutdown.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and closes idle ones; the
:class:`Drain` then gives the calls in progress ``shutdown_grace_s`` to finish on their own.
When the grace runs out it *cuts*: every call still open ends at once, in a way its client
can read — a stream gets a last SSE error event, a held call or one whose answer has not
started gets a 503 with ``Retry-After``. Only then does uvicorn cancel what is left (it is
given a few seconds more than the grace, :data:`CUT_MARGIN_S`, for those last bytes).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import anyio

# Past the grace, how long the cut calls have to send their last bytes before uvicorn
# cancels their tasks.
CUT_MARGIN_S = 3.0


class Cuttable(Protocol):
    def cut_by_drain(self) -> None: ...


class Drain:
    """Invariant 1: ``_open`` holds exactly the calls in progress (each tracks itself for its
    whole life: controller/relay.py ``ProxyCall``), so the cut reaches every one of them.
    Invariant 2: a call that starts after the cut is cut as it starts (:meth:`track`)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self._cut: anyio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._open: set[Cuttable] = set()

    def track(self, call: Cuttable) -> None:
        if self.cut:
            call.cut_by_drain()  # arrived on a connection still open after the cut (invariant 2)
        self._open.add(call)  # invariant 1: from its start ...

    def untrack(self, call: Cuttable) -> None:
        self._open.discard(call)  # ... to its end (invariant 1)

    def open(self) -> None:
        """Bind to the running event loop (the app's lifespan calls it)."""
        self._cut = anyio.Event()

    @property
    def cut(self) -> bool:
        return self._cut is not None and self._cut.is_set()

    def begin(self) -> None:
        """Shutdown started: cut whatever is still open ``grace_s`` from now."""
        if self.draining or self._cut is None:
            return
        self.draining = True
        self._timer = asyncio.get_running_loop().call_later(self.grace_s, self._cut_now)

    def _cut_now(self) -> None:
        assert self._cut is not None
        self._cut.set()
        for call in list(self._open):
            call.cut_by_drain()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
