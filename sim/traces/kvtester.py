"""kv-cache-tester conversations (sim/traces/__init__.py says what every loader returns).

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
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.programs import CallSpec, ProgramSpec, family_block_hash
from sim.traces.fields import (
    BadField,
    TraceError,
    as_int,
    check_cover,
    get_field,
    hash_list,
    input_token_count,
    non_negative,
    ordered_by_arrival,
    output_token_count,
)

KV_TIMINGS = ("think", "recorded")
_LOCAL_SCOPE_BIT = 1 << 60


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
            offset = non_negative(req["t"], "t") if "t" in req else 0.0
        except BadField as e:
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
            t = non_negative(get_field(req, "t"), "t")
            n_in = input_token_count(get_field(req, "in"), "in")
            n_out = output_token_count(get_field(req, "out"), "out")
            hashes = hash_list(get_field(req, "hash_ids"), "hash_ids")
            recorded_think = (None if req.get("think_time") is None
                              else non_negative(req["think_time"], "think_time"))
            if previous_t is None:
                think = 0.0
            elif recorded_think is not None:
                think = recorded_think
            else:
                think = max(0.0, t - previous_t)
            if req.get("api_time") is not None:
                non_negative(req["api_time"], "api_time")
            check_cover(hashes, n_in, bs, "hash_ids", "in")
        except BadField as e:
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
            n = as_int(conv[key], key)
        except BadField as e:
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
                bs = as_int(get_field(conv, "block_size"), "block_size")
                if bs <= 0:
                    raise BadField(f"block_size must be > 0, got {bs}", "block_size")
            except BadField as e:
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
    return ordered_by_arrival(programs), block_size
