"""Which ACTING programs are dormant, and when an offloaded one's tool call should end
(docs/design-notes.md "Policy v2"; architecture.md §3 ``dormant_*``).

An ACTING program still in its tool call after the cutoff — the ``dormant_quantile`` of
recent tool-call durations, at least ``dormant_min_s``, or the client's retention TTL for
that call — is likely in a long one (a test run, a user away): it stops counting in ``U``
(``dormant_token_weight``), so its room goes to work that is ready. Its KV stays retained
(among retained KV the engine's LRU takes theirs first anyway, and demoting it measured
worse). Its next call goes home as usual and counts again.

Invariant 1: a dormancy check or predicted end ``(due, session, acting_since)`` is live
while ``session``'s program is still in the tool call that began at ``acting_since``;
:meth:`Dormancy.turning_dormant` and :meth:`Dormancy.predicted_ends` act on live ones only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.deadline_heap import DeadlineHeap
from scheduler.ledger import Ledger
from scheduler.programs import Phase, Program
from scheduler.tool_times import ToolTimes


class Dormancy:
    """The tool-time cutoff, learnt online, and the deadlines read from it. Reads the
    program table; marks programs dormant in the ledger."""

    def __init__(self, config: ProgramAwareConfig, ledger: Ledger, programs: Mapping[SessionId, Program]) -> None:
        self.config = config
        self._ledger = ledger
        self._programs = programs
        self._tool_times = ToolTimes(config.tool_time_window)
        # (due, session, acting_since): when an ACTING program would count as dormant
        self._checks: DeadlineHeap[tuple[float, str, float]] = DeadlineHeap(
            self._in_same_tool_call, lambda: len(programs))
        # (due, session, acting_since): when an offloaded dormant program's tool call is
        # predicted to end (its Prefetch is due then)
        self._predicted_ends: DeadlineHeap[tuple[float, str, float]] = DeadlineHeap(
            self._in_same_tool_call, lambda: len(programs))

    def reconfigure(self, config: ProgramAwareConfig) -> None:
        """New settings; the window of tool times keeps its size."""
        self.config = config

    def observe_arrival(self, program: Program, now: float) -> None:
        """A call of ``program`` arrived: the tool call before it, if any, is a sample."""
        if self.config.dormant_quantile is not None and program.acting_since is not None:
            self._tool_times.observe(now - program.acting_since)

    def cutoff(self) -> float | None:
        """Seconds in a tool call after which a program counts as dormant (None: not yet
        known, or dormancy off). Adapts to the traffic: a quantile of recent tool calls."""
        if self.config.dormant_quantile is None:
            return None
        quantile = self._tool_times.quantile(self.config.dormant_quantile)
        return None if quantile is None else max(self.config.dormant_min_s, quantile)

    def watch(self, program: Program) -> None:
        """``program``'s last call ended: check it once its tool call has lasted the cutoff
        (the client's retention TTL says how long this tool call keeps the KV worth
        holding)."""
        cutoff = program.retention_ttl_s if program.retention_ttl_s is not None else self.cutoff()
        if cutoff is not None and program.active and program.acting_since is not None:
            self._checks.push((program.acting_since + cutoff, program.session_id, program.acting_since))

    def turning_dormant(self, now: float) -> Iterator[Program]:
        """The ACTIVE programs whose tool call passed its cutoff by ``now``, each marked
        dormant in the ledger as it is handed over."""
        for _, session, since in self._checks.pop_due(now):
            program = self._programs.get(session)
            if (program is None or not program.active or program.phase is not Phase.ACTING
                    or program.acting_since != since or self._ledger.is_dormant(session)):
                continue  # reasoning again, paused or gone since the check was set (invariant 1)
            self._ledger.set_dormant(program)
            yield program

    def predict_end(self, program: Program, now: float) -> None:
        """Expect ``program``'s tool call to end at the median of the recent ones longer
        than it has lasted (none when none lasted that long)."""
        since = program.acting_since
        if since is None:
            raise ValueError(f"{program.session_id}: only a program in a tool call has one to end")
        predicted = self._tool_times.median_beyond(now - since)
        if predicted is not None:
            self._predicted_ends.push((since + predicted, program.session_id, since))

    def predicted_ends(self, now: float) -> Iterator[Program]:
        """The programs whose tool call is predicted to have ended by ``now`` (still in the
        same one, still ACTIVE at home)."""
        for _, session, since in self._predicted_ends.pop_due(now):
            program = self._programs.get(session)
            if (program is None or not program.active or program.phase is not Phase.ACTING
                    or program.acting_since != since or program.home_worker is None):
                continue  # its call came, or it was paused or released, meanwhile (invariant 1)
            yield program

    def trim(self) -> None:
        """A program was released: its deadlines may go."""
        self._checks.trim()
        self._predicted_ends.trim()

    def _in_same_tool_call(self, entry: tuple[float, str, float]) -> bool:
        program = self._programs.get(entry[1])
        return program is not None and program.acting_since == entry[2]
