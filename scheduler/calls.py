"""What a shell tells the core about one LLM call: the request as it arrives, its usage at the end."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.coordinates import ContinuationChain, SessionId


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One LLM call of a program, as the shell observed it on arrival.

    ``prompt_tokens`` is the shell's best count of the prompt (exact in the simulator, an
    estimate in the gateway). ``chain_tokens[i]`` is the cumulative prompt length through
    ``chain.ids[i]`` when the shell can tell it; the ledger uses it to count prefixes that
    programs share when no KV events flow. ``block_hashes`` are the engine's prefix block
    hashes when the shell knows them (the simulator does; the gateway does not).
    """

    request_id: str
    session_id: SessionId
    prompt_tokens: int
    max_output_tokens: int | None = None
    parent_session_id: SessionId | None = None
    chain: ContinuationChain | None = None
    chain_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int | bytes, ...] | None = None
    final: bool = False

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be ≥ 0, got {self.prompt_tokens}")
        if self.chain_tokens is not None and (
            self.chain is None or len(self.chain_tokens) != len(self.chain.ids)
        ):
            raise ValueError("chain_tokens needs a chain of the same length")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts an engine reported for one finished call."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """What the program holds in KV after this call: the prompt plus what was generated."""
        return self.prompt_tokens + self.completion_tokens
