"""Running the gateway: uvicorn with its fast parts when installed (httptools, uvloop) and
a graceful drain (controller/drain.py) hooked into its shutdown."""

from __future__ import annotations

import importlib.util
import signal
from typing import Any

import uvicorn

from controller.drain import CUT_MARGIN_S, Drain


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first starts the app's drain, so calls in progress
    are ended by the gateway (with an error their clients can read) before uvicorn would
    cancel them."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        self._drain.begin()
        await super().shutdown(sockets)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def server_config(app: Any, host: str, port: int, grace_s: float) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        http="httptools" if _installed("httptools") else "h11",
        loop="uvloop" if _installed("uvloop") else "asyncio",
        timeout_graceful_shutdown=grace_s + CUT_MARGIN_S,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run_gateway(app: Any, host: str, port: int) -> None:
    """Serve ``app`` (from :func:`controller.gateway.create_app`) until SIGTERM/SIGINT."""
    drain: Drain = app.state.sluice.drain
    # uvicorn captures SIGTERM for its shutdown and raises it again once it is done; with
    # the default action that would end the process "killed by SIGTERM" after a clean drain.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        DrainingServer(server_config(app, host, port, drain.grace_s), drain).run()
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it captured once it has shut down; as uvicorn.run
        # does, a Ctrl-C that ended a clean shutdown is a normal exit.
        pass
