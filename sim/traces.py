"""Trace loaders (DESIGN.md §5 "sim/", "Traces"): recorded traffic as programs to replay.

Every loader returns ``(programs, block_size)``: :class:`sim.programs.ProgramSpec` objects
whose calls carry explicit ``hashes`` (the prompt's full-block hashes at ``block_size``
tokens per block) and an absolute arrival time ``at`` (seconds, the trace's own clock), and
``think_s`` where the trace records the client's own delay. Programs are ordered by their
first arrival and numbered ``index = 0, 1, …`` in that order; ``start_at`` is the first
call's ``at``. JSONL formats are read line by line. A malformed input raises
:class:`TraceError` naming the file, the place (a 1-based line for line-oriented formats, a
JSON path for JSON documents) and the problem.

Shared rules:

- token counts must be integers (an integral float such as ``12.0`` is accepted); an
  input length must be > 0; an output length must be ≥ 0 and a recorded 0 (an aborted or
  empty response) is replayed as 1 token, because every simulated call emits one;
- a call's ``hash_ids`` may include the hash of the prompt's last, partial block (Mooncake
  and kv-cache-tester do); it is not a full block, so only the first
  ``input_length // block_size`` ids become ``CallSpec.hashes``. A list longer than the
  prompt can hold (``input_length ≤ (len(hash_ids) − 1) · block_size``) is an error;
  a shorter one is accepted (the missing blocks are then the call's own).

Formats
-------
``load_mooncake`` — Mooncake JSONL (kvcache-ai/Mooncake, FAST'25 traces): one request per
line, ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token
blocks, ids assigned per *prefix*: equal ids at a position mean an identical prefix up to
and including that block). Lines must be in non-decreasing timestamp order (the published
traces are). Blank lines are skipped. There are no session ids; sessions are inferred (see
:func:`load_mooncake`).

``load_kvtester`` — callanjfox/kv-cache-tester conversation JSON: a file holds one
conversation ``{"id", "block_size", "hash_id_scope"?, "requests": [...]}``, or a JSON list
of them; a directory path loads every ``*.json`` file in it (sorted by name). A request is
``{"t", "type", "in", "out", "hash_ids", "think_time"?, "api_time"?, "ttft"?, "stop"?, …}``
with ``t`` the arrival time in seconds on the conversation's clock and ``think_time`` the
client's delay before it (when absent: ``t`` minus the previous request's ``t`` and
``api_time`` if that one has an ``api_time``, else 0; ``api_time`` and ``ttft`` are
otherwise ignored); an entry with ``"type": "subagent"`` holds its own nested
``requests`` (and optionally its own ``id`` / ``agent_id`` and ``t``): a child session whose
parent is the enclosing conversation (sub-agents nest), named ``{parent}/{id}`` or, without
an id, ``{parent}/sa{n}`` (the n-th sub-agent entry of its parent). Nested ``t`` values are on the same
conversation clock. ``hash_id_scope: "local"`` means the ids are numbered per conversation
file, so they are moved into a per-file namespace (bit 60 | file ordinal << 36 | id);
(local ids must be below 2**36); ``"global"`` (the default when absent) keeps them as
they are. All files must use one ``block_size``. A file is one JSON document, parsed whole;
errors name the JSON path with Python (0-based) indices in place of a line, e.g.
``trace.json:requests[3].in: in must be > 0, got -5`` or
``many.json:[1].requests[0].think_time: …`` (invalid JSON names its line).

``load_dynamo`` / ``load_sluice`` — JSONL (optionally gzip-compressed, recognised by its
magic bytes) request-trace records
``{"schema": "dynamo.request.trace.v1" | "sluice.request.v1", "event_type", "agent_context":
{"session_id", "parent_session_id"?}, "request": {"request_id"?, "input_tokens",
"output_tokens", "request_received_ms", "total_time_ms"?, "replay"?: {"trace_block_size",
"input_length"?, "input_sequence_hashes"}}}``. Only ``event_type == "request_end"`` records
are used (others are skipped without further checks). Sluice's gateway writes
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

import gzip
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sim.programs import CallSpec, ProgramSpec

MOONCAKE_BLOCK_SIZE = 512
DYNAMO_SCHEMAS = frozenset({"dynamo.request.trace.v1", "sluice.request.v1"})
_LOCAL_SCOPE_BIT = 1 << 60
_SYNTH_BIT = 1 << 59


class TraceError(ValueError):
    """A malformed trace: ``"{path}:{line}: {problem}"``."""

    def __init__(self, path: str | os.PathLike[str], line: int | str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")


# -- field checks --------------------------------------------------------------------------


class _Bad(Exception):
    """A field problem, turned into a TraceError by the caller that knows the location."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.where = where


def _get(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise _Bad(f"missing key {key!r}", key)
    return obj[key]


def _need(obj: dict[str, Any], key: str, display: str) -> Any:
    if key not in obj:
        raise _Bad(f"missing key {display!r}")
    return obj[key]


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise _Bad(f"{name} must be an integer, got {value!r}", name)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _Bad(f"{name} must be an integer, got {value!r}", name)


def _as_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _input_tokens(value: Any, name: str) -> int:
    n = _as_int(value, name)
    if n <= 0:
        raise _Bad(f"{name} must be > 0, got {n}", name)
    return n


def _output_tokens(value: Any, name: str) -> int:
    n = _as_int(value, name)
    if n < 0:
        raise _Bad(f"{name} must be ≥ 0, got {n}", name)
    return max(1, n)


def _non_negative(value: Any, name: str) -> float:
    x = _as_number(value, name)
    if x < 0:
        raise _Bad(f"{name} must be ≥ 0, got {value!r}", name)
    return x


def _hash_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise _Bad(f"{name} must be a list of integers, got {type(value).__name__}", name)
    if value and set(map(type, value)) != {int}:  # bool and float are not hash ids
        i, h = next((i, h) for i, h in enumerate(value) if type(h) is not int)
        raise _Bad(f"{name}[{i}] must be an integer, got {h!r}", f"{name}[{i}]")
    return value


def _check_cover(hashes: list[int], input_tokens: int, block_size: int, hname: str,
                 iname: str) -> None:
    if hashes and input_tokens <= (len(hashes) - 1) * block_size:
        raise _Bad(f"{iname} {input_tokens} is smaller than what {hname} cover: "
                   f"{len(hashes)} blocks of {block_size} need more than "
                   f"{(len(hashes) - 1) * block_size} tokens", iname)


def _full_blocks(hashes: list[int], input_tokens: int, block_size: int) -> tuple[int, ...]:
    return tuple(hashes[: input_tokens // block_size])


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of a file read line by line, gzip-transparent."""
    with path.open("rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
        yield from enumerate(f, 1)


_decode_json = msgspec.json.Decoder().decode


def _json_line(path: Path, lineno: int, text: bytes) -> dict[str, Any] | None:
    if not text.strip():
        return None
    try:
        obj = _decode_json(text)
    except msgspec.DecodeError as e:
        raise TraceError(path, lineno, f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _order(programs: list[ProgramSpec]) -> list[ProgramSpec]:
    """Sort by first arrival (stable) and renumber ``index``."""
    programs.sort(key=lambda p: p.start_at)
    for i, p in enumerate(programs):
        p.index = i
    return programs


# -- Mooncake ------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Session:
    number: int
    calls: list[CallSpec] = field(default_factory=list)
    last_ts: float = 0.0
    last_hashes: list[int] = field(default_factory=list)  # the last request's hash ids
    last_full: int = 0  # full blocks of the last request's prompt


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    common_fanout: int = 4,
    min_overlap: float = 0.5,
    max_gap_s: float | None = None,
) -> tuple[list[ProgramSpec], int]:
    """Load a Mooncake JSONL trace, inferring sessions from shared hash-id prefixes.

    Mooncake ids name prefixes, so the trace's requests form a prefix tree of blocks. The
    rule:

    1. *Common* blocks (first pass, over the whole trace): a block followed, across all
       requests, by at least ``common_fanout`` different next blocks is a branching point
       shared by many conversations — a system prompt, a template, a shared document. A
       conversation's own blocks have one successor, two at a turn boundary (the partial
       block of one turn and its filled version in the next), a few more if the history
       was edited. Sharing only common blocks says nothing about which conversation a
       request belongs to.
    2. Candidates (second pass, requests in arrival order): a request with ids ``H`` is
       compared with the *last* request of each live session that has contained one of
       its non-common blocks; ``shared`` is the length of the common prefix of ``H`` and
       that last request's ids, and must include at least one non-common block.
    3. It joins the candidate whose last prompt it *extends* — ``shared`` covers every
       full block of that prompt (a chat turn resends the history and appends to it) — with
       the longest ``shared``, then the most recent last request. Failing that, the
       candidate with the longest ``shared`` that keeps *more than* ``min_overlap`` of that
       prompt's own full blocks, i.e. ``shared − c > min_overlap · (full − c)`` with ``c``
       the request's leading common blocks (the client rewrote or truncated the tail of the
       history; ``min_overlap = 1`` allows extensions only). Otherwise it starts a new
       session. A session's requests are therefore sequential, each building on the last.
    4. A session is live while its last request is at most ``max_gap_s`` old (None: always).

    A conversation whose first prompt is under two blocks plus a common prefix cannot be
    told from a new one that shares only that prefix (a partial block's id changes when the
    block fills up): such follow-ups start new sessions.

    Calls get ``at = timestamp / 1000`` and ``think_s = 0`` (the trace has no response
    times). Sessions are named ``mooncake-{n}`` in order of their first request.
    """
    path = Path(path)
    if common_fanout < 2:
        raise ValueError(f"common_fanout must be ≥ 2, got {common_fanout}")
    if not 0.0 < min_overlap <= 1.0:
        raise ValueError(f"min_overlap must be in (0, 1], got {min_overlap}")
    bs = MOONCAKE_BLOCK_SIZE

    # pass 1: parse and validate line by line; count each block's distinct successors
    records: list[tuple[float, int, int, list[int]]] = []
    successor: dict[int, int] = {}  # block → its first successor seen
    successors: dict[int, set[int]] = {}  # block → its successors, once there are two
    last_ts = -math.inf
    for lineno, text in _lines(path):
        rec = _json_line(path, lineno, text)
        if rec is None:
            continue
        try:
            ts = _non_negative(_get(rec, "timestamp"), "timestamp")
            n_in = _input_tokens(_get(rec, "input_length"), "input_length")
            n_out = _output_tokens(_get(rec, "output_length"), "output_length")
            hashes = _hash_list(_get(rec, "hash_ids"), "hash_ids")
            _check_cover(hashes, n_in, bs, "hash_ids", "input_length")
        except _Bad as e:
            raise TraceError(path, lineno, e.problem) from None
        if ts < last_ts:
            raise TraceError(path, lineno, f"timestamp {rec['timestamp']} is earlier than the "
                             f"previous request's {last_ts:g}: lines must be in time order")
        last_ts = ts
        records.append((ts / 1000.0, n_in, n_out, hashes))
        for a, b in zip(hashes, hashes[1:]):
            first = successor.setdefault(a, b)
            if first != b:
                more = successors.get(a)
                if more is None:
                    successors[a] = {first, b}
                else:
                    more.add(b)
    common = {a for a, more in successors.items() if len(more) >= common_fanout}
    del successor, successors

    # pass 2: assign requests to sessions in arrival order
    sessions: list[_Session] = []
    owners: dict[int, Any] = {}  # non-common block → its sessions: an int while one, else a set
    for at, n_in, n_out, hashes in records:
        c = 0
        while c < len(hashes) and hashes[c] in common:
            c += 1
        candidates: set[int] = set()
        for o in map(owners.get, hashes[c:]):
            if o is None:
                continue
            if type(o) is int:
                candidates.add(o)
            else:
                candidates.update(o)
        best: tuple[int, int, float, int] | None = None
        for s in candidates:
            sess = sessions[s]
            if max_gap_s is not None and at - sess.last_ts > max_gap_s:
                continue
            n = _common_prefix(hashes, sess.last_hashes)
            if n <= c:
                continue
            extends = n >= sess.last_full
            if not extends and n - c <= min_overlap * (sess.last_full - c):
                continue
            key = (int(extends), n, sess.last_ts, s)
            if best is None or key > best:
                best = key
        if best is None:
            sess = _Session(len(sessions))
            sessions.append(sess)
            known = 0
        else:
            sess = sessions[best[3]]
            known = best[1]  # blocks of the session's last request: already owned
        s = sess.number
        sess.calls.append(CallSpec(prompt_tokens=n_in, output_tokens=n_out, at=at,
                                   hashes=_full_blocks(hashes, n_in, bs)))
        sess.last_ts = at
        sess.last_hashes = hashes
        sess.last_full = n_in // bs
        tail = hashes[known:]
        for h, o in zip(tail, map(owners.get, tail)):
            if o is None:
                if h not in common:
                    owners[h] = s
            elif o == s:
                continue
            elif type(o) is int:
                owners[h] = {o, s}
            else:
                o.add(s)

    programs = [
        ProgramSpec(session_id=f"mooncake-{sess.number}", calls=sess.calls, index=sess.number,
                    start_at=sess.calls[0].at or 0.0)
        for sess in sessions
    ]
    return _order(programs), bs


# -- kv-cache-tester -----------------------------------------------------------------------


class _KvConversation:
    """Programs of one conversation (and its sub-agents), built while walking the JSON."""

    def __init__(self, path: Path, prefix: str, block_size: int, namespace: int | None) -> None:
        self.path = path
        self.prefix = prefix
        self.block_size = block_size
        self.namespace = namespace
        self.programs: list[ProgramSpec] = []
        self.ids: set[str] = set()

    def fail(self, where: str, problem: str) -> TraceError:
        return TraceError(self.path, f"{self.prefix}{where}", problem)

    def session(self, session_id: str, parent: str | None, requests: Any, where: str,
                start: float | None) -> None:
        if not isinstance(requests, list):
            raise self.fail(where, f"must be a list, got {type(requests).__name__}")
        if session_id in self.ids:
            raise self.fail(where, f"duplicate session id {session_id!r}")
        self.ids.add(session_id)
        calls: list[CallSpec] = []
        children: list[tuple[str, Any, str, float | None]] = []
        bs = self.block_size
        prev_api: float | None = None
        for k, req in enumerate(requests):
            here = f"{where}[{k}]"
            if not isinstance(req, dict):
                raise self.fail(here, f"expected an object, got {type(req).__name__}")
            if req.get("type") == "subagent":
                sub = f"{here}.requests"
                if "requests" not in req:
                    raise self.fail(here, "missing key 'requests' in a subagent entry")
                name = req.get("id", req.get("agent_id"))
                if name is not None and not isinstance(name, str):
                    raise self.fail(f"{here}.id", f"must be a string, got {name!r}")
                child = f"{session_id}/{name or f'sa{len(children) + 1}'}"
                try:
                    t0 = _non_negative(req["t"], "t") if "t" in req else None
                except _Bad as e:
                    raise self.fail(f"{here}.t", e.problem) from None
                children.append((child, req["requests"], sub, t0))
                continue
            try:
                t = _non_negative(_get(req, "t"), "t")
                n_in = _input_tokens(_get(req, "in"), "in")
                n_out = _output_tokens(_get(req, "out"), "out")
                hashes = _hash_list(_get(req, "hash_ids"), "hash_ids")
                if req.get("think_time") is not None:
                    think = _non_negative(req["think_time"], "think_time")
                elif calls and prev_api is not None:
                    think = max(0.0, t - (calls[-1].at or 0.0) - prev_api)
                else:
                    think = 0.0
                api = req.get("api_time")
                prev_api = None if api is None else _non_negative(api, "api_time")
                _check_cover(hashes, n_in, bs, "hash_ids", "in")
            except _Bad as e:
                raise self.fail(f"{here}.{e.where}" if e.where else here, e.problem) from None
            if calls and t < (calls[-1].at or 0.0):
                raise self.fail(f"{here}.t", f"t {t:g} is earlier than the previous request's "
                                f"{calls[-1].at:g}")
            full = hashes[: n_in // bs]
            if self.namespace is not None:
                for i, h in enumerate(full):
                    if not 0 <= h < 1 << 36:
                        raise self.fail(f"{here}.hash_ids[{i}]",
                                        f"a local-scope hash id must be in [0, 2**36), got {h}")
                full = [self.namespace | h for h in full]
            calls.append(CallSpec(prompt_tokens=n_in, output_tokens=n_out, think_s=think,
                                  at=t, hashes=tuple(full)))
        own = session_id if calls else parent
        if calls:
            begin = calls[0].at or 0.0
            self.programs.append(ProgramSpec(
                session_id=session_id, calls=calls, index=0, parent_session_id=parent,
                start_at=begin if start is None else min(start, begin)))
        for child, reqs, sub, t0 in children:
            self.session(child, own, reqs, sub, t0)


def _kv_documents(path: Path) -> Iterator[tuple[Path, Any]]:
    files = sorted(p for p in path.glob("*.json") if p.is_file()) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise TraceError(path, 0, "no *.json files in this directory")
    for f in files:
        try:
            with f.open("rb") as fh:
                doc = json.load(fh)
        except json.JSONDecodeError as e:
            raise TraceError(f, e.lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise TraceError(f, 0, f"not UTF-8 text: {e.reason}") from None
        yield f, doc


def load_kvtester(path: str | os.PathLike[str]) -> tuple[list[ProgramSpec], int]:
    """Load kv-cache-tester conversation JSON (a file, a JSON list, or a directory)."""
    path = Path(path)
    programs: list[ProgramSpec] = []
    seen: set[str] = set()
    block_size: int | None = None
    ordinal = 0
    for f, doc in _kv_documents(path):
        convs = list(enumerate(doc)) if isinstance(doc, list) else [(None, doc)]
        for i, conv in convs:
            prefix = "" if i is None else f"[{i}]."
            where = "<root>" if i is None else f"[{i}]"
            if not isinstance(conv, dict):
                raise TraceError(f, where, "expected a conversation object, got "
                                 f"{type(conv).__name__}")
            try:
                bs = _as_int(_get(conv, "block_size"), "block_size")
                if bs <= 0:
                    raise _Bad(f"block_size must be > 0, got {bs}", "block_size")
            except _Bad as e:
                raise TraceError(f, f"{prefix}block_size", e.problem) from None
            if block_size is None:
                block_size = bs
            elif bs != block_size:
                raise TraceError(f, f"{prefix}block_size", f"block_size {bs} differs from "
                                 f"{block_size} in the files loaded before")
            scope = conv.get("hash_id_scope", "global")
            if scope not in ("global", "local"):
                raise TraceError(f, f"{prefix}hash_id_scope",
                                 f"must be 'global' or 'local', got {scope!r}")
            if "requests" not in conv:
                raise TraceError(f, where, "missing key 'requests'")
            cid = conv.get("id")
            if cid is None:
                cid = f.stem if i is None else f"{f.stem}[{i}]"
            elif not isinstance(cid, str):
                raise TraceError(f, f"{prefix}id", f"must be a string, got {cid!r}")
            namespace = _LOCAL_SCOPE_BIT | (ordinal << 36) if scope == "local" else None
            ordinal += 1
            builder = _KvConversation(f, prefix, bs, namespace)
            builder.session(cid, None, conv["requests"], "requests", None)
            for p in builder.programs:
                if p.session_id in seen:
                    raise TraceError(f, f"{prefix}id", f"session id {p.session_id!r} is used "
                                     "by another conversation loaded before")
                seen.add(p.session_id)
            programs.extend(builder.programs)
    if block_size is None:
        raise TraceError(path, 0, "no conversations")
    return _order(programs), block_size


# -- Dynamo / Sluice request records -------------------------------------------------------


@dataclass(slots=True)
class _Req:
    received_ms: float
    end_ms: float
    line: int
    input_tokens: int
    output_tokens: int
    hashes: list[int] | None


def _load_records(path: str | os.PathLike[str], default_block_size: int
                  ) -> tuple[list[ProgramSpec], int]:
    path = Path(path)
    if default_block_size <= 0:
        raise ValueError(f"default_block_size must be > 0, got {default_block_size}")
    sessions: dict[str, list[_Req]] = {}
    parents: dict[str, str | None] = {}
    block_size: int | None = None
    block_size_line = 0
    for lineno, text in _lines(path):
        rec = _json_line(path, lineno, text)
        if rec is None or rec.get("event_type") != "request_end":
            continue
        schema = rec.get("schema")
        if schema not in DYNAMO_SCHEMAS:
            raise TraceError(path, lineno, f"schema {schema!r} is not one of "
                             f"{sorted(DYNAMO_SCHEMAS)}" if "schema" in rec
                             else "missing key 'schema'")
        try:
            req = _need(rec, "request", "request")
            if not isinstance(req, dict):
                raise _Bad(f"request must be an object, got {type(req).__name__}")
            replay = req.get("replay")
            if replay is not None and not isinstance(replay, dict):
                raise _Bad(f"request.replay must be an object, got {type(replay).__name__}")
            if req.get("input_tokens") is not None:
                n_in = _input_tokens(req["input_tokens"], "request.input_tokens")
            elif replay is not None and replay.get("input_length") is not None:
                n_in = _input_tokens(replay["input_length"], "request.replay.input_length")
            else:
                raise _Bad("missing key 'request.input_tokens'")
            n_out = _output_tokens(_need(req, "output_tokens", "request.output_tokens"),
                                   "request.output_tokens")
            received = _non_negative(
                _need(req, "request_received_ms", "request.request_received_ms"),
                "request.request_received_ms")
            if req.get("total_time_ms") is not None:
                end = received + _non_negative(req["total_time_ms"], "request.total_time_ms")
            elif rec.get("event_time_unix_ms") is not None:
                end = max(received, _as_number(rec["event_time_unix_ms"], "event_time_unix_ms"))
            else:
                end = received
            hashes = None
            if replay is not None and replay.get("input_sequence_hashes") is not None:
                hname = "request.replay.input_sequence_hashes"
                hashes = _hash_list(replay["input_sequence_hashes"], hname)
                bname = "request.replay.trace_block_size"
                bs = _as_int(_need(replay, "trace_block_size", bname), bname)
                if bs <= 0:
                    raise _Bad(f"{bname} must be > 0, got {bs}")
                if block_size is None:
                    block_size, block_size_line = bs, lineno
                elif bs != block_size:
                    raise _Bad(f"{bname} {bs} differs from {block_size} (line {block_size_line})")
                _check_cover(hashes, n_in, bs, hname, "the input length")
            ctx = rec.get("agent_context")
            if ctx is not None and not isinstance(ctx, dict):
                raise _Bad(f"agent_context must be an object, got {type(ctx).__name__}")
            sid = (ctx or {}).get("session_id")
            parent = (ctx or {}).get("parent_session_id")
            if sid is not None and (not isinstance(sid, str) or not sid):
                raise _Bad(f"agent_context.session_id must be a non-empty string, got {sid!r}")
            if parent is not None and (not isinstance(parent, str) or not parent):
                raise _Bad("agent_context.parent_session_id must be a non-empty string, "
                           f"got {parent!r}")
        except _Bad as e:
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
                hashes = _full_blocks(r.hashes, r.input_tokens, bs)
            else:
                hashes = tuple(_SYNTH_BIT | (number << 24) | i for i in range(r.input_tokens // bs))
            think = 0.0 if prev_end is None else max(0.0, (r.received_ms - prev_end) / 1000.0)
            calls.append(CallSpec(prompt_tokens=r.input_tokens, output_tokens=r.output_tokens,
                                  think_s=think, at=(r.received_ms - t0) / 1000.0, hashes=hashes))
            prev_end = r.end_ms if prev_end is None else max(prev_end, r.end_ms)
        programs.append(ProgramSpec(session_id=sid, calls=calls, index=number,
                                    parent_session_id=parents.get(sid),
                                    start_at=calls[0].at or 0.0))
    return _order(programs), bs


def load_dynamo(path: str | os.PathLike[str], *, default_block_size: int = 16
                ) -> tuple[list[ProgramSpec], int]:
    """Load Dynamo ``dynamo.request.trace.v1`` request_end records (JSONL, optionally .gz)."""
    return _load_records(path, default_block_size)


def load_sluice(path: str | os.PathLike[str], *, default_block_size: int = 16
                ) -> tuple[list[ProgramSpec], int]:
    """Load Sluice's own request records (Dynamo-compatible ``request_end`` records)."""
    return _load_records(path, default_block_size)


_LOADERS = {
    "mooncake": load_mooncake,
    "kvtester": load_kvtester,
    "dynamo": load_dynamo,
    "sluice": load_sluice,
}


def load_trace(fmt: str, path: str | os.PathLike[str], **options: Any
               ) -> tuple[list[ProgramSpec], int]:
    """Load a trace of format ``"mooncake" | "kvtester" | "dynamo" | "sluice"``."""
    try:
        loader = _LOADERS[fmt]
    except KeyError:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of "
                         f"{', '.join(sorted(_LOADERS))}") from None
    return loader(path, **options)
