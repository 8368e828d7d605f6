"""Trace loaders (architecture.md §5.6): recorded traffic as programs to replay.

Every loader returns ``(programs, block_size)``: :class:`sim.programs.ProgramSpec` objects
whose calls carry explicit ``hashes`` (the prompt's full-block hashes at ``block_size``
tokens per block) and an absolute arrival time ``at`` (seconds, the trace's own clock;
kv-cache-tester's default think timing leaves it None), and ``think_s`` where the trace
records the client's own delay. Programs are ordered by their first arrival and numbered
``index = 0, 1, …`` in that order; ``start_at`` is the first call's recorded arrival. JSONL formats are read line by line. A malformed input raises
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

``load_kvtester`` — callanjfox/kv-cache-tester conversation JSON (its
``docs/trace_replay_tester.md``, "Trace Format", "Timing Strategies", "Sub-Agent Handling",
"Cross-Conversation Cache Sharing"): a file holds one conversation ``{"id", "block_size",
"hash_id_scope"?, "tool_tokens"?, "system_tokens"?, "requests": [...]}``, or a JSON list
of them; a directory path loads every ``*.json`` file in it (sorted by name). A request is
``{"t", "type", "in", "out", "hash_ids", "think_time"?, "api_time"?, "ttft"?, "stop"?, …}``
with ``t`` its arrival time in seconds from the start of its session. Semantics, as the
tool replays them:

- *Sub-agents.* An entry ``{"type": "subagent", "t"?, "id"? / "agent_id"?, "requests"}``
  is a child session of the enclosing one (sub-agents nest), named ``{parent}/{id}`` or,
  without an id, ``{parent}/sa{n}`` (the n-th sub-agent entry of its parent). Its nested
  ``t`` values count from the entry's ``t`` (0 when absent), which counts from the
  enclosing session's start. The parent starts it when it reaches the entry (after the
  requests before it have completed: ``spawn_after_calls``), consecutive entries together,
  and does not send its next request until all of them have ended (``waits_for``). A
  sub-agent entry with no requests of its own is transparent: its sub-agents take its place.
- *Timing* (``timing=``): ``"think"`` (the tool's default, think-only): a session's first
  request is sent as it starts, each later one ``think_time`` after the previous response
  — without a ``think_time`` (older traces), after the recorded gap ``t`` minus the
  previous entry's ``t``, as the tool falls back to; ``at`` is None. ``"recorded"``: each
  request arrives at its recorded time ``at`` (the conversation clock), never before the
  previous response or its sub-agents' end; ``think_s`` is still filled in. ``api_time``
  and ``ttft`` are checked (≥ 0) and otherwise ignored. ``start_at`` is the session's
  first recorded time in both modes (a spawned sub-agent starts when its parent reaches
  it, whatever its ``start_at``).
- *Warm prefix* (``warm_prefix_fraction=``, the tool's ``--warm-prefix-pct``, default
  0.5): ``int(fraction · max(tool_tokens + system_tokens))`` over all loaded
  conversations is a canonical prefix every session's first prompt starts with, so its
  whole blocks hash the same in every session (family 0, ``shared_prefix_tokens``), in
  every later prompt that keeps the first prompt's leading blocks. Without those fields
  nothing is shared beyond the trace's own hash ids.

``hash_id_scope: "local"`` means the ids are numbered per conversation file, so they are
moved into a per-file namespace (bit 60 | file ordinal << 36 | id; local ids must be
below 2**36); ``"global"`` (the default when absent) keeps them as they are. All files
must use one ``block_size``. A file is one JSON document, parsed whole; errors name the
JSON path with Python (0-based) indices in place of a line, e.g.
``trace.json:requests[3].in: in must be > 0, got -5`` or
``many.json:[1].requests[0].think_time: …`` (invalid JSON names its line).

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

import dataclasses
import gzip
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sim.programs import CallSpec, ProgramSpec, family_block_hash

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


KV_TIMINGS = ("think", "recorded")


@dataclass(slots=True)
class _SubagentEntry:
    """A ``"type": "subagent"`` entry met while walking a session's requests."""

    session_id: str
    requests: Any
    where: str
    base: float  # the clock its nested ``t`` values count from (conversation clock)
    spawn_point: int  # how many of the enclosing session's calls come before it


class _KvConversation:
    """Programs of one conversation (and its sub-agents), built while walking the JSON."""

    def __init__(self, path: Path, prefix: str, block_size: int, namespace: int | None,
                 timing: str) -> None:
        self.path = path
        self.prefix = prefix
        self.block_size = block_size
        self.namespace = namespace
        self.recorded = timing == "recorded"
        self.programs: list[ProgramSpec] = []
        self.ids: set[str] = set()

    def fail(self, where: str, problem: str) -> TraceError:
        return TraceError(self.path, f"{self.prefix}{where}", problem)

    def session(self, session_id: str, parent: str | None, requests: Any, where: str,
                base: float, spawn: tuple[str, int] | None) -> list[str]:
        """Walk one session; return the programs that stand for it: itself, or — when it
        has no requests of its own, only sub-agents — the programs of those sub-agents.

        ``base`` is the conversation-clock time its ``t`` values count from; ``spawn`` is
        (parent program, that program's calls completed) when it starts, None for a
        top-level conversation (it starts at its first call's time).
        """
        if not isinstance(requests, list):
            raise self.fail(where, f"must be a list, got {type(requests).__name__}")
        if session_id in self.ids:
            raise self.fail(where, f"duplicate session id {session_id!r}")
        self.ids.add(session_id)
        calls: list[CallSpec] = []
        recorded_t: list[float] = []  # each call's own t, for the time-order check
        entries: list[_SubagentEntry] = []
        # the previous entry's t (a sub-agent entry without one counts as 0, as in
        # kv-cache-tester): the gap to use when a request has no think_time
        previous_t: float | None = None
        for k, req in enumerate(requests):
            here = f"{where}[{k}]"
            if not isinstance(req, dict):
                raise self.fail(here, f"expected an object, got {type(req).__name__}")
            if req.get("type") == "subagent":
                entry = self._subagent(session_id, req, here, base, len(calls), len(entries))
                entries.append(entry)
                previous_t = entry.base - base
                continue
            t, call = self._call(req, here, base, previous_t)
            if recorded_t and t < recorded_t[-1]:
                raise self.fail(f"{here}.t", f"t {t:g} is earlier than the previous request's "
                                f"{recorded_t[-1]:g}")
            recorded_t.append(t)
            previous_t = t
            calls.append(call)
        if not calls:
            # nothing of its own to send: its sub-agents start where it would have
            return [pid for entry in entries
                    for pid in self.session(entry.session_id, parent, entry.requests,
                                            entry.where, entry.base, spawn)]
        # it began with its first entry: a request, or sub-agents started before any request
        began = min([recorded_t[0], *(e.base - base for e in entries if e.spawn_point == 0)])
        program = ProgramSpec(
            session_id=session_id, calls=calls, index=0, parent_session_id=parent,
            start_at=base + began,
            spawn_after_calls=None if spawn is None else spawn[1])
        self.programs.append(program)
        waits: dict[int, list[str]] = {}
        for entry in entries:
            children = self.session(entry.session_id, session_id, entry.requests, entry.where,
                                    entry.base, (session_id, entry.spawn_point))
            if entry.spawn_point < len(calls):  # the next request waits for them
                waits.setdefault(entry.spawn_point, []).extend(children)
        program.waits_for = {k: tuple(ids) for k, ids in waits.items()}
        return [session_id]

    def _subagent(self, session_id: str, req: dict[str, Any], here: str, base: float,
                  spawn_point: int, ordinal: int) -> _SubagentEntry:
        if "requests" not in req:
            raise self.fail(here, "missing key 'requests' in a subagent entry")
        name = req.get("id", req.get("agent_id"))
        if name is not None and not isinstance(name, str):
            raise self.fail(f"{here}.id", f"must be a string, got {name!r}")
        try:
            offset = _non_negative(req["t"], "t") if "t" in req else 0.0
        except _Bad as e:
            raise self.fail(f"{here}.t", e.problem) from None
        return _SubagentEntry(f"{session_id}/{name or f'sa{ordinal + 1}'}", req["requests"],
                              f"{here}.requests", base + offset, spawn_point)

    def _call(self, req: dict[str, Any], here: str, base: float, previous_t: float | None
              ) -> tuple[float, CallSpec]:
        """One request: its own ``t`` and its call. The first entry of a session is sent as
        the session starts; later ones ``think_time`` after the previous response, or —
        without a ``think_time`` — the recorded gap since the previous entry's ``t``."""
        bs = self.block_size
        try:
            t = _non_negative(_get(req, "t"), "t")
            n_in = _input_tokens(_get(req, "in"), "in")
            n_out = _output_tokens(_get(req, "out"), "out")
            hashes = _hash_list(_get(req, "hash_ids"), "hash_ids")
            recorded_think = (None if req.get("think_time") is None
                              else _non_negative(req["think_time"], "think_time"))
            if previous_t is None:
                think = 0.0
            elif recorded_think is not None:
                think = recorded_think
            else:
                think = max(0.0, t - previous_t)
            if req.get("api_time") is not None:
                _non_negative(req["api_time"], "api_time")
            _check_cover(hashes, n_in, bs, "hash_ids", "in")
        except _Bad as e:
            raise self.fail(f"{here}.{e.where}" if e.where else here, e.problem) from None
        full = hashes[: n_in // bs]
        if self.namespace is not None:
            for i, h in enumerate(full):
                if not 0 <= h < 1 << 36:
                    raise self.fail(f"{here}.hash_ids[{i}]",
                                    f"a local-scope hash id must be in [0, 2**36), got {h}")
            full = [self.namespace | h for h in full]
        at = base + t if self.recorded else None
        return t, CallSpec(prompt_tokens=n_in, output_tokens=n_out, think_s=think, at=at,
                           hashes=tuple(full))


def _share_warm_prefix(programs: list[ProgramSpec], block_size: int, warm_tokens: int) -> None:
    """Give every session the same first ``warm_tokens // block_size`` blocks (family 0),
    as kv-cache-tester's canonical warm prefix does: each session's first prompt begins
    with it, and later prompts keep it for as long as they keep the first prompt's leading
    blocks."""
    warm_blocks = warm_tokens // block_size
    if warm_blocks <= 0:
        return
    for spec in programs:
        first = spec.calls[0].hashes or ()
        shared = min(warm_blocks, len(first))
        if shared == 0:
            continue
        spec.calls = [_with_shared_blocks(call, first, shared) for call in spec.calls]
        spec.family = 0
        spec.shared_prefix_tokens = shared * block_size


def _with_shared_blocks(call: CallSpec, first: tuple[int, ...], shared: int) -> CallSpec:
    hashes = list(call.hashes or ())
    i = 0
    while i < min(shared, len(hashes)) and hashes[i] == first[i]:
        hashes[i] = family_block_hash(0, i)
        i += 1
    return dataclasses.replace(call, hashes=tuple(hashes)) if i else call


def _prefix_tokens(conv: dict[str, Any], f: Path, prefix: str) -> int:
    """``tool_tokens + system_tokens`` of a conversation (each optional, default 0)."""
    total = 0
    for key in ("tool_tokens", "system_tokens"):
        if conv.get(key) is None:
            continue
        try:
            n = _as_int(conv[key], key)
        except _Bad as e:
            raise TraceError(f, f"{prefix}{key}", e.problem) from None
        if n < 0:
            raise TraceError(f, f"{prefix}{key}", f"{key} must be ≥ 0, got {n}")
        total += n
    return total


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


def load_kvtester(path: str | os.PathLike[str], *, timing: str = "think",
                  warm_prefix_fraction: float = 0.5) -> tuple[list[ProgramSpec], int]:
    """Load kv-cache-tester conversation JSON (a file, a JSON list, or a directory).

    ``timing``: ``"think"`` (kv-cache-tester's default, think-only) sends each request
    ``think_s`` after the previous response; ``"recorded"`` at its recorded time (``at``).
    ``warm_prefix_fraction`` (kv-cache-tester's ``--warm-prefix-pct``, default 0.5; 0
    turns it off) of the largest ``tool_tokens + system_tokens`` is a prefix that every
    session shares (see :func:`_share_warm_prefix`).
    """
    if timing not in KV_TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(KV_TIMINGS)}, got {timing!r}")
    if not 0.0 <= warm_prefix_fraction <= 1.0:
        raise ValueError(f"warm_prefix_fraction must be in [0, 1], got {warm_prefix_fraction}")
    path = Path(path)
    programs: list[ProgramSpec] = []
    seen: set[str] = set()
    block_size: int | None = None
    largest_prefix = 0
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
            largest_prefix = max(largest_prefix, _prefix_tokens(conv, f, prefix))
            cid = conv.get("id")
            if cid is None:
                cid = f.stem if i is None else f"{f.stem}[{i}]"
            elif not isinstance(cid, str):
                raise TraceError(f, f"{prefix}id", f"must be a string, got {cid!r}")
            namespace = _LOCAL_SCOPE_BIT | (ordinal << 36) if scope == "local" else None
            ordinal += 1
            builder = _KvConversation(f, prefix, bs, namespace, timing)
            builder.session(cid, None, conv["requests"], "requests", 0.0, None)
            for p in builder.programs:
                if p.session_id in seen:
                    raise TraceError(f, f"{prefix}id", f"session id {p.session_id!r} is used "
                                     "by another conversation loaded before")
                seen.add(p.session_id)
            programs.extend(builder.programs)
    if block_size is None:
        raise TraceError(path, 0, "no conversations")
    # kv-cache-tester truncates the warm prefix to whole tokens: int(fraction · largest)
    _share_warm_prefix(programs, block_size, int(warm_prefix_fraction * largest_prefix))
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
    for lineno, text in _lines(path):
        rec = _json_line(path, lineno, text)
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
