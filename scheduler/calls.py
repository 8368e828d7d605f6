"""What a shell tells the core about one LLM call: the request as it arrives, its usage at the end."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.coordinates import ContinuationChain, SessionId


@dataclass(frozen=True, slots=True)
class CallHints:
    """What a client said about one call beyond its prompt (architecture.md §5.2 "Client
    hints": vllm-router's ``agentic_context``, Dynamo's ``agent_hints``). Each is optional;
    a policy that does not read one ignores it.

    - ``priority``: higher is more important (both sources' convention); among the calls
      that wait for room, higher goes first.
    - ``deadline_s``: the longest the call may be held before it goes ahead anyway
      (shortens the policy's ``max_wait_s``, never lengthens it).
    - ``expected_output_tokens``: what the call will generate, in place of the policy's
      ``growth_reserve_tokens``, in its program's demand while it runs.
    - ``retention_ttl_s``: how long the program's KV is worth keeping after this call (the
      ``Retain`` TTL while it is in its tool call), in place of ``retention.ttl_s``.
    """

    priority: int = 0
    deadline_s: float | None = None
    expected_output_tokens: int | None = None
    retention_ttl_s: float | None = None

    def growth_reserve(self, default: int) -> int:
        """Tokens the call may still add while it runs: the client's expectation, else
        ``default``."""
        return default if self.expected_output_tokens is None else self.expected_output_tokens

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not self.deadline_s >= 0:
            raise ValueError(f"deadline_s must be ≥ 0, got {self.deadline_s}")
        if self.expected_output_tokens is not None and self.expected_output_tokens < 0:
            raise ValueError(f"expected_output_tokens must be ≥ 0, got {self.expected_output_tokens}")
        if self.retention_ttl_s is not None and not self.retention_ttl_s >= 0:
            raise ValueError(f"retention_ttl_s must be ≥ 0, got {self.retention_ttl_s}")


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One LLM call of a program, as the shell observed it on arrival.

    ``prompt_tokens`` is the shell's best count of the prompt (exact in the simulator, an
    estimate in the gateway). ``chain_tokens[i]`` is the cumulative prompt length through
    ``chain.ids[i]`` when the shell can tell it; the ledger uses it to count prefixes that
    programs share when no KV events flow. ``block_hashes`` are the engine's prefix block
    hashes when the shell knows them (the simulator does; the gateway does not).
    ``group_id`` names programs that belong together without being one (a GRPO group's
    samples, the runs of one task, the agents of one tree under its root), and ``hints``
    carry what the client said about the call (:class:`CallHints`). ``prompt_estimated``
    says ``prompt_tokens`` is an estimate, which the policy refines when the call continues
    its program's last answered call (:meth:`scheduler.programs.Program.refine_prompt`).
    """

    request_id: str
    session_id: SessionId
    prompt_tokens: int
    parent_session_id: SessionId | None = None
    chain: ContinuationChain | None = None
    chain_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int | bytes, ...] | None = None
    final: bool = False
    group_id: SessionId | None = None
    hints: CallHints | None = None
    # ``prompt_tokens`` is the shell's estimate (the gateway's: about 4 bytes a token), not
    # the engine's count: the policy may refine it from what the engine reported before
    prompt_estimated: bool = False

    def growth_reserve(self, default: int) -> int:
        """Tokens this call may still add while it runs (:meth:`CallHints.growth_reserve`)."""
        return default if self.hints is None else self.hints.growth_reserve(default)

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
