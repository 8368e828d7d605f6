"""Session and continuation coordinates (architecture.md §2 "Coordinates").

A session id names one program. A continuation id names an exact content prefix:
``c0 = H(namespace, model, cache_salt, canonical(tools))`` and
``c_k = H(c_{k-1}, canonical(message_k))``. Two requests get equal ids exactly when their
canonical content prefix is byte-identical under the same model and salt, so forks of one
conversation share their ancestors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType

SessionId = NewType("SessionId", str)
ContinuationId = NewType("ContinuationId", str)

SESSION_ID_MAX_LEN = 256
CONTINUATION_NAMESPACE = b"sluice.continuation.v1"
_DIGEST_BYTES = 16  # 128-bit BLAKE2b


class InvalidIdentifier(ValueError):
    """An identifier failed validation; ``source`` names the header or field it came from."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


def validate_session_id(value: object, source: str = "session_id") -> SessionId:
    """Accept 1–256 printable ASCII characters (space included), else raise naming ``source``."""
    if not isinstance(value, str):
        raise InvalidIdentifier(source, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidIdentifier(source, "must not be empty")
    if len(value) > SESSION_ID_MAX_LEN:
        raise InvalidIdentifier(source, f"longer than {SESSION_ID_MAX_LEN} characters ({len(value)})")
    for ch in value:
        if not (" " <= ch <= "~"):
            raise InvalidIdentifier(source, f"contains a non-printable character {ch!r}")
    return SessionId(value)


def canonical(value: Any) -> bytes:
    """Serialise JSON-like data so equal content gives equal bytes.

    Keys are sorted, no insignificant whitespace, UTF-8 kept as is. Tuples read as lists.
    Floats that are whole numbers stay distinct from ints on purpose: the engine sees them
    rendered differently.
    """
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _digest(*parts: bytes) -> ContinuationId:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        # Length-prefix each part so concatenations cannot collide.
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return ContinuationId(h.hexdigest())


def root_continuation(model: str, cache_salt: str | None, tools: Any) -> ContinuationId:
    """``c0``: what every request with this model, salt and tool set starts from."""
    return _digest(
        CONTINUATION_NAMESPACE,
        model.encode("utf-8"),
        (cache_salt or "").encode("utf-8"),
        canonical(tools if tools is not None else []),
    )


def next_continuation(parent: ContinuationId, message: Any) -> ContinuationId:
    """``c_k = H(c_{k-1}, canonical(message_k))``."""
    return _digest(parent.encode("ascii"), canonical(message))


@dataclass(frozen=True, slots=True)
class ContinuationChain:
    """The ids of every prefix of one request, root first; ``ids[-1]`` names the request."""

    ids: tuple[ContinuationId, ...]

    @property
    def head(self) -> ContinuationId:
        return self.ids[-1]

    @property
    def root(self) -> ContinuationId:
        return self.ids[0]

    def common_prefix_len(self, other: ContinuationChain) -> int:
        """How many leading ids (root included) the two chains share."""
        n = 0
        for a, b in zip(self.ids, other.ids):
            if a != b:
                break
            n += 1
        return n

    def extends(self, other: ContinuationChain) -> bool:
        """True when ``other`` is a prefix of this chain (a later turn of the same history)."""
        return len(other.ids) <= len(self.ids) and self.ids[: len(other.ids)] == other.ids


def mint_chain(
    model: str, cache_salt: str | None, tools: Any, messages: Sequence[Any]
) -> ContinuationChain:
    """Mint the continuation chain of a request: ``c0`` then one id per message."""
    current = root_continuation(model, cache_salt, tools)
    ids = [current]
    for message in messages:
        current = next_continuation(current, message)
        ids.append(current)
    return ContinuationChain(tuple(ids))
