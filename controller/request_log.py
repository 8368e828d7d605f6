"""The request log: one ``dynamo.request.trace.v1`` ``request_end`` record per request,
appended as JSONL (opt-in: ``request_log``).

Every call, however it ended, and every request refused before it became one writes its
record (:func:`request_end_record`), with its HTTP status and, when it did not complete, why
(architecture.md §5.1). A record that cannot be written is logged, and the call goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import msgspec

TRACE_SCHEMA = "dynamo.request.trace.v1"


class RequestLog:
    """JSONL ``request_end`` records (Dynamo's request trace schema, v1)."""

    def __init__(self, path: Path | None, log: Any) -> None:
        self.path = path
        self._log = log
        self._file: IO[bytes] | None = None
        self._encode = msgspec.json.Encoder().encode

    def open(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(self._encode(record) + b"\n")
            self._file.flush()
        except OSError as err:
            self._log.error("cannot write request record", path=str(self.path), problem=str(err))


def request_end_record(*, request_id: str, session_id: str | None, parent_session_id: str | None,
                       model: str | None, input_tokens: int, output_tokens: int,
                       cached_tokens: int, received_unix_s: float, total_s: float,
                       ttft_s: float | None, queue_s: float, now_unix_s: float,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "schema": TRACE_SCHEMA,
        "event_type": "request_end",
        "event_time_unix_ms": int(now_unix_s * 1000),
        "event_source": "sluice",
        "agent_context": {"session_id": session_id, "parent_session_id": parent_session_id},
        "request": {
            "request_id": request_id,
            "model": model,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cached_tokens": cached_tokens,
            "request_received_ms": int(received_unix_s * 1000),
            "total_time_ms": round(total_s * 1000, 3),
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
            "queue_time_ms": round(queue_s * 1000, 3),
        },
    }
    if extra:
        record["sluice"] = extra
    return record
