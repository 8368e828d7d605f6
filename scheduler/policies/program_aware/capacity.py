"""How much a worker may hold before it pauses: one strategy, chosen from the config once.

- :class:`PoolCapacity`: the GPU pool is the limit; every worker pauses at
  ``pause_threshold`` (architecture.md §3).
- :class:`TieredCapacity`: with a host KV tier (``retention.host_tier``), KV that leaves the
  GPU waits in host memory, so a worker none of whose programs is paused runs them all up to
  ``host_tier_overcommit`` GPU pools (design notes "Policy with a host tier"); and a paused
  program whose home still holds its KV resumes only there.

The rest of the policy asks the strategy and never looks at ``host_tier`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.config import ProgramAwareConfig
from scheduler.kv_index import KVIndex
from scheduler.ledger import Ledger
from scheduler.programs import Program


class PoolCapacity:
    """Without a host tier: a worker's GPU pool is all it has."""

    def __init__(self, config: ProgramAwareConfig, ledger: Ledger, index: KVIndex) -> None:
        self.config = config
        self._ledger = ledger
        self._index = index

    def reconfigure(self, config: ProgramAwareConfig) -> None:
        self.config = config

    def threshold(self, worker: str, newcomer: int = 0) -> float:
        """The pause threshold of ``worker`` (what placing ``newcomer`` tokens more there
        may reach): ``host_tier_overcommit`` while it runs all its programs, else
        ``pause_threshold``."""
        if self.runs_all(worker, newcomer):
            return self.config.host_tier_overcommit
        return self.config.pause_threshold

    def runs_all(self, worker: str, newcomer: int = 0) -> bool:
        """Whether ``worker`` runs every program homed there, whatever their size."""
        return False

    def highest_threshold(self) -> float:
        """The largest threshold any worker may have."""
        return self.config.pause_threshold

    def recount(self, programs: Iterable[Program]) -> None:
        """Take stock of where programs are homed (before placing or pausing anything)."""

    def note_paused(self, worker: str, tokens: int) -> None:
        """A program of ``tokens`` was paused on ``worker``."""

    def forget_worker(self, name: str) -> None:
        """The worker left the fleet."""

    def anchored_home(self, program: Program) -> bool:
        """Whether a paused ``program`` may resume only on its home."""
        return False


class TieredCapacity(PoolCapacity):
    """With a host tier: what overflows the GPU waits in the tier, cheaper than waiting for
    room.

    Invariant 1: after :meth:`recount`, ``_homed_tokens[w]`` is the demand of every program
    homed on ``w`` (dormant and paused ones too) and ``_paused_tokens[w]`` that of the paused
    ones among them, plus what :meth:`note_paused` added since; every reader runs after a
    recount in the same pass (a tick, a placement).
    """

    def __init__(self, config: ProgramAwareConfig, ledger: Ledger, index: KVIndex) -> None:
        super().__init__(config, ledger, index)
        self._homed_tokens: dict[str, int] = {}
        self._paused_tokens: dict[str, int] = {}

    def runs_all(self, worker: str, newcomer: int = 0) -> bool:
        """A worker none of whose programs is paused runs them all while their contexts —
        dormant ones included — and ``newcomer`` tokens more add up to at most
        ``host_tier_overcommit`` times its GPU pool: what overflows the GPU waits in the
        tier, cheaper than waiting for room (measured: at CC256 the programs homed on a
        worker add up to 0.9–2.3 pools, and running them all beats pausing any). Once it has
        had to pause, some wait anyway, and ``pause_threshold`` keeps the active ones to what
        its GPU runs without thrashing until every program it paused is back (without that
        hysteresis a worker near the limit flips between the two every few ticks: measured
        105k pauses in 30 min at CC512)."""
        capacity = self._ledger.worker(worker).capacity_tokens
        if self._paused_tokens.get(worker, 0) or capacity is None:
            return False  # a worker of unknown capacity takes no program at all
        return self._homed_tokens.get(worker, 0) + newcomer <= self.config.host_tier_overcommit * capacity

    def highest_threshold(self) -> float:
        return max(self.config.pause_threshold, self.config.host_tier_overcommit)

    def recount(self, programs: Iterable[Program]) -> None:
        homed: dict[str, int] = {}
        paused: dict[str, int] = {}
        for program in programs:
            home = program.home_worker
            if home is not None:
                tokens = program.demand_tokens()
                homed[home] = homed.get(home, 0) + tokens
                if program.paused:
                    paused[home] = paused.get(home, 0) + tokens
        self._homed_tokens, self._paused_tokens = homed, paused  # keeps invariant 1

    def note_paused(self, worker: str, tokens: int) -> None:
        self._paused_tokens[worker] = self._paused_tokens.get(worker, 0) + tokens  # keeps invariant 1

    def forget_worker(self, name: str) -> None:
        self._paused_tokens.pop(name, None)
        self._homed_tokens.pop(name, None)

    def anchored_home(self, program: Program) -> bool:
        """A program whose home still holds its KV (on the GPU or in the tier) waits for
        room there: resuming it elsewhere would recompute what the home can load back
        (measured: most of program_aware's re-prefill with the tier came from such moves).
        ``max_wait_s`` still bounds the wait (a forced resume goes home)."""
        home = program.home_worker
        if home is None or not self._ledger.worker(home).accepts_programs:
            return False
        index = self._index
        return index.host_tokens(home, program.session_id) > 0 or index.session_tokens(home, program.session_id) > 0


def capacity_for(config: ProgramAwareConfig, ledger: Ledger, index: KVIndex) -> PoolCapacity:
    """The strategy ``config`` asks for."""
    kind = TieredCapacity if config.retention.host_tier else PoolCapacity
    return kind(config, ledger, index)
