"""The gateway's log: JSON lines on one stream, structlog's global config untouched.

:func:`make_logger` is the app's structlog logger (every component logs through it, with
its context as fields); :class:`CallLines` writes the per-call ``call done`` lines, the one
``info`` line per call, the same JSON object at a fraction of structlog's cost.
"""

from __future__ import annotations

import datetime
import sys
from typing import IO, Any

import msgspec
import structlog

LOGGER_NAME = "sluice.gateway"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_encode = msgspec.json.Encoder().encode


def make_logger(level: str = "info", stream: IO[str] | None = None) -> Any:
    """A JSON-lines structlog logger of the app's own (structlog's global config untouched)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(stream if stream is not None else sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_name=LOGGER_NAME,
    )


class CallLines:
    """The per-call ``info`` lines, written straight to the log's stream: the same JSON object
    :func:`make_logger`'s processors make (``logger_name``, the fields, ``event``, ``level``,
    ``timestamp``), encoded by msgspec at a fraction of structlog's cost per line."""

    def __init__(self, level: str, stream: IO[str], relay: str | None = None) -> None:
        self.enabled = _LEVELS[level] <= _LEVELS["info"]
        self._stream = stream
        # the relay process a line comes from (``sluice serve --relays N``), as its logger binds
        self._bound = {} if relay is None else {"relay": relay}

    def info(self, event: str, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = {"logger_name": LOGGER_NAME, **self._bound, **fields, "event": event, "level": "info",
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")}
        self._stream.write(_encode(line).decode() + "\n")
        self._stream.flush()

