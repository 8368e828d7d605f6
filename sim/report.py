"""Reports of simulation runs: the table printed by ``sluice sim|replay|sweep`` and the JSON
schema ``{"results": [...], "config": {...}}`` of ``--json``."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from sim.simulation import SimResult

COLUMNS = (
    ("policy", "policy", "{}"),
    ("output_tokens_per_s", "out tok/s", "{:.0f}"),
    ("steps_per_min", "steps/min", "{:.1f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("reprefill_tokens", "re-prefill tok", "{:,}"),
    ("p50_call_s", "p50 call s", "{:.2f}"),
    ("p99_call_s", "p99 call s", "{:.2f}"),
    ("pauses", "pauses", "{}"),
    ("resumes", "resumes", "{}"),
)
# Shown only when some row has them: the share of the ceiling row's throughput, the batch
# makespans of RL rollouts, and a burst's start waits by size.
OPTIONAL_COLUMNS = (
    ("of_ceiling", "of ceiling", "{:.2f}"),
    ("p50_makespan_s", "p50 makespan s", "{:.1f}"),
    ("p99_makespan_s", "p99 makespan s", "{:.1f}"),
    ("p99_start_wait_s", "p99 start s", "{:.1f}"),
    ("p99_start_wait_smallest_tenth_s", "p99 start smallest 10% s", "{:.1f}"),
    ("p99_start_wait_largest_tenth_s", "p99 start largest 10% s", "{:.1f}"),
)
CEILING_ROW = "ceiling"


def with_ceiling_ratio(rows: Sequence[dict[str, Any]], group: str | None = None) -> list[dict[str, Any]]:
    """Rows with ``of_ceiling`` (output tokens/s over the ceiling row's) added to each row
    that has a ceiling row beside it — the one with ``policy == "ceiling"`` and, with
    ``group``, the same value of that key (the sweep's concurrency)."""
    ceilings = {row.get(group) if group else None: row["output_tokens_per_s"]
                for row in rows if row["policy"] == CEILING_ROW}
    out = []
    for row in rows:
        top = ceilings.get(row.get(group) if group else None)
        if top:
            row = {**row, "of_ceiling": round(row["output_tokens_per_s"] / top, 4)}
        out.append(row)
    return out


def _columns(rows: Sequence[dict[str, Any]], extra: Sequence[str]) -> list[tuple[str, str, str]]:
    optional = [column for column in OPTIONAL_COLUMNS if any(column[0] in row for row in rows)]
    return [(key, key, "{}") for key in extra] + list(COLUMNS) + optional


def _cell(fmt: str, value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def format_table(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> str:
    """A fixed-width text table of report rows (``SimResult.summary()`` dicts)."""
    columns = _columns(rows, extra)
    cells = [[title for _, title, _ in columns]]
    for row in rows:
        cells.append([_cell(fmt, row.get(key, math.nan)) for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(
            text.ljust(width) if i == 0 and not extra else text.rjust(width)
            for i, (text, width) in enumerate(zip(line, widths))
        ))
        if n == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_markdown(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> str:
    columns = _columns(rows, extra)
    out = ["| " + " | ".join(title for _, title, _ in columns) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    for row in rows:
        out.append("| " + " | ".join(_cell(fmt, row.get(key, math.nan)) for key, _, fmt in columns) + " |")
    return "\n".join(out)


def write_json(path: Path, results: Sequence[SimResult], config: dict[str, Any],
               extra_rows: Sequence[dict[str, Any]] | None = None) -> None:
    rows = list(extra_rows) if extra_rows is not None else with_ceiling_ratio([r.summary() for r in results])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": rows, "config": config}, indent=2) + "\n")


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal), fed
    the fraction of the run done (:meth:`Simulation._fraction_done`)."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self._tty = self.stream.isatty()
        self._last_tenth = -1

    def __call__(self, fraction: float) -> None:
        fraction = min(1.0, max(0.0, fraction))
        if self._tty:
            filled = int(fraction * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {fraction:5.1%}")
            self.stream.flush()
        else:
            tenth = int(fraction * 10)
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(f"{self.label}: {fraction:.0%}\n")
                self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self(1.0)
            self.stream.write("\n")
            self.stream.flush()
