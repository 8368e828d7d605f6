"""Dynamo and Sluice request records (sim/traces/__init__.py says what every loader returns).

``load_dynamo`` / ``load_sluice`` — JSONL (optionally gzip-compressed, recognised by its
magic bytes) request-trace records
``{"schema": "dynamo.request.trace.v1" | "sluice.request.v1", "event_type", "agent_context":
{"session_id", "parent_session_id"?}, "request": {"request_id"?, "input_tokens",
"output_tokens", "request_received_ms", "total_time_ms"?, "replay"?: {"trace_block_size",
"input_length"?, "input_sequence_hashes"}}}``. Only ``event_type == "request_end"`` records
are used (others are skipped without further checks), and of Sluice's own only those of
calls that completed (a record with ``sluice.error`` is left out). Sluice's gateway writes
Dynamo-compatible records, so both loaders are this one parser and accept both schema
names. Records are written when requests *end*, so each session's calls are sorted by
``request_received_ms``. A session keeps its own timing: ``think_s`` is the gap between
the previous request's end (``request_received_ms + total_time_ms``; without
``total_time_ms``, ``event_time_unix_ms`` if present, else the receive time) and this
request's receive time; ``at`` is the receive time relative to the earliest receive time
in the file. ``input_tokens`` falls back to ``replay.input_length``. A record without an
``agent_context.session_id`` is a session of its own. A request without replay hashes gets
synthetic ones that model an append-only context (block ``i`` of session ``s`` hashes to
``bit 59 | s << 24 | i``); the block size is the records' ``trace_block_size`` (one value
per file), or ``default_block_size`` when no record has one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sim.programs import CallSpec, ProgramSpec
from sim.traces.fields import (
    BadField,
    TraceError,
    as_int,
    as_number,
    check_cover,
    file_lines,
    full_blocks,
    hash_list,
    input_token_count,
    json_line,
    non_negative,
    ordered_by_arrival,
    output_token_count,
    require_field,
)

DYNAMO_SCHEMAS = frozenset({"dynamo.request.trace.v1", "sluice.request.v1"})
_SYNTH_BIT = 1 << 59


@dataclass(slots=True)
class _Req:
    received_ms: float
    end_ms: float
    line: int
    input_tokens: int
    output_tokens: int
    hashes: list[int] | None


def _did_not_complete(rec: dict) -> bool:
    """A Sluice record of a call that was refused, failed or cut (``sluice.error``): nothing
    of it ran on an engine, so a replay leaves it out."""
    sluice = rec.get("sluice")
    return isinstance(sluice, dict) and sluice.get("error") is not None


def _load_records(path: str | os.PathLike[str], default_block_size: int
                  ) -> tuple[list[ProgramSpec], int]:
    path = Path(path)
    if default_block_size <= 0:
        raise ValueError(f"default_block_size must be > 0, got {default_block_size}")
    sessions: dict[str, list[_Req]] = {}
    parents: dict[str, str | None] = {}
    block_size: int | None = None
    block_size_line = 0
    for lineno, text in file_lines(path):
        rec = json_line(path, lineno, text)
        if rec is None or rec.get("event_type") != "request_end":
            continue
        if _did_not_complete(rec):
            continue
        schema = rec.get("schema")
        if schema not in DYNAMO_SCHEMAS:
            raise TraceError(path, lineno, f"schema {schema!r} is not one of "
                             f"{sorted(DYNAMO_SCHEMAS)}" if "schema" in rec
                             else "missing key 'schema'")
        try:
            req = require_field(rec, "request", "request")
            if not isinstance(req, dict):
                raise BadField(f"request must be an object, got {type(req).__name__}")
            replay = req.get("replay")
            if replay is not None and not isinstance(replay, dict):
                raise BadField(f"request.replay must be an object, got {type(replay).__name__}")
            if req.get("input_tokens") is not None:
                n_in = input_token_count(req["input_tokens"], "request.input_tokens")
            elif replay is not None and replay.get("input_length") is not None:
                n_in = input_token_count(replay["input_length"], "request.replay.input_length")
            else:
                raise BadField("missing key 'request.input_tokens'")
            n_out = output_token_count(require_field(req, "output_tokens", "request.output_tokens"),
                                   "request.output_tokens")
            received = non_negative(
                require_field(req, "request_received_ms", "request.request_received_ms"),
                "request.request_received_ms")
            if req.get("total_time_ms") is not None:
                end = received + non_negative(req["total_time_ms"], "request.total_time_ms")
            elif rec.get("event_time_unix_ms") is not None:
                end = max(received, as_number(rec["event_time_unix_ms"], "event_time_unix_ms"))
            else:
                end = received
            hashes = None
            if replay is not None and replay.get("input_sequence_hashes") is not None:
                hname = "request.replay.input_sequence_hashes"
                hashes = hash_list(replay["input_sequence_hashes"], hname)
                bname = "request.replay.trace_block_size"
                bs = as_int(require_field(replay, "trace_block_size", bname), bname)
                if bs <= 0:
                    raise BadField(f"{bname} must be > 0, got {bs}")
                if block_size is None:
                    block_size, block_size_line = bs, lineno
                elif bs != block_size:
                    raise BadField(f"{bname} {bs} differs from {block_size} (line {block_size_line})")
                check_cover(hashes, n_in, bs, hname, "the input length")
            ctx = rec.get("agent_context")
            if ctx is not None and not isinstance(ctx, dict):
                raise BadField(f"agent_context must be an object, got {type(ctx).__name__}")
            sid = (ctx or {}).get("session_id")
            parent = (ctx or {}).get("parent_session_id")
            if sid is not None and (not isinstance(sid, str) or not sid):
                raise BadField(f"agent_context.session_id must be a non-empty string, got {sid!r}")
            if parent is not None and (not isinstance(parent, str) or not parent):
                raise BadField("agent_context.parent_session_id must be a non-empty string, "
                           f"got {parent!r}")
        except BadField as e:
            raise TraceError(path, lineno, e.problem) from None
        if sid is None:
            rid = req.get("request_id")
            sid = f"request:{rid}" if isinstance(rid, str) and rid else f"line:{lineno}"
        known = parents.get(sid)
        if parent is not None and known is not None and known != parent:
            raise TraceError(path, lineno, f"session {sid!r} has parent {parent!r} here but "
                             f"{known!r} before")
        if known is None:
            parents[sid] = parent
        sessions.setdefault(sid, []).append(
            _Req(received, end, lineno, n_in, n_out, hashes))

    bs = block_size or default_block_size
    t0 = min((r.received_ms for reqs in sessions.values() for r in reqs), default=0.0)
    programs: list[ProgramSpec] = []
    for number, (sid, reqs) in enumerate(sessions.items()):
        reqs.sort(key=lambda r: (r.received_ms, r.line))
        calls: list[CallSpec] = []
        prev_end: float | None = None
        for r in reqs:
            if r.hashes is not None:
                hashes = full_blocks(r.hashes, r.input_tokens, bs)
            else:
                hashes = tuple(_SYNTH_BIT | (number << 24) | i for i in range(r.input_tokens // bs))
            think = 0.0 if prev_end is None else max(0.0, (r.received_ms - prev_end) / 1000.0)
            calls.append(CallSpec(prompt_tokens=r.input_tokens, output_tokens=r.output_tokens,
                                  think_s=think, at=(r.received_ms - t0) / 1000.0, hashes=hashes))
            prev_end = r.end_ms if prev_end is None else max(prev_end, r.end_ms)
        programs.append(ProgramSpec(session_id=sid, calls=calls, index=number,
                                    parent_session_id=parents.get(sid),
                                    start_at=calls[0].at or 0.0))
    return ordered_by_arrival(programs), bs


def load_dynamo(path: str | os.PathLike[str], *, default_block_size: int = 16
                ) -> tuple[list[ProgramSpec], int]:
    """Load Dynamo ``dynamo.request.trace.v1`` request_end records (JSONL, optionally .gz)."""
    return _load_records(path, default_block_size)


def load_sluice(path: str | os.PathLike[str], *, default_block_size: int = 16
                ) -> tuple[list[ProgramSpec], int]:
    """Load Sluice's own request records (Dynamo-compatible ``request_end`` records)."""
    return _load_records(path, default_block_size)
