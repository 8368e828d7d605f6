"""experiments/mooncake_concurrency.py's table: the latency bound each row is read against is
max(60 s, 1.25 × least_loaded's p99) of its own concurrency, and the ceiling is not judged."""

from __future__ import annotations

from experiments.mooncake_concurrency import _table


def _row(concurrency: int, policy: str, p99: float) -> dict:
    return {"concurrency": concurrency, "policy": policy, "output_tokens_per_s": 1000.0,
            "hit_rate": 0.2, "reprefill_tokens": 1, "p50_call_s": 1.0, "p99_call_s": p99,
            "pauses": 0}


def _verdicts(table: str) -> dict[tuple[str, str], str]:
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {(row[0], row[1]): row[7] for row in cells}


def test_each_concurrency_is_read_against_its_own_least_loaded_and_a_60_s_floor():
    rows = [
        _row(250, "least_loaded", 30.0), _row(250, "program_aware", 59.9),   # floor 60 s
        _row(250, "mori", 60.1), _row(250, "ceiling", 500.0),
        _row(500, "least_loaded", 100.0), _row(500, "program_aware", 125.0),  # 1.25 × 100
        _row(500, "mori", 125.1),
    ]
    assert _verdicts(_table(rows)) == {
        ("250", "least_loaded"): "yes", ("250", "program_aware"): "yes", ("250", "mori"): "no",
        ("250", "ceiling"): "—",
        ("500", "least_loaded"): "yes", ("500", "program_aware"): "yes", ("500", "mori"): "no",
    }
