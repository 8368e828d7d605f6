"""What a simulated program will do: its calls, their sizes and the gaps between them.

Workload generators (``sim/workloads.py``) and trace loaders (``sim/traces/``) both
produce :class:`ProgramSpec` objects; the simulation (``sim/simulation.py``) plays them.

Block hashes: a call either names its prompt's full-block hashes explicitly (traces carry
them) or leaves them to the program's *token stream*: a synthetic program's context only
grows, each prompt extending the previous call's prompt and output, so block ``i`` of the
stream has one hash for the whole program. The first ``shared_prefix_tokens`` belong to
the program's prefix family (a system prompt and tool definitions shared across sessions)
and hash the same in every program of that family.

Sub-agents: a program may be *spawned* by its parent (``spawn_after_calls``: it starts when
the parent has completed that many calls, whatever its ``start_at``) and a call may *wait*
for other sessions (``waits_for``: call ``k`` is sent only once every listed session has
ended, and not before its own ``think_s`` / ``at``). Together they model an agent that
starts sub-agents and resumes once they have all returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_FAMILY_BIT = 1 << 62


def family_block_hash(family: int, block: int) -> int:
    """The hash of block ``block`` of prefix family ``family``: the same in every program."""
    return _FAMILY_BIT | (family << 32) | block


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
    # a sub-agent: start when the parent (``parent_session_id``) has completed this many
    # calls (0: as the parent starts) instead of at ``start_at``; None: at ``start_at``
    spawn_after_calls: int | None = None
    # call index → sessions that must all have ended before that call is sent
    waits_for: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # programs that are samples (or runs) of one task: the policy's group (CallRequest.group_id)
    task_id: str | None = None
    _stream: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.calls:
            raise ValueError(f"program {self.session_id} has no calls")
        if self.spawn_after_calls is not None and (
                self.parent_session_id is None or self.spawn_after_calls < 0):
            raise ValueError(f"program {self.session_id}: spawn_after_calls needs a parent "
                             f"session and must be ≥ 0, got {self.spawn_after_calls}")
        bad = [k for k in self.waits_for if not 0 <= k < len(self.calls)]
        if bad:
            raise ValueError(f"program {self.session_id}: waits_for names call {bad[0]}, "
                             f"but it has {len(self.calls)} calls")

    def stream_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Hashes of the first ``num_blocks`` blocks of this program's token stream."""
        stream = self._stream
        shared_blocks = self.shared_prefix_tokens // block_size
        own = self.index << 32
        for i in range(len(stream), num_blocks):
            stream.append(family_block_hash(self.family, i) if i < shared_blocks else own | i)
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
