"""Mooncake traces (sim/traces/__init__.py says what every loader returns).

``load_mooncake`` — Mooncake JSONL (kvcache-ai/Mooncake, FAST'25 traces): one request per
line, ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token
blocks, ids assigned per *prefix*: equal ids at a position mean an identical prefix up to
and including that block). Lines must be in non-decreasing timestamp order (the published
traces are). Blank lines are skipped. There are no session ids; sessions are inferred (see
:func:`load_mooncake`).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.programs import CallSpec, ProgramSpec
from sim.traces.fields import (
    BadField,
    TraceError,
    check_cover,
    file_lines,
    full_blocks,
    get_field,
    hash_list,
    input_token_count,
    json_line,
    non_negative,
    ordered_by_arrival,
    output_token_count,
)

MOONCAKE_BLOCK_SIZE = 512


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
    for lineno, text in file_lines(path):
        rec = json_line(path, lineno, text)
        if rec is None:
            continue
        try:
            ts = non_negative(get_field(rec, "timestamp"), "timestamp")
            n_in = input_token_count(get_field(rec, "input_length"), "input_length")
            n_out = output_token_count(get_field(rec, "output_length"), "output_length")
            hashes = hash_list(get_field(rec, "hash_ids"), "hash_ids")
            check_cover(hashes, n_in, bs, "hash_ids", "input_length")
        except BadField as e:
            raise TraceError(path, lineno, e.problem) from None
        if ts < last_ts:
            raise TraceError(path, lineno, f"timestamp {rec['timestamp']} is earlier than the "
                             f"previous request's {last_ts:g}: lines must be in time order")
        last_ts = ts
        records.append((ts / 1000.0, n_in, n_out, hashes))
        for a, b in itertools.pairwise(hashes):
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
                                   hashes=full_blocks(hashes, n_in, bs)))
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
    return ordered_by_arrival(programs), bs
