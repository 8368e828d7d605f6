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

import anyio

# Past the grace, how long the cut calls have to send their last bytes before uvicorn
# cancels their tasks.
CUT_MARGIN_S = 3.0


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self._cut: anyio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    def open(self) -> None:
        """Bind to the running event loop (the app's lifespan calls it)."""
        self._cut = anyio.Event()

    @property
    def cut(self) -> bool:
        return self._cut is not None and self._cut.is_set()

    async def wait_cut(self) -> None:
        if self._cut is None:
            raise RuntimeError("Drain.open() was not called: the app's lifespan did not run")
        await self._cut.wait()

    def begin(self) -> None:
        """Shutdown started: cut whatever is still open ``grace_s`` from now."""
        if self.draining or self._cut is None:
            return
        self.draining = True
        cut = self._cut
        self._timer = asyncio.get_running_loop().call_later(self.grace_s, cut.set)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
