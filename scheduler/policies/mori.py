"""MORI: programs ranked by idleness, the busiest on the GPU, the idlest in the host KV tier.

Source: "Idleness is Relative: Exploiting Tool-Call Idle Windows for Offloading in Agentic
Systems with MORI" (Xia, Li, Li, Chen, Kang, Qiao, Xu, Stoica; arXiv 2606.00866, 2026; its
abstract and introduction, and its sections as public reviews of it quote them). No code is
published; MORI is built on ThunderAgent's router (§5), so this policy is Sluice's
``thunderagent`` (scheduler/policies/thunderagent.py) with MORI's rules in place of its pause
and resume rules. The rules, each with its source:

- **Idleness** (§4.2, Eq. 1): ι = T_acting / (T_reasoning + T_acting) over the program's last
  ``idleness_window`` cycles (k = 5 in every experiment), a cycle being a call (reasoning,
  from its dispatch to its end) and the tool call after it (acting, from that end to the next
  call's arrival). A tool call still running counts with its elapsed time, so a program that
  enters a long one turns idle within the call (the paper's "responsive"); older cycles
  leave the window, so one long call among short ones is diluted ("robust"). Time a program
  spends held by the scheduler counts in neither (§4.1). A program no cycle of which was seen
  has no ι by Eq. 1; Sluice gives it ``unobserved_idleness`` (0.5, its own choice).
- **Three tiers per worker** (§4.1): the GPU (ACTIVE programs, counted in the ledger), the
  host KV tier (PAUSED programs whose KV waits in the worker's host memory, up to
  ``host_tier_tokens`` of contexts plus ThunderAgent's 100 tokens a program), and the
  waiting queue (PAUSED or new programs whose KV is not kept anywhere). A call of a program
  not on the GPU is held until the program is promoted back to it (§4.1).
- **Demotion** (§4.3.1), when a worker's GPU programs exceed its pool (ThunderAgent's
  accounting): programs in a tool call first, the most idle first; then, lazily, programs
  reasoning, the most idle first: marked, and moved once their call ends (the Sluice rule
  is to mark only enough of them to cover the overflow; ThunderAgent's code marks all). A
  demoted program goes to its worker's host tier if the tier has room for it (``Offload``:
  its GPU copy goes first, its host copy is kept), else to the waiting queue (``Demote``:
  its KV goes first). That is the admission control of the host tier.
- **Promotion** (§4.3.1), at each tick: programs whose call waits, in the paper's order:
  those in the host tier, then those in the waiting queue, then new ones; the least idle
  first within each; one that does not fit is passed over for the next (Sluice's choice: the
  paper gives no rule for it). One in the host tier goes back to its own worker, whose host
  memory holds its KV (the cache affinity of §4.1); the others go to the worker with the most
  room left where they fit (§4.3.1 packs replicas with ThunderAgent's best-fit-decreasing,
  which in ThunderAgent's code, and Sluice's ``thunderagent``, is this). A promoted program
  gets ``Prefetch`` (its host copy kept until its call loads it back, a demotion undone) and
  its held calls are admitted. That is the admission control of the GPU tier: a program is
  promoted only where its demand fits. Nothing is reloaded ahead of a call: the paper
  promotes on the call, so Sluice predicts no tool-call end.
- **The boundary follows the hardware** (§4, §4.3.1): no idleness threshold decides who is
  where; the GPU holds the least idle programs its pool fits, the host tier the next ones
  its capacity fits, and the waiting queue takes only what overflows both (§4.1). So when a
  program whose call waits does not fit, programs in a tool call on that worker that are
  more idle than it move to the host tier, the most idle first, while the tier has room for
  them, until it fits (Sluice's reading of "assign the busiest to GPU, the most idle to
  CPU": the paper demotes on overflow and ranks promotion, and does not say how a
  program that waits displaces an idler one). Programs otherwise stay where they are (the
  paper's stickiness: no move on a change of ι alone).
- **Control loop** (§5): every ``scheduler_interval_s`` (5 s) and only then; demotion before
  promotion, so a promotion sees the room the demotions made (Sluice's order).
- **Typed eviction** (§4.3.2: on the GPU the blocks of waiting programs go first, then the
  idle, the busy last; in the host tier the order is reversed, the idle last) becomes the
  directives above: ``Demote``
  and ``Offload`` put a program's GPU blocks first and ``Offload`` parks its host copy as most
  recent; Sluice's directives have no class between the two, so waiting and idle programs go
  alike on the GPU, busy ones by LRU after them.

Kept from ThunderAgent (MORI does not say otherwise): the accounting of a worker's pool
(contexts, ``acting_token_weight``, 100 tokens a program), new programs admitted on arrival
to the worker with the fewest active tokens among those with room unless a program waits
for promotion, the forced resume after ``force_resume_after_s``, the idle release.

Without a host tier (``host_tier_tokens`` 0) no program can be offloaded: demotion goes to
the waiting queue, nothing displaces anything, and admission control is the GPU's alone, as
ThunderAgent's with MORI's idleness order.

Invariant 1: a session is in ``_host[w]`` exactly while its program is PAUSED with home ``w``
and its KV counts in ``w``'s host tier, with the context it had when it was demoted.

Invariant 2: a session's window is open (``open_reasoning_s`` set) exactly while its program
is in a tool call: from the end of a call that left none in flight and none held to the
arrival of its next call (``acting_since`` is set all that time).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.actions import Action, Decision, Demote, Mark, Offload, Pause, Prefetch
from scheduler.config import MoriConfig
from scheduler.coordinates import SessionId
from scheduler.policies.base import Call
from scheduler.policies.parking import demand_when_resumed
from scheduler.policies.thunderagent import BUFFER_PER_PROGRAM, ThunderAgentPolicy
from scheduler.programs import Phase, Program

# Among prefetched sessions the host tier gives up the lowest priority first; MORI's
# promotions are all alike, so one value (program_aware's default prefetch_priority).
PREFETCH_PRIORITY = 50

GPU, HOST, WAITING = "gpu", "host", "waiting"


@dataclass(slots=True)
class _Window:
    """A program's recent cycles: (reasoning s, acting s), oldest first."""

    cycles: deque[tuple[float, float]]
    reasoning_since: float | None = None  # when its current call(s) began to run
    open_reasoning_s: float | None = None  # the newest cycle's reasoning, its tool call running


class MoriPolicy(ThunderAgentPolicy):
    name = "mori"
    config: MoriConfig

    def __init__(self, config: MoriConfig) -> None:
        super().__init__(config)
        self._windows: dict[SessionId, _Window] = {}
        # worker -> session -> the context it holds in that worker's host tier (invariant 1)
        self._host: dict[str, dict[SessionId, int]] = {}

    def reconfigure(self, config: MoriConfig) -> None:  # type: ignore[override]
        super().reconfigure(config)
        for window in self._windows.values():
            window.cycles = deque(window.cycles, maxlen=config.idleness_window)

    # -- idleness (§4.2) ---------------------------------------------------------------

    def idleness(self, program: Program, now: float) -> float:
        """ι of Eq. 1 at ``now``: the share of tool-call time in the last k cycles, the
        current one (its tool call still running) included."""
        window = self._windows.get(program.session_id)
        if window is None:
            return self.config.unobserved_idleness
        cycles = list(window.cycles)
        if window.open_reasoning_s is not None:  # in a tool call: it counts as it lasts
            cycles.append((window.open_reasoning_s, now - _tool_call_start(program)))
        cycles = cycles[-self.config.idleness_window:]
        reasoning = sum(r for r, _ in cycles)
        acting = sum(a for _, a in cycles)
        total = reasoning + acting
        return self.config.unobserved_idleness if total <= 0.0 else acting / total

    def _window(self, session: SessionId) -> _Window:
        window = self._windows.get(session)
        if window is None:
            window = self._windows[session] = _Window(deque(maxlen=self.config.idleness_window))
        return window

    def _dispatch(self, program: Program, call: Call, worker: str, now: float) -> None:
        starts = not program.in_flight
        super()._dispatch(program, call, worker, now)
        if starts:
            self._window(program.session_id).reasoning_since = now  # held time is not reasoning

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        self._close_cycle(program, now)  # its tool call ended as this call arrived
        return super().decide_arrival(program, call, now)

    def after_call(self, program: Program, now: float) -> list[Action]:
        if not program.in_flight:
            window = self._window(program.session_id)
            since = window.reasoning_since if window.reasoning_since is not None else now
            window.open_reasoning_s = now - since  # keeps invariant 2
            window.reasoning_since = None
            if program.waiting:  # its next call came while this one ran: no tool call between
                self._close_cycle(program, now)
        return super().after_call(program, now)

    def _close_cycle(self, program: Program, tool_call_end: float) -> None:
        """The program's tool call ended at ``tool_call_end``: its cycle joins the window, and
        what the program waits from then on is neither acting nor reasoning (§4.1)."""
        window = self._windows.get(program.session_id)
        if window is not None and window.open_reasoning_s is not None:
            window.cycles.append((window.open_reasoning_s, tool_call_end - _tool_call_start(program)))
            window.open_reasoning_s = None  # keeps invariant 2

    # -- tiers -------------------------------------------------------------------------

    def tier_of(self, session: SessionId) -> str:
        """Where ``session``'s program is: ``gpu``, ``host`` or ``waiting``."""
        program = self.programs[session]
        if program.active:
            return GPU
        if program.home_worker is not None and session in self._host.get(program.home_worker, {}):
            return HOST
        return WAITING

    def host_room(self, worker: str) -> int:
        """Tokens left in ``worker``'s host tier (negative: over, after a smaller tier)."""
        book = self._host.get(worker, {})
        return self.config.host_tier_tokens - sum(book.values()) - BUFFER_PER_PROGRAM * len(book)

    def _fits_host(self, program: Program, worker: str) -> bool:
        return self.host_room(worker) >= program.context_tokens + BUFFER_PER_PROGRAM

    def _leave_host(self, program: Program) -> None:
        if program.home_worker is not None:
            book = self._host.get(program.home_worker)
            if book is not None and book.pop(program.session_id, None) is not None and not book:
                del self._host[program.home_worker]  # keeps invariant 1

    # -- demotion (§4.3.1) -------------------------------------------------------------

    def _pause(self, now: float) -> list[Action]:
        """Demote from each worker whose GPU programs exceed its pool: those in a tool call,
        most idle first, until it fits; then mark reasoning ones, most idle first, until the
        marked ones cover what is still over."""
        actions: list[Action] = []
        for load in self.ledger.workers():
            if not load.capacity_tokens or self._remaining(load.name) >= 0:
                continue
            on_worker = [self.programs[s] for s in load.programs]
            for program in self._most_idle_first(on_worker, Phase.ACTING, now):
                if self._remaining(load.name) >= 0:
                    break
                actions += self._pause_program(program, now)
            over = -self._remaining(load.name) - sum(
                self.ledger.contribution(p.session_id) for p in on_worker if p.marked and p.active)
            for program in self._most_idle_first(on_worker, Phase.REASONING, now):
                if over <= 0:
                    break
                if program.marked:
                    continue
                program.mark()
                self.stats.marks += 1
                actions.append(Mark(program.session_id, load.name))
                over -= self.ledger.contribution(program.session_id)
        return actions

    def _most_idle_first(self, programs: list[Program], phase: Phase, now: float) -> list[Program]:
        chosen = [p for p in programs if p.phase is phase and p.active]
        return sorted(chosen, key=lambda p: (-self.idleness(p, now), p.session_id))

    def _pause_program(self, program: Program, now: float) -> list[Action]:
        """GPU → the host tier if it has room for the program's context, else the waiting
        queue."""
        to_host = self._fits_host(program, program.home_worker)  # type: ignore[arg-type]
        context = program.context_tokens
        worker = self._lot.pause(program, self.ledger, self.stats, now)
        if to_host:
            self._host.setdefault(worker, {})[program.session_id] = context  # keeps invariant 1
            return [Pause(program.session_id, worker), Offload(program.session_id, worker, program.chain_head)]
        return [Pause(program.session_id, worker), Demote(program.session_id, worker)]

    def _evict_host(self, now: float) -> None:
        """A host tier over its capacity (after it was made smaller) sends its most idle
        programs to the waiting queue (their blocks stay parked in the engine's tier until
        its LRU takes them)."""
        for worker in list(self._host):
            while self.host_room(worker) < 0:
                book = self._host[worker]
                session = max(book, key=lambda s: (self.idleness(self.programs[s], now), s))
                self._leave_host(self.programs[session])

    # -- promotion (§4.3.1) ------------------------------------------------------------

    def _resume(self, now: float) -> list[Action]:
        actions: list[Action] = []
        lot = self._lot
        for session in lot.sessions():  # ThunderAgent's forced resume
            actions += self._force_resume_if_due(session, now) or []
        candidates = []
        for session in lot.sessions():
            program = self.programs[session]
            if program.waiting:
                group = {HOST: 0, WAITING: 1}[self.tier_of(session)] if program.paused else 2
                candidates.append((group, self.idleness(program, now), session))
        for _group, iota, session in sorted(candidates):
            program = self.programs[session]
            demand = demand_when_resumed(program, self.calls, self.config.growth_reserve_tokens)
            worker, moves = self._place(program, demand, iota, now)
            actions += moves
            if worker is not None:
                actions += self._resume_program(program, worker, now, forced=False)
        return actions

    def _place(self, program: Program, demand: int, iota: float, now: float
               ) -> tuple[str | None, list[Action]]:
        """Where ``program`` goes, and the demotions that make room for it there (§4.1: only
        what overflows both tiers waits)."""
        need = demand + BUFFER_PER_PROGRAM
        if self.tier_of(program.session_id) == HOST:
            home = program.home_worker
            targets = [home] if home is not None and self.ledger.worker(home).accepts_programs else []
        else:
            targets = [load.name for load in self.ledger.workers() if load.accepts_programs]
        if not targets:
            return None, []
        roomiest = max(targets, key=lambda w: (self._remaining(w), w))
        if self._remaining(roomiest) >= need:
            return roomiest, []
        for worker in sorted(targets, key=lambda w: (-self._remaining(w), w)):
            victims = self._idler_to_offload(worker, iota, need, now)
            if victims is None:
                continue
            moves: list[Action] = []
            for victim in victims:
                if self._remaining(worker) >= need:
                    break
                moves += self._pause_program(victim, now)
            if self._remaining(worker) >= need:
                return worker, moves
            return None, moves  # shared prefixes freed less than counted: it waits a tick
        return None, []

    def _idler_to_offload(self, worker: str, iota: float, need: float, now: float) -> list[Program] | None:
        """The programs in a tool call on ``worker`` more idle than ``iota``, most idle first,
        that the host tier can take and whose leaving frees ``need`` (None: they cannot)."""
        if self.config.host_tier_tokens <= 0:
            return None
        room, freed, victims = self.host_room(worker), self._remaining(worker), []
        on_worker = [self.programs[s] for s in self.ledger.worker(worker).programs]
        for program in self._most_idle_first(on_worker, Phase.ACTING, now):
            if freed >= need or self.idleness(program, now) <= iota:
                break
            if room < program.context_tokens + BUFFER_PER_PROGRAM:
                continue
            room -= program.context_tokens + BUFFER_PER_PROGRAM
            freed += self.ledger.contribution(program.session_id)
            victims.append(program)
        return victims if freed >= need else None

    def _resume_program(self, program: Program, worker: str, now: float, forced: bool) -> list[Action]:
        """Promote ``program`` to ``worker``'s GPU: out of the host tier or the waiting queue,
        its demotion undone and its host copy kept until its held calls load it (§4.1)."""
        was_paused = program.paused
        self._leave_host(program)
        actions = self._lot.resume(program, worker, self.ledger, self.stats, now, forced)
        if was_paused:
            actions.append(Prefetch(program.session_id, worker, PREFETCH_PRIORITY, program.chain_head))
        actions += self._admit_waiting(program, worker, now, was_paused, 0.0)
        if not program.in_flight:
            self._idle.note(program, now)
        return actions

    def _anyone_queued(self, program: Program) -> bool:
        """A new program waits behind every program whose call waits for promotion (§4.3.1:
        those in the host tier and the waiting queue go first)."""
        return any(self.programs[s].waiting for s in self._lot.sessions() if s != program.session_id)

    # -- the tick ----------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for session in self._idle.due(now):
            actions += self.release(session, now, "idle")
        actions += self._pause(now)
        self._evict_host(now)
        actions += self._resume(now)
        return actions

    # -- bookkeeping -------------------------------------------------------------------

    def release(self, session_id, now, reason):  # type: ignore[override]
        program = self.programs.get(session_id)
        if program is not None:
            self._leave_host(program)
        self._windows.pop(session_id, None)
        return super().release(session_id, now, reason)

    def _unhome(self, program: Program, now: float) -> list[Action]:
        self._leave_host(program)  # its worker failed: its host copy is out of reach
        return super()._unhome(program, now)

    def forget_worker(self, name: str) -> None:
        self._host.pop(name, None)


def _tool_call_start(program: Program) -> float:
    """When the tool call of a program whose window is open began (invariant 2)."""
    if program.acting_since is None:
        raise RuntimeError(f"{program.session_id}: idleness window open outside a tool call")
    return program.acting_since
