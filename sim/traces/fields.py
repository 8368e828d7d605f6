"""The rules every trace format shares: the checked fields, the error that names where a
trace is malformed, reading a (gzip-transparent) file line by line, and the order programs
come out in.

- token counts must be integers (an integral float such as ``12.0`` is accepted); an
  input length must be > 0; an output length must be ≥ 0 and a recorded 0 (an aborted or
  empty response) is replayed as 1 token, because every simulated call emits one;
- a call's ``hash_ids`` may include the hash of the prompt's last, partial block (Mooncake
  and kv-cache-tester do); it is not a full block, so only the first
  ``input_length // block_size`` ids become ``CallSpec.hashes``. A list longer than the
  prompt can hold (``input_length ≤ (len(hash_ids) − 1) · block_size``) is an error;
  a shorter one is accepted (the missing blocks are then the call's own).
"""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from sim.programs import ProgramSpec


class TraceError(ValueError):
    """A malformed trace: ``"{path}:{line}: {problem}"``."""

    def __init__(self, path: str | os.PathLike[str], line: int | str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")


class BadField(Exception):
    """A field problem, turned into a TraceError by the caller that knows the location."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.where = where


def get_field(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise BadField(f"missing key {key!r}", key)
    return obj[key]


def require_field(obj: dict[str, Any], key: str, display: str) -> Any:
    if key not in obj:
        raise BadField(f"missing key {display!r}")
    return obj[key]


def as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise BadField(f"{name} must be an integer, got {value!r}", name)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise BadField(f"{name} must be an integer, got {value!r}", name)


def as_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadField(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def input_token_count(value: Any, name: str) -> int:
    n = as_int(value, name)
    if n <= 0:
        raise BadField(f"{name} must be > 0, got {n}", name)
    return n


def output_token_count(value: Any, name: str) -> int:
    n = as_int(value, name)
    if n < 0:
        raise BadField(f"{name} must be ≥ 0, got {n}", name)
    return max(1, n)


def non_negative(value: Any, name: str) -> float:
    x = as_number(value, name)
    if x < 0:
        raise BadField(f"{name} must be ≥ 0, got {value!r}", name)
    return x


def hash_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise BadField(f"{name} must be a list of integers, got {type(value).__name__}", name)
    if value and set(map(type, value)) != {int}:  # bool and float are not hash ids
        i, h = next((i, h) for i, h in enumerate(value) if type(h) is not int)
        raise BadField(f"{name}[{i}] must be an integer, got {h!r}", f"{name}[{i}]")
    return value


def check_cover(hashes: list[int], input_tokens: int, block_size: int, hname: str,
                 iname: str) -> None:
    if hashes and input_tokens <= (len(hashes) - 1) * block_size:
        raise BadField(f"{iname} {input_tokens} is smaller than what {hname} cover: "
                   f"{len(hashes)} blocks of {block_size} need more than "
                   f"{(len(hashes) - 1) * block_size} tokens", iname)


def full_blocks(hashes: list[int], input_tokens: int, block_size: int) -> tuple[int, ...]:
    return tuple(hashes[: input_tokens // block_size])


def file_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of a file read line by line, gzip-transparent."""
    with path.open("rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
        yield from enumerate(f, 1)


_decode_json = msgspec.json.Decoder().decode


def json_line(path: Path, lineno: int, text: bytes) -> dict[str, Any] | None:
    if not text.strip():
        return None
    try:
        obj = _decode_json(text)
    except msgspec.DecodeError as e:
        raise TraceError(path, lineno, f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def ordered_by_arrival(programs: list[ProgramSpec]) -> list[ProgramSpec]:
    """Sort by first arrival (stable) and renumber ``index``."""
    programs.sort(key=lambda p: p.start_at)
    for i, p in enumerate(programs):
        p.index = i
    return programs

