"""The ledger: per-worker capacity, assigned programs and utilization (architecture.md §2).

``U_w = (Σ_{p active on w} weight(p)·demand(p) − shared_w + buffer·n_w) / capacity_w``

``weight(p)`` is 1 while REASONING, ``acting_token_weight`` while ACTING, and
``dormant_token_weight`` (0 by default) once a policy has marked the ACTING program dormant
(in what looks like a long tool call); ``demand(p)`` is the program's context, or what its
in-flight calls may grow to. ``shared_w`` counts the prefix tokens the active programs on
``w`` share: the larger of what the KV index shows (when the worker's events flow) and what
the programs' continuation chains show (a trie of common ancestors).

Everything is kept incrementally — a program's contribution is recomputed only when it
changes — so a tick over thousands of programs does not re-sum them. What that keeps, once
:meth:`Ledger.refresh` has seen a program's latest change:

Invariant 1: a program is counted exactly while it is ACTIVE with a home worker, on that
worker: in ``_counted`` and its worker's ``programs``, its ``weight·demand`` (as of its
latest refresh: new weights apply as programs next change) in the worker's
``weighted_demand``.

Invariant 2: a worker's ``ancestry_shared`` is ``Σ tokens·(count − 1)`` over the chain nodes
of its counted programs that are not dormant (a dormant program shares nothing).

Invariant 3: ``_dormant`` holds only ACTIVE programs in the tool call they were found
dormant in: a program leaves it when it reasons again or stops being ACTIVE.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.kv_index import KVIndex
from scheduler.programs import Phase, Program

UNKNOWN_CAPACITY_UTILIZATION = float("inf")


class TokenWeights(Protocol):
    """How the ledger counts a program's tokens in ``U`` (a program-aware config is one)."""

    @property
    def acting_token_weight(self) -> float: ...
    @property
    def dormant_token_weight(self) -> float: ...
    @property
    def buffer_per_program(self) -> int: ...


@dataclass(frozen=True, slots=True)
class FixedTokenWeights:
    """Weights for a policy whose config does not set them: the program-aware defaults, so
    every policy's ``U`` is measured alike."""

    acting_token_weight: float = 1.0
    dormant_token_weight: float = 0.0
    buffer_per_program: int = 100


_Nodes = tuple[tuple[str, int], ...]  # a chain's (continuation id, segment tokens)
_Source = tuple[tuple[str, ...], tuple[int, ...]]  # a chain's ids and cumulative tokens


@dataclass(slots=True)
class _Counted:
    """What a program currently adds to its worker's sums."""

    worker: str
    weighted_demand: float
    demand: int
    chain: _Nodes  # (continuation id, segment tokens)
    # what ``chain`` was computed from (the program's chain ids and chain tokens), so that a
    # refresh under the same or an extended chain reuses it (:func:`_chain_segments`)
    source: _Source | None = None


@dataclass(slots=True)
class WorkerLoad:
    name: str
    capacity_tokens: int | None = None
    healthy: bool = True
    # session -> demand tokens of the active programs assigned here
    programs: dict[str, int] = field(default_factory=dict)
    weighted_demand: float = 0.0
    ancestry_counts: dict[str, int] = field(default_factory=dict)
    ancestry_shared: int = 0
    # tokens of each node as first counted: two programs may size one prefix differently
    # (estimates), and every count change must use one amount or the sum drifts for good
    ancestry_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def accepts_programs(self) -> bool:
        return self.healthy and bool(self.capacity_tokens)


class Ledger:
    def __init__(self, weights: TokenWeights, index: KVIndex) -> None:
        self._config = weights
        self._index = index
        self._gpu = index.gpu_workers  # a live view: the reads of ``U`` below look up in it
        self._workers: dict[str, WorkerLoad] = {}
        self._counted: dict[str, _Counted] = {}
        # ACTING programs counted at dormant_token_weight (see set_dormant); cleared when
        # they reason
        self._dormant: set[str] = set()

    def reconfigure(self, weights: TokenWeights) -> None:
        """Swap weights; contributions are recomputed as programs next change."""
        self._config = weights

    @property
    def weights(self) -> TokenWeights:
        return self._config

    # -- workers -------------------------------------------------------------------------

    def add_worker(self, name: str, capacity_tokens: int | None = None) -> WorkerLoad:
        if name in self._workers:
            raise ValueError(f"worker {name!r} is already registered")
        if capacity_tokens is not None and capacity_tokens <= 0:
            raise ValueError(f"worker {name!r}: capacity must be > 0 tokens, got {capacity_tokens}")
        load = self._workers[name] = WorkerLoad(name, capacity_tokens)
        return load

    def remove_worker(self, name: str) -> None:
        """Forget a worker that no program is counted on any more (drain it first)."""
        load = self.worker(name)
        if load.programs:
            raise ValueError(f"worker {name!r} still counts {len(load.programs)} program(s); "
                             "drain it before removing it")
        del self._workers[name]

    def set_capacity(self, name: str, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"worker {name!r}: capacity must be > 0 tokens, got {capacity_tokens}")
        self.worker(name).capacity_tokens = capacity_tokens

    def set_healthy(self, name: str, healthy: bool) -> None:
        self.worker(name).healthy = healthy

    def worker(self, name: str) -> WorkerLoad:
        try:
            return self._workers[name]
        except KeyError:
            raise KeyError(f"unknown worker {name!r}") from None

    def workers(self) -> Iterator[WorkerLoad]:
        return iter(self._workers.values())

    def worker_names(self) -> list[str]:
        return list(self._workers)

    def __contains__(self, name: object) -> bool:
        return name in self._workers

    # -- programs ------------------------------------------------------------------------

    def weight(self, program: Program) -> float:
        if program.phase is Phase.REASONING:
            return 1.0
        if program.session_id in self._dormant:
            return self._config.dormant_token_weight
        return self._config.acting_token_weight

    def set_dormant(self, program: Program) -> None:
        """An ACTING program likely in a long tool call: its KV counts at
        ``dormant_token_weight`` until its next call starts."""
        if program.phase is not Phase.ACTING:
            raise ValueError(f"{program.session_id}: only an ACTING program can be dormant")
        self._dormant.add(program.session_id)
        self.refresh(program)

    def is_dormant(self, session: str) -> bool:
        return session in self._dormant

    def refresh(self, program: Program) -> None:
        """Bring the sums in line with ``program``'s current state (call after any change)."""
        session = program.session_id
        old = self._counted.get(session)
        if program.phase is Phase.REASONING or not program.active:
            self._dormant.discard(session)  # keeps invariant 3
        if not program.active or program.home_worker is None:
            if old is not None:
                self._uncount(session, old)  # keeps invariant 1
            return
        demand = program.demand_tokens()
        weighted = self.weight(program) * demand
        # A dormant program's KV is not counted, so neither is its share of common prefixes
        # (else every dormant program sharing the system prompt would lower U by its size).
        sharing = session not in self._dormant
        chain, source = _chain_segments(program, old) if sharing else ((), None)
        if old is not None and old.worker == program.home_worker:
            load = self._workers[old.worker]
            load.weighted_demand += weighted - old.weighted_demand  # keeps invariant 1
            load.programs[session] = demand
            if chain != old.chain:  # keeps invariant 2
                self._ancestry_moved(load, old.chain, chain)
            self._index.worker(load.name).set_counted(session, sharing)
            old.weighted_demand, old.demand, old.chain, old.source = weighted, demand, chain, source
            return
        if old is not None:
            self._uncount(session, old)
        load = self.worker(program.home_worker)
        load.weighted_demand += weighted
        load.programs[session] = demand
        self._ancestry(load, chain, +1)
        self._index.worker(load.name).set_counted(session, sharing)
        self._counted[session] = _Counted(load.name, weighted, demand, chain, source)

    def forget(self, session: str) -> None:
        """The program was released."""
        self._dormant.discard(session)  # keeps invariant 3
        old = self._counted.get(session)
        if old is not None:
            self._uncount(session, old)

    def _uncount(self, session: str, old: _Counted) -> None:
        """Take a program out of its worker's sums (invariants 1 and 2)."""
        load = self._workers[old.worker]
        del load.programs[session]
        load.weighted_demand -= old.weighted_demand
        if not load.programs:
            load.weighted_demand = 0.0  # no float drift on an empty worker
        self._ancestry(load, old.chain, -1)
        self._index.worker(load.name).set_counted(session, False)
        del self._counted[session]

    @staticmethod
    def _ancestry(load: WorkerLoad, chain: tuple[tuple[str, int], ...], delta: int) -> None:
        """Count ``chain``'s nodes in (``delta`` +1) or out (−1) of the worker's ancestry; a
        node's share ``tokens · max(0, count − 1)`` moves by its tokens exactly when it is
        (or stays) held by two or more counted programs."""
        counts = load.ancestry_counts
        tokens_of = load.ancestry_tokens
        change = 0
        if delta > 0:
            for node, tokens in chain:
                before = counts.get(node, 0)
                if before:
                    counts[node] = before + 1
                    change += tokens_of[node]
                else:
                    counts[node] = 1
                    tokens_of[node] = tokens  # a node keeps the size it was first seen with
        else:
            for node, _ in chain:
                before = counts[node]  # counted in before: a chain leaves as it came
                if before > 1:
                    counts[node] = before - 1
                    change -= tokens_of[node]
                else:
                    del counts[node]
                    del tokens_of[node]
        load.ancestry_shared += change

    @classmethod
    def _ancestry_moved(cls, load: WorkerLoad, old: tuple[tuple[str, int], ...],
                        new: tuple[tuple[str, int], ...]) -> None:
        """Count ``old`` out and ``new`` in, as :meth:`_ancestry` −1 then +1 would, touching
        only what differs: a chain mostly grows at its end, and a node the two share (same
        place, same size) keeps its count; one this program alone holds takes its size."""
        same = 0
        for before, after in zip(old, new):
            if before != after:
                break
            same += 1
        if same:
            counts, tokens_of = load.ancestry_counts, load.ancestry_tokens
            for node, tokens in new[:same]:
                if counts[node] == 1:
                    tokens_of[node] = tokens  # as counting it out and in again would
        cls._ancestry(load, old[same:], -1)
        cls._ancestry(load, new[same:], +1)

    # -- utilization ---------------------------------------------------------------------

    def shared_tokens(self, name: str) -> int:
        """Both sources are lower bounds of the true overlap (the index misses sessions that
        hit a prefix without reporting it; ancestry misses sharing the chains cannot see),
        so the larger one is the better estimate."""
        return self._shared(self._workers[name])

    def _shared(self, load: WorkerLoad) -> int:
        # read off the index's live view, not through ``has_events`` and ``worker``: the pause
        # pass and the placements read U millions of times a simulated hour
        shared = load.ancestry_shared
        kv = self._gpu.get(load.name)
        if kv is not None and kv.events_seen > 0 and kv.shared_tokens > shared:
            return kv.shared_tokens
        return shared

    def _load_tokens(self, load: WorkerLoad) -> float:
        return (load.weighted_demand - self._shared(load)
                + self._config.buffer_per_program * len(load.programs))

    def load_tokens(self, name: str) -> float:
        """The numerator of ``U_w``."""
        return self._load_tokens(self._workers[name])

    def utilization(self, name: str) -> float:
        """``load_tokens(name) / capacity`` (:data:`UNKNOWN_CAPACITY_UTILIZATION` without one)."""
        load = self._workers[name]
        if not load.capacity_tokens:
            return UNKNOWN_CAPACITY_UTILIZATION
        return self._load_tokens(load) / load.capacity_tokens

    def utilizations(self) -> Iterator[tuple[WorkerLoad, float]]:
        """Each worker with its :meth:`utilization`, in :meth:`workers` order, each read when
        its turn comes (a caller that moves programs between turns sees the moves): the
        passes over every worker at every tick."""
        for load in self._workers.values():
            if not load.capacity_tokens:
                yield load, UNKNOWN_CAPACITY_UTILIZATION
            else:
                yield load, self._load_tokens(load) / load.capacity_tokens

    def utilization_with(self, name: str, extra_tokens: float, extra_programs: int = 1) -> float:
        """``U_w`` if a program adding ``extra_tokens`` joined ``w``."""
        load = self._workers[name]
        if not load.capacity_tokens:
            return UNKNOWN_CAPACITY_UTILIZATION
        extra = extra_tokens + self._config.buffer_per_program * extra_programs
        return (self._load_tokens(load) + extra) / load.capacity_tokens

    def contribution(self, session: str) -> float:
        """Tokens ``session`` currently adds to its worker (0 when it is not counted)."""
        counted = self._counted.get(session)
        if counted is None:
            return 0.0
        return counted.weighted_demand + self._config.buffer_per_program

    def counted_worker(self, session: str) -> str | None:
        counted = self._counted.get(session)
        return None if counted is None else counted.worker


def _chain_segments(program: Program, before: _Counted | None) -> tuple[_Nodes, _Source | None]:
    """The program's chain as (continuation id, segment tokens) nodes, and what they were
    computed from. A chain mostly grows at its end, or stays: when ``before``'s source is
    the same chain or a prefix of it (ids and tokens alike), its nodes are kept and only the
    new ones computed, which gives the same nodes (each depends on its own and the previous
    cumulative count alone)."""
    chain, tokens = program.chain, program.chain_tokens
    if chain is None or tokens is None:
        return (), None
    ids = chain.ids
    if tokens.__class__ is not tuple or ids.__class__ is not tuple or len(tokens) != len(ids):
        return _segments(ids, tokens, 0, 0), None  # nothing to reuse from, nor for later
    source = (ids, tokens)
    if before is not None and before.source is not None:
        old_ids, old_tokens = before.source
        if ids is old_ids and tokens is old_tokens:
            return before.chain, source
        n = len(old_ids)
        if len(ids) >= n and ids[:n] == old_ids and tokens[:n] == old_tokens:
            return before.chain + _segments(ids, tokens, n, old_tokens[-1] if n else 0), source
    return _segments(ids, tokens, 0, 0), source


def _segments(ids: tuple[str, ...], tokens: tuple[int, ...] | list[int], start: int,
              previous: int) -> _Nodes:
    segments = []
    for cid, cumulative in zip(ids[start:], tokens[start:]):
        segments.append((cid, max(0, cumulative - previous)))
        previous = cumulative
    return tuple(segments)
