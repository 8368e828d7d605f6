"""Trace loaders (architecture.md §5.6): recorded traffic as programs to replay.

Every loader returns ``(programs, block_size)``: :class:`sim.programs.ProgramSpec` objects
whose calls carry explicit ``hashes`` (the prompt's full-block hashes at ``block_size``
tokens per block) and an absolute arrival time ``at`` (seconds, the trace's own clock;
kv-cache-tester's default think timing leaves it None), and ``think_s`` where the trace
records the client's own delay. Programs are ordered by their first arrival and numbered
``index = 0, 1, …`` in that order; ``start_at`` is the first call's recorded arrival. JSONL
formats are read line by line. A malformed input raises :class:`TraceError` naming the file,
the place (a 1-based line for line-oriented formats, a JSON path for JSON documents) and the
problem.

The formats, each in its own module: ``load_mooncake`` (sim/traces/mooncake.py: Mooncake JSONL,
sessions inferred from shared hash-id prefixes), ``load_kvtester`` (sim/traces/kvtester.py:
kv-cache-tester conversation JSON, sub-agents, think or recorded timing, the warm prefix),
``load_dynamo`` / ``load_sluice`` (sim/traces/records.py: Dynamo-compatible request_end
records, which Sluice's gateway writes). The rules they share (token counts, partial blocks,
error locations) are sim/traces/fields.py's.
"""

from __future__ import annotations

import os
from typing import Any

from sim.programs import ProgramSpec
from sim.traces.fields import TraceError
from sim.traces.kvtester import KV_TIMINGS, load_kvtester
from sim.traces.mooncake import MOONCAKE_BLOCK_SIZE, load_mooncake
from sim.traces.records import DYNAMO_SCHEMAS, load_dynamo, load_sluice

__all__ = ["DYNAMO_SCHEMAS", "KV_TIMINGS", "MOONCAKE_BLOCK_SIZE", "TraceError", "load_dynamo",
           "load_kvtester", "load_mooncake", "load_sluice", "load_trace"]

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
