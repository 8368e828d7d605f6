"""One call as an engine sees it: its sequence and block hashes, how far it has been computed
and sampled, the blocks it holds, its timings and its host-tier progress (sim/engine.py moves
it through the queue and the batch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.kv_events import BlockHash


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One call as the engine sees it. ``hashes`` are the full-block hashes of the whole
    sequence the call will have (prompt then output), so the blocks its output fills are
    cached under the hashes the program's next prompt will look up."""

    request_id: str
    session_id: str | None
    hashes: Sequence[BlockHash]
    prompt_tokens: int
    output_tokens: int
    priority: float
    arrival: float
    continuation_id: str | None = None
    # tokens of this sequence the session had computed before (to count re-prefill): the
    # previous call's context, raised to what was computed when the request is preempted
    known_prefix_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    block_ids: list[int] = field(default_factory=list)
    # (block_ids as admitted, its first blocks as an array) while ``block_ids`` is that list
    # (it only grows): the engine converts only the rest when it frees them
    block_head: tuple[list[int], Any] | None = None
    num_cached_blocks: int = 0
    cached_tokens: int = -1
    reprefill_tokens: int = 0
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    order: int = 0
    # the sequence's token ids (prompt then output), when the caller has them: they go on
    # BlockStored events; without them events carry an empty token list
    token_ids: Sequence[int] | None = None
    # this request reports its prefix hits (vLLM's per-request kv_cache_report_mode "full")
    report_reuse: bool = False
    # host tier: blocks offered to it so far (vLLM's next_stored_chunk_idx), blocks being
    # loaded from it, and when that load ends
    host_offered_blocks: int = 0
    host_loading_blocks: int = 0
    host_load_done_at: float = 0.0

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.num_output

    @property
    def finished(self) -> bool:
        return self.finished_at is not None
