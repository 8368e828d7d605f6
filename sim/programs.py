"""What a simulated program will do: its calls, their sizes and the gaps between them.

Workload generators (``sim/workloads.py``) and trace loaders (``sim/traces.py``) both
produce :class:`ProgramSpec` objects; the simulation (``sim/simulation.py``) plays them.

Block hashes: a call either names its prompt's full-block hashes explicitly (traces carry
them) or leaves them to the program's *token stream*: a synthetic program's context only
grows, each prompt extending the previous call's prompt and output, so block ``i`` of the
stream has one hash for the whole program. The first ``shared_prefix_tokens`` belong to
the program's prefix family (a system prompt and tool definitions shared across sessions)
and hash the same in every program of that family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_FAMILY_BIT = 1 << 62


@dataclass(frozen=True, slots=True)
class CallSpec:
    prompt_tokens: int
    output_tokens: int
    # seconds between the previous call's response (or the program's start) and this call
    think_s: float = 0.0
    # open-loop traces: absolute arrival time, overriding think_s
    at: float | None = None
    # explicit full-block hashes of the prompt (trace replays); None → the token stream
    hashes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ValueError(f"prompt_tokens must be > 0, got {self.prompt_tokens}")
        if self.output_tokens <= 0:
            raise ValueError(f"output_tokens must be > 0, got {self.output_tokens}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be ≥ 0, got {self.think_s}")


@dataclass(slots=True)
class ProgramSpec:
    session_id: str
    calls: list[CallSpec]
    index: int
    family: int = 0
    shared_prefix_tokens: int = 0
    parent_session_id: str | None = None
    start_at: float = 0.0
    # a barrier group (RL batches): the program may start only when the group opens
    group: int | None = None
    _stream: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.calls:
            raise ValueError(f"program {self.session_id} has no calls")

    def stream_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Hashes of the first ``num_blocks`` blocks of this program's token stream."""
        stream = self._stream
        shared_blocks = self.shared_prefix_tokens // block_size
        family = _FAMILY_BIT | (self.family << 32)
        own = self.index << 32
        for i in range(len(stream), num_blocks):
            stream.append(family | i if i < shared_blocks else own | i)
        return stream if len(stream) == num_blocks else stream[:num_blocks]

    def call_hashes(self, call_index: int, block_size: int) -> list[int]:
        """Full-block hashes of call ``call_index``'s prompt *and* output."""
        call = self.calls[call_index]
        total = call.prompt_tokens + call.output_tokens
        if call.hashes is None:
            return self.stream_hashes(total // block_size, block_size)
        prompt_blocks = list(call.hashes[: call.prompt_tokens // block_size])
        # Output blocks are this call's own: derived from the program and call index.
        base = ((self.index << 20) | call_index) << 20
        extra = total // block_size - len(prompt_blocks)
        return prompt_blocks + [(_FAMILY_BIT >> 1) | base | j for j in range(extra)]
