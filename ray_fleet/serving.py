"""An ASGI app under uvicorn in a thread of its own, for the actors of this package.

A Ray actor's methods run on the actor's own thread; the server gets another, with its own
event loop, so the actor keeps answering ``url()`` or ``stop()`` while it serves. uvicorn
installs signal handlers only on the main thread, so Ray's own handling of the actor process
is left alone.
"""

from __future__ import annotations

import threading
import time

import uvicorn

STARTUP_TIMEOUT_S = 30.0


class ServerInThread:
    """Serves ``server`` (a configured :class:`uvicorn.Server`) until :meth:`stop`."""

    def __init__(self, server: uvicorn.Server, name: str) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.run, name=name, daemon=True)
        self._port: int | None = None

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
        """Start serving and return the port bound (the one asked for, or the kernel's pick
        for port 0)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"{self._thread.name}: the server exited during start-up "
                                   "(its log, in the actor's stderr, says why)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self._thread.name}: the server did not start within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.01)
        self._port = self._server.servers[0].sockets[0].getsockname()[1]
        return self._port

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self._thread.name}: not started")
        return self._port

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Ask the server to shut down as on SIGTERM and wait up to ``timeout_s``; True when
        it has exited."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
