"""Sluice's program-aware policy: architecture.md §3 (v1) with the v2 rules of
docs/design-notes.md "Policy v2".

A tick runs, in order: release idle programs → dormancy → predicted prefetches → overdue
calls → resume → pause → soft band → retention.

- **Dormancy (v2)**: an ACTING program still in its tool call after the
  ``dormant_quantile`` of recent tool-call durations (at least ``dormant_min_s``) is likely
  in a long one (a test run, a user away): it stops counting in ``U`` (weight
  ``dormant_token_weight``), so its room goes to work that is ready; its KV stays where it is
  until the engine needs the room (LRU takes it before KV in use). Its next call goes home
  as usual and counts again.
- **Bounded waiting (v2)**: a call held ``max_wait_s`` goes ahead: its program is resumed on
  its home, else the emptiest worker, room or not (counted in ``wait_limit_resumes``); the
  pause pass then makes room. A program larger than any worker's resume limit gets a
  reserved worker instead of waiting for that: nothing else is placed there, and it resumes
  when it fits or, forced, once nothing there is reasoning.
- **Pause**: on each worker with ``U ≥ pause_threshold``, pause ACTING programs smallest
  first until ``U ≤ pause_target``; if that is not enough, mark REASONING programs smallest
  first, counting marked tokens as already gone. Nothing in flight is aborted: a marked
  program pauses when its last call completes.
- **Resume**: paused programs with a waiting call, then new programs, then idle paused
  ones; inside each, the client's higher priority first (``CallHints.priority``), then
  smallest first, sizes halved every ``resume_aging_halflife_s`` of
  waiting so a large program is not bypassed forever. Each goes to its home worker if it
  fits there (its KV may still be resident), else to the parent's worker for a sub-agent,
  else best fit (the fitting worker with the least headroom left). "Fits" means
  ``U ≤ pause_threshold − resume_hysteresis`` afterwards. A program parked for
  ``force_resume_after_s`` is resumed regardless (its home, else the emptiest worker).
- **Admission of a new program**: score = prefix credit − U (credit = resident prompt
  tokens / capacity, so both are shares of the worker; for a program of a group, the prompt
  it shares with an active sibling homed there counts as resident), minus
  ``soft_band_delay_s`` in a soft-band worker,
  among workers where it fits below ``pause_threshold``; sub-agents go to their parent's
  worker when it fits. While other programs wait for room, a new one queues behind them
  (as ThunderAgent does), and the resume pass orders them.
- **Soft band**: calls admitted to a worker with ``pause_target ≤ U < pause_threshold`` go
  ``soft_band_delay_s`` seconds later in the engine's queue (the Dynamo port's soft demote).
- **Engine priority**: every :class:`Admit` carries the call's arrival (a held call keeps its
  place), minus ``resume_priority_boost_s`` for a resumed program's calls, plus
  ``soft_band_delay_s`` in a soft band; the shells hand the engine
  :func:`scheduler.actions.engine_priority` of it (ms relative to dispatch). It orders the
  queue of the simulator's engines and of a vLLM started with ``--scheduling-policy
  priority`` and declared so (``scheduling_policy: priority``); under vLLM's default
  ``fcfs`` the soft band and the boost do not act (architecture.md §3).
- **Client hints** (``CallHints``): a deadline shortens ``max_wait_s`` for its call, an
  expected output length replaces ``growth_reserve_tokens`` in its demand, a retention TTL is
  the program's dormancy cutoff for the tool call that follows.
- **Retention**: a placed or resumed program gets ``Retain`` (refreshed before its TTL
  runs out while it stays active, dormant or not); a paused one ``Demote``; a released one
  ``Release``.
- **Host tier** (``retention.host_tier``): a paused program gets ``Offload`` instead of
  ``Demote`` (its KV waits in host memory, most recent, rather than being lost), a resumed one
  whose KV the tier holds gets ``Prefetch`` (kept there until its call loads it back), and with
  ``offload_dormant`` a program turning dormant is offloaded too (no Retain refresh until its
  next call) and, with ``prefetch_predicted``, prefetched when its tool call is predicted to
  end (the median of recent tool calls longer than it has lasted so far). A paused program
  whose home still holds its KV (GPU or tier) resumes only there: elsewhere it would recompute
  what the home loads back; ``max_wait_s`` still bounds its wait. A worker none of whose
  programs is paused runs them all while their contexts add up to at most
  ``host_tier_overcommit`` GPU pools (its threshold is that, not ``pause_threshold``), and
  takes new programs by fewest calls in flight.
"""

from __future__ import annotations

import math

from scheduler.actions import Action, Admit, Decision, Demote, Mark, Offload, Pause, Prefetch, Retain
from scheduler.calls import CallRequest
from scheduler.config import ProgramAwareConfig
from scheduler.ledger import TokenWeights
from scheduler.programs import Phase, Program
from scheduler.policies.base import Call, Policy, hold
from scheduler.policies.parking import DeadlineHeap, Parking
from scheduler.resume_queue import IDLE, NEW, WAITING, ResumeQueue
from scheduler.tool_times import ToolTimes


class ProgramAwarePolicy(Policy):
    name = "program_aware"
    config: ProgramAwareConfig

    def __init__(self, config: ProgramAwareConfig) -> None:
        super().__init__(config)
        # PAUSED and PENDING programs (parked, with their force-resume deadlines) and idle
        # deadlines, shared in shape with thunderagent
        self._parking = Parking(self.programs, self.calls, self.ledger, self.stats, self._admit_waiting,
                                config.force_resume_after_s, config.idle_release_s,
                                config.growth_reserve_tokens)
        self._soft_band: frozenset[str] = frozenset()
        # session -> when its Retain lapses; (refresh at, session): when to re-send it
        self._retained_until: dict[str, float] = {}
        self._retain_refresh: DeadlineHeap[tuple[float, str]] = DeadlineHeap(
            self._retain_refresh_wanted, lambda: len(self.programs))
        self._retention_due: dict[str, None] = {}
        self._queue = ResumeQueue(config.resume_aging_halflife_s)
        # (deadline, request_id): when a held call reaches max_wait_s
        self._wait_deadlines: DeadlineHeap[tuple[float, str]] = DeadlineHeap(
            self._wait_deadline_wanted, lambda: len(self.calls))
        # (due, session, acting_since): when an ACTING program would count as dormant
        self._dormancy_checks: DeadlineHeap[tuple[float, str, float]] = DeadlineHeap(
            self._dormancy_check_wanted, lambda: len(self.programs))
        # (due, session, acting_since): when an offloaded dormant program's tool call is
        # predicted to end (its Prefetch is due then)
        self._predicted_ends: DeadlineHeap[tuple[float, str, float]] = DeadlineHeap(
            self._dormancy_check_wanted, lambda: len(self.programs))
        self._tool_times = ToolTimes(config.tool_time_window)
        # worker -> the session it drains for: a program too large for any worker's resume
        # limit, which no other program may be placed or resumed onto meanwhile
        self._reserved: dict[str, str] = {}
        # With a host tier: worker -> tokens of all programs homed there, and of the paused
        # ones (recounted at each tick and each new program's placement)
        self._homed_tokens: dict[str, int] = {}
        self._paused_tokens: dict[str, int] = {}

    def token_weights(self, config: ProgramAwareConfig) -> TokenWeights:  # type: ignore[override]
        return config

    def reconfigure(self, config: ProgramAwareConfig) -> None:  # type: ignore[override]
        halflife = self.config.resume_aging_halflife_s
        super().reconfigure(config)
        self._parking.reconfigure(config.force_resume_after_s, config.idle_release_s,
                                  config.growth_reserve_tokens)
        if config.resume_aging_halflife_s != halflife:
            # The resume order's keys depend on the half-life: rebuild it.
            self._queue = ResumeQueue(config.resume_aging_halflife_s)
            for session in self._parking.lot.sessions():
                self._requeue(self.programs[session])

    # -- arrivals and completions ----------------------------------------------------

    def _arrival_of_known(self, program: Program, call: Call, now: float) -> Decision | None:
        """An ACTIVE program's call goes home; a PAUSED one's waits. None: place it anew
        (the program is then PENDING and parked)."""
        if program.active and program.home_worker is not None:
            if self.ledger.worker(program.home_worker).healthy:
                retention = self.config.retention
                if (retention.enabled and retention.host_tier and retention.offload_dormant
                        and program.session_id not in self._retained_until):
                    self._retention_due[program.session_id] = None  # offloaded while dormant
                return self._admit(call, program.home_worker)
            self._unhome(program, now)
        if program.paused:
            return hold(call, "program paused")
        self._park(program, now)
        return None

    def decide_arrival(self, program: Program, call: Call, now: float) -> Decision:
        known = self._arrival_of_known(program, call, now)
        if known is not None:
            return known
        if program.waiting:
            return hold(call, "program waiting for room")
        if self._someone_waits(program):
            return hold(call, "queued behind waiting programs")
        worker = self._route_new(program, call)
        if worker is None:
            return hold(call, "no worker has room")
        self._unpark(program)
        self._retention_due[program.session_id] = None
        return self._admit(call, worker)

    def on_arrival(self, request: CallRequest, now: float) -> Decision:
        program = self.programs.get(request.session_id)
        if (self.config.dormant_quantile is not None and program is not None
                and program.acting_since is not None):
            self._tool_times.observe(now - program.acting_since)
        decision = super().on_arrival(request, now)
        if not isinstance(decision, Admit):
            self._requeue(self.programs[request.session_id])
            wait = self._longest_wait(request)
            if wait is not None:
                self._wait_deadlines.push((now + wait, request.request_id))
        return decision

    def _longest_wait(self, request: CallRequest) -> float | None:
        """How long a held call may wait before it goes ahead: ``max_wait_s``, shortened by
        the client's deadline (``CallHints.deadline_s``); None: until there is room."""
        deadline = request.hints.deadline_s if request.hints is not None else None
        if deadline is None:
            return self.config.max_wait_s
        if self.config.max_wait_s is None:
            return deadline
        return min(deadline, self.config.max_wait_s)

    def adaptive_settings(self) -> dict[str, float]:
        cutoff = self.tool_time_cutoff()
        return {} if cutoff is None else {"dormancy_cutoff_s": cutoff}

    def tool_time_cutoff(self) -> float | None:
        """Seconds in a tool call after which a program counts as dormant (None: not yet
        known, or dormancy off). Adapts to the traffic: a quantile of recent tool calls."""
        if self.config.dormant_quantile is None:
            return None
        quantile = self._tool_times.quantile(self.config.dormant_quantile)
        return None if quantile is None else max(self.config.dormant_min_s, quantile)

    def after_call(self, program: Program, now: float) -> list[Action]:
        if program.session_id in self._parking.lot:
            self._requeue(program)  # a re-homed program's call ended: its demand changed
        if program.in_flight:
            return []
        self._parking.note_idle(program, now)
        # the client's retention TTL says how long this tool call keeps the KV worth holding
        cutoff = program.retention_ttl_s if program.retention_ttl_s is not None else self.tool_time_cutoff()
        if cutoff is not None and program.active and program.acting_since is not None:
            self._dormancy_checks.push((program.acting_since + cutoff, program.session_id,
                                        program.acting_since))
        if program.marked and program.active:
            return self._pause_program(program, now)
        return []

    def on_abort(self, request_id: str, now: float) -> list[Action]:
        call = self.calls.get(request_id)
        actions = super().on_abort(request_id, now)
        if call is not None and call.worker is None:
            program = self.programs.get(call.session_id)
            if program is not None:
                self._requeue(program)  # its waiting demand changed
                self._parking.held_call_gone(program)
        return actions

    def release(self, session_id, now, reason):  # type: ignore[override]
        actions = super().release(session_id, now, reason)
        self._parking.forget(session_id)
        self._queue.discard(session_id)
        self._retained_until.pop(session_id, None)
        self._retention_due.pop(session_id, None)
        for heap in (self._retain_refresh, self._wait_deadlines, self._dormancy_checks,
                     self._predicted_ends):
            heap.trim()
        return actions

    def _unhome(self, program: Program, now: float) -> list[Action]:
        was_active = program.active
        actions = super()._unhome(program, now)
        if was_active:
            self._park(program, now)
        return actions

    # -- the tick --------------------------------------------------------------------

    def forget_worker(self, name: str) -> None:
        self._reserved.pop(name, None)
        self._paused_tokens.pop(name, None)
        self._homed_tokens.pop(name, None)

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        actions += self._release_idle(now)
        self._count_homed_tokens()
        actions += self._mark_dormant(now)
        actions += self._prefetch_predicted(now)
        actions += self._overdue(now)
        actions += self._resume(now)
        actions += self._pause(now)
        self._update_soft_band()
        actions += self._retention(now)
        return actions

    def _mark_dormant(self, now: float) -> list[Action]:
        """ACTING programs past the tool-time cutoff stop counting in U. Their KV keeps its
        retention: among retained KV the engine's LRU takes theirs first anyway, and
        demoting it measured worse (docs/design-notes.md "Policy v2"). With a host tier and
        ``offload_dormant`` it is offloaded instead: host memory holds it until the call."""
        retention = self.config.retention
        offload = retention.enabled and retention.host_tier and retention.offload_dormant
        actions: list[Action] = []
        for _, session, since in self._dormancy_checks.pop_due(now):
            program = self.programs.get(session)
            if (program is None or not program.active or program.phase is not Phase.ACTING
                    or program.acting_since != since or self.ledger.is_dormant(session)):
                continue  # reasoning again, paused or gone since the check was set
            self.ledger.set_dormant(program)
            self.stats.dormant += 1
            if offload and program.home_worker is not None:
                self._retained_until.pop(session, None)  # no refresh: its next call retains it
                actions.append(Offload(program.session_id, program.home_worker, self._head(program)))
                if retention.prefetch_predicted:
                    predicted = self._tool_times.median_beyond(now - since)
                    if predicted is not None:
                        self._predicted_ends.push((since + predicted, session, since))
        return actions

    def _prefetch_predicted(self, now: float) -> list[Action]:
        """Prefetch the offloaded dormant programs whose tool call is predicted to have
        ended by now (still in the same tool call, still at home)."""
        retention = self.config.retention
        actions: list[Action] = []
        for _, session, since in self._predicted_ends.pop_due(now):
            program = self.programs.get(session)
            if (program is None or not program.active or program.phase is not Phase.ACTING
                    or program.acting_since != since or program.home_worker is None):
                continue  # its call came, or it was paused or released, meanwhile
            actions.append(Prefetch(session, program.home_worker, retention.prefetch_priority,
                                    self._head(program), retention.prefetch_deadline_s))
        return actions

    @staticmethod
    def _head(program: Program):
        return program.chain.head if program.chain is not None else None

    def _overdue(self, now: float) -> list[Action]:
        """Bounded waiting: a call held ``max_wait_s`` goes ahead with its program, room or
        not (home first: its KV may be there). Retried at every tick while no worker
        accepts programs (a worker may come back between two ticks)."""
        actions: list[Action] = []
        retry: list[tuple[float, str]] = []
        room: dict[str, float] | None = None  # kept across this tick's forced resumes
        for entry in self._wait_deadlines.pop_due(now):
            call = self.calls.get(entry[1])
            if call is None or call.worker is not None:
                continue  # admitted or gone
            program = self.programs[call.session_id]
            if room is None:
                room = self._parking.free_room()
            resumed = self._force_resume(program, now, room)
            if resumed:
                worker = program.home_worker
                if worker in room:  # only its worker's room changed
                    capacity = self.ledger.worker(worker).capacity_tokens
                    room[worker] = capacity - self.ledger.load_tokens(worker)
                self.stats.wait_limit_resumes += 1
                actions += resumed
            else:
                retry.append(entry)  # overdue still: due again at the very next tick
        for entry in retry:
            self._wait_deadlines.push(entry)
        return actions

    def _release_idle(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for session in self._parking.idle_sessions(now):
            actions += self.release(session, now, "idle")
        return actions

    # -- resume ----------------------------------------------------------------------

    def _resume(self, now: float) -> list[Action]:
        actions = self._force_due(now)
        actions += self._serve_reservation(now)
        queue = self._queue
        if not len(queue):
            return actions
        limit = self._highest_threshold() - self.config.resume_hysteresis
        buffer = self.config.buffer_per_program
        headroom = self._max_headroom(limit)
        smallest = queue.min_demand()
        if smallest is None or smallest + buffer > headroom:
            return actions
        for session, demand in queue.in_order():
            if demand + buffer > headroom or session not in queue:
                continue
            program = self.programs[session]
            worker = self._resume_target(program, demand)
            if worker is None:
                continue
            actions += self._resume_program(program, worker, now, forced=False)
            headroom = self._max_headroom(limit)
            smallest = queue.min_demand()
            if smallest is None or smallest + buffer > headroom:
                break
        return actions

    def _serve_reservation(self, now: float) -> list[Action]:
        """A waiting program larger than any worker's resume limit would only ever run by a
        forced resume. Reserve a worker for it (its home, else the largest): nothing else is
        placed there, and it resumes as soon as it fits under the resume limit or, forced,
        once nothing there is reasoning any more (the worker has drained all it can). One
        reservation at a time: the first such program in the resume order."""
        for worker, session in list(self._reserved.items()):
            program = self.programs.get(session)
            load = self.ledger.worker(worker)
            if program is None or program.active or not program.waiting or not load.accepts_programs:
                del self._reserved[worker]
                continue
            demand = self._parking.demand_when_resumed(program)
            reasoning = any(self.programs[s].in_flight for s in load.programs)
            fits = self._fits(worker, demand, self.config.pause_threshold - self.config.resume_hysteresis)
            if fits or not reasoning:
                del self._reserved[worker]
                return self._resume_program(program, worker, now, forced=not fits)
            return []
        limit = self.config.pause_threshold - self.config.resume_hysteresis
        largest = max((load.capacity_tokens for load in self.ledger.workers() if load.accepts_programs),
                      default=0)
        if not largest:
            return []  # no worker takes programs: nothing to reserve
        biggest = self._queue.largest_waiting_demand()
        if biggest is None or biggest + self.config.buffer_per_program <= limit * largest:
            return []  # every waiting program fits somewhere: no need to walk the queue
        for session, demand in self._queue.in_order():
            program = self.programs[session]
            if not program.waiting:
                break  # the waiting groups come first
            if demand + self.config.buffer_per_program > limit * largest:
                home = program.home_worker
                if home is None or not self.ledger.worker(home).accepts_programs:
                    home = max((load for load in self.ledger.workers() if load.accepts_programs),
                               key=lambda load: (load.capacity_tokens, load.name)).name
                self._reserved[home] = session
                break
        return []

    def _open_to(self, worker: str, program: Program) -> bool:
        """Whether ``program`` may be placed or resumed on ``worker`` (not reserved for another)."""
        holder = self._reserved.get(worker)
        return holder is None or holder == program.session_id

    def _force_due(self, now: float) -> list[Action]:
        """Resume every program parked for ``force_resume_after_s``, room or not."""
        actions: list[Action] = []
        lot = self._parking.lot
        retry = []
        for entry in lot.due(now):
            resumed = self._force_resume(self.programs[entry[1]], now)
            if resumed:
                actions += resumed
            else:
                retry.append(entry)  # nothing to run yet, or no worker: try again next tick
        for entry in retry:
            lot.retry(entry)
        return actions

    def _resume_target(self, program: Program, weighted: float) -> str | None:
        if self._anchored_home(program):
            home = program.home_worker
            return home if self._open_to(home, program) and self._resumable(home, program, weighted) else None
        preferred = [program.home_worker]
        if program.parent_session_id is not None:
            parent = self.programs.get(program.parent_session_id)
            if parent is not None:
                preferred.append(parent.home_worker)

        for worker in preferred:
            if worker is not None and self._open_to(worker, program) and self._resumable(worker, program, weighted):
                return worker
        best, best_u = None, -math.inf
        for load in self.ledger.workers():
            if not load.accepts_programs or not self._open_to(load.name, program):
                continue
            u = self.ledger.utilization_with(load.name, weighted)
            if u > best_u and self._resumable(load.name, program, weighted):
                best, best_u = load.name, u
        return best

    def _resumable(self, worker: str, program: Program, weighted: float) -> bool:
        """Whether ``program`` fits on ``worker`` under its resume limit (its pause threshold
        less ``resume_hysteresis``)."""
        counted = program.paused and program.home_worker == worker  # among its paused tokens
        newcomer = 0 if counted else int(weighted)
        limit = self._threshold(worker, newcomer) - self.config.resume_hysteresis
        return self._fits(worker, weighted, limit)

    def _anchored_home(self, program: Program) -> bool:
        """With a host tier, a program whose home still holds its KV (on the GPU or in the
        tier) waits for room there: resuming it elsewhere would recompute what the home can
        load back (measured: most of program_aware's re-prefill with the tier came from such
        moves). ``max_wait_s`` still bounds the wait (a forced resume goes home)."""
        home = program.home_worker
        if home is None or not self.config.retention.host_tier:
            return False
        if not self.ledger.worker(home).accepts_programs:
            return False
        index = self.index
        return index.host_tokens(home, program.session_id) > 0 or index.session_tokens(home, program.session_id) > 0

    def _force_resume(self, program: Program, now: float,
                      room: dict[str, float] | None = None) -> list[Action]:
        """``room``: each accepting worker's free tokens, when the caller keeps them (a tick
        that forces many resumes would otherwise re-sum every worker for each)."""
        worker = self._parking.force_target(program, room)
        if worker is None:
            return []
        return self._resume_program(program, worker, now, forced=True)

    def _resume_program(self, program: Program, worker: str, now: float, forced: bool) -> list[Action]:
        self._retention_due[program.session_id] = None
        self._queue.discard(program.session_id)
        was_paused = program.paused
        actions = self._parking.resume(program, worker, now, forced, self.config.resume_priority_boost_s)
        retention = self.config.retention
        if (was_paused and retention.enabled and retention.host_tier
                and self.index.host_tokens(worker, program.session_id) > 0):
            # its calls were just admitted; the tier keeps its KV until they load it
            actions.insert(0, Prefetch(program.session_id, worker, retention.prefetch_priority,
                                       self._head(program), retention.prefetch_deadline_s))
        return actions

    # -- pause -----------------------------------------------------------------------

    def _pause(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for load in self.ledger.workers():
            threshold, target = self._threshold(load.name), self.config.pause_target
            if not load.capacity_tokens or self.ledger.utilization(load.name) < threshold:
                continue
            capacity = load.capacity_tokens
            on_worker = [self.programs[s] for s in load.programs]
            # Pausing ACTING programs marks none, so the marked share stays what it is here.
            marked = self._marked_tokens(load.name) / capacity
            projected = self.ledger.utilization(load.name) - marked
            if projected <= target:
                continue
            acting = sorted(
                (p for p in on_worker if p.phase is Phase.ACTING),
                key=lambda p: (self.ledger.contribution(p.session_id), p.session_id),
            )
            for program in acting:
                if projected <= target:
                    break
                actions += self._pause_program(program, now)
                projected = self.ledger.utilization(load.name) - marked
            if projected <= target:
                continue
            reasoning = sorted(
                (p for p in on_worker if p.phase is Phase.REASONING and not p.marked),
                key=lambda p: (self.ledger.contribution(p.session_id), p.session_id),
            )
            for program in reasoning:
                if projected <= target:
                    break
                program.mark()
                self.stats.marks += 1
                projected -= self.ledger.contribution(program.session_id) / capacity
                actions.append(Mark(program.session_id, load.name))
        return actions

    def _pause_program(self, program: Program, now: float) -> list[Action]:
        worker = self._parking.pause(program, now)
        if self.config.retention.host_tier:
            self._paused_tokens[worker] = self._paused_tokens.get(worker, 0) + program.demand_tokens()
        self._requeue(program)
        self._retained_until.pop(program.session_id, None)
        actions: list[Action] = [Pause(program.session_id, worker)]
        retention = self.config.retention
        if retention.enabled and retention.host_tier:
            actions.append(Offload(program.session_id, worker, self._head(program)))
        elif retention.enabled:
            actions.append(Demote(program.session_id, worker))
        return actions

    def projected_utilization(self, worker: str) -> float:
        """``U_w`` with marked programs' tokens counted as already gone (what a pause pass
        brings down to ``pause_target``)."""
        load = self.ledger.worker(worker)
        if not load.capacity_tokens:
            return math.inf
        return self.ledger.utilization(worker) - self._marked_tokens(worker) / load.capacity_tokens

    def _marked_tokens(self, worker: str) -> float:
        programs = self.programs
        return sum(self.ledger.contribution(s) for s in self.ledger.worker(worker).programs
                   if programs[s].marked)

    # -- soft band and retention -------------------------------------------------------

    def _update_soft_band(self) -> None:
        low, high = self.config.pause_target, self.config.pause_threshold
        self._soft_band = frozenset(
            load.name
            for load in self.ledger.workers()
            if load.capacity_tokens and low <= self.ledger.utilization(load.name) < high
            and not self._runs_all(load.name)
        )

    def in_soft_band(self, worker: str) -> bool:
        return worker in self._soft_band

    def _retention(self, now: float) -> list[Action]:
        retention = self.config.retention
        if not retention.enabled:
            self._retention_due.clear()
            return []
        actions: list[Action] = []
        heap = self._retain_refresh
        for _, session in heap.pop_due(now):
            if session in self._retained_until and self._retained_until[session] - now <= (
                retention.ttl_s * retention.refresh_fraction
            ):
                self._retention_due[session] = None
        for session in self._retention_due:
            program = self.programs.get(session)
            if program is None or not program.active or program.home_worker is None:
                continue
            head = program.chain.head if program.chain is not None else None
            actions.append(
                Retain(session, program.home_worker, retention.active_priority, retention.ttl_s, head)
            )
            self._retained_until[session] = now + retention.ttl_s
            refresh_at = now + retention.ttl_s * (1.0 - retention.refresh_fraction)
            heap.push((refresh_at, session))
        self._retention_due.clear()
        return actions

    # -- placement helpers -----------------------------------------------------------

    def _admit(self, call: Call, worker: str) -> Admit:
        delay = self.config.soft_band_delay_s if worker in self._soft_band else 0.0
        return Admit(call.request.request_id, call.session_id, worker, call.arrived_at + delay)

    def _route_new(self, program: Program, call: Call) -> str | None:
        request = call.request
        demand = max(program.demand_tokens(),
                     request.prompt_tokens + request.growth_reserve(self.config.growth_reserve_tokens))
        if self.config.retention.host_tier:
            self._count_homed_tokens()  # arrivals come between ticks
        if program.parent_session_id is not None:
            parent = self.programs.get(program.parent_session_id)
            if parent is not None and parent.home_worker is not None:
                home = parent.home_worker
                if self._open_to(home, program) and self._fits(home, demand, self._threshold(home, demand)):
                    return home
        in_flight = self.calls_in_flight() if self.config.retention.host_tier else {}
        best, best_score = None, None
        for load in self.ledger.workers():
            if not load.accepts_programs or not self._open_to(load.name, program):
                continue
            u_after = self.ledger.utilization_with(load.name, demand)
            if u_after > self._threshold(load.name, demand):
                continue
            score: tuple[float, ...]
            if self._runs_all(load.name, demand):
                # KV does not bind a worker that runs all its programs (the tier takes the
                # overflow), its compute does: fewest calls in flight, as least_loaded
                # (measured at CC256: 3624 against 3589 tok/s by prefix credit − U)
                score = (1, -in_flight.get(load.name, 0), -self.ledger.utilization(load.name))
            else:
                credit = self.prefix_credit(load.name, call) - self.ledger.utilization(load.name)
                if load.name in self._soft_band:
                    credit -= self.config.soft_band_delay_s
                score = (0, credit)
            if best_score is None or score > best_score:
                best, best_score = load.name, score
        return best

    def prefix_credit(self, worker: str, call: Call) -> float:
        """The call's prompt tokens already resident on ``worker``, as a share of the
        worker's capacity: the same unit as ``U``, so credit and load trade off token for
        token. (A share of the *prompt* would let a system prompt cached everywhere outweigh
        any load difference and pile new programs onto the first worker that cached it.)
        Besides what the index knows, the prompt a group sibling running there shares with
        the call counts (:meth:`_sibling_prefix`)."""
        capacity = self.ledger.worker(worker).capacity_tokens
        if not capacity:
            return 0.0
        resident = self.resident_prefix(worker, call)
        request = call.request
        if request.group_id is not None and resident < request.prompt_tokens:
            resident = max(resident, self._sibling_prefix(worker, call))
        return resident / capacity

    def _sibling_prefix(self, worker: str, call: Call) -> int:
        """Prompt tokens the call shares with an active program of its group homed on
        ``worker`` (by their continuation chains): the samples of one GRPO prompt arrive
        together, before the engine has reported any of their blocks, and without this they
        would scatter by load alone, each prefilling the shared prompt on its own worker.
        (The simulator publishes a step's KV events as it starts, so there the index knows
        a sibling's blocks already and this adds nothing: rl_swe CC512 measured the same to
        the token with and without it; the gateway hears them milliseconds later.)"""
        request = call.request
        chain, tokens = request.chain, request.chain_tokens
        if chain is None or tokens is None:
            return 0
        best = 0
        for session in self.groups.get(request.group_id, ()):  # type: ignore[arg-type]
            sibling = self.programs[session]
            if (session == request.session_id or sibling.home_worker != worker
                    or not sibling.active or sibling.chain is None):
                continue
            shared = chain.common_prefix_len(sibling.chain)
            if shared:
                best = max(best, tokens[shared - 1])
        return min(best, request.prompt_tokens)

    def _threshold(self, worker: str, newcomer: int = 0) -> float:
        """The pause threshold of ``worker`` (what placing ``newcomer`` tokens more there
        may reach): ``host_tier_overcommit`` while it runs all its programs, else
        ``pause_threshold``."""
        if self._runs_all(worker, newcomer):
            return self.config.host_tier_overcommit
        return self.config.pause_threshold

    def _runs_all(self, worker: str, newcomer: int = 0) -> bool:
        """With a host tier, a worker none of whose programs is paused runs them all while
        their contexts — dormant ones included — and ``newcomer`` tokens more add up to at
        most ``host_tier_overcommit`` times its GPU pool: what overflows the GPU waits in the
        tier, cheaper than waiting for room (measured: at CC256 the programs homed on a worker
        add up to 0.9–2.3 pools, and running them all beats pausing any). Once
        it has had to pause, some wait anyway, and ``pause_threshold`` keeps the active ones
        to what its GPU runs without thrashing until every program it paused is back (without
        that hysteresis a worker near the limit flips between the two every few ticks:
        measured 105k pauses in 30 min at CC512)."""
        config = self.config
        if not config.retention.host_tier or self._paused_tokens.get(worker, 0):
            return False
        capacity = self.ledger.worker(worker).capacity_tokens
        return self._homed_tokens.get(worker, 0) + newcomer <= config.host_tier_overcommit * capacity

    def _highest_threshold(self) -> float:
        if self.config.retention.host_tier:
            return max(self.config.pause_threshold, self.config.host_tier_overcommit)
        return self.config.pause_threshold

    def _count_homed_tokens(self) -> None:
        if not self.config.retention.host_tier:
            return
        homed: dict[str, int] = {}
        paused: dict[str, int] = {}
        for program in self.programs.values():
            home = program.home_worker
            if home is not None:
                tokens = program.demand_tokens()
                homed[home] = homed.get(home, 0) + tokens
                if program.paused:
                    paused[home] = paused.get(home, 0) + tokens
        self._homed_tokens, self._paused_tokens = homed, paused

    def _fits(self, worker: str, demand: float, limit: float) -> bool:
        load = self.ledger.worker(worker)
        return load.accepts_programs and self.ledger.utilization_with(worker, demand) <= limit

    def _max_headroom(self, limit: float) -> float:
        best = 0.0
        for load in self.ledger.workers():
            if load.accepts_programs:
                best = max(best, limit * load.capacity_tokens - self.ledger.load_tokens(load.name))
        return best

    def _someone_waits(self, program: Program) -> bool:
        own = 1 if program.session_id in self._queue and program.waiting else 0
        return self._queue.with_calls - own > 0

    def _park(self, program: Program, now: float) -> None:
        self._parking.lot.park(program.session_id, now)
        self._requeue(program)

    def _unpark(self, program: Program) -> None:
        self._parking.lot.unpark(program.session_id)
        self._queue.discard(program.session_id)

    def _requeue(self, program: Program) -> None:
        """Put a parked program at its place in the resume order (or take it out)."""
        session = program.session_id
        since = self._parking.lot.since(session)
        if since is None or (program.pending and not program.waiting):
            self._queue.discard(session)  # not parked, or nothing to run yet
            return
        demand = self._parking.demand_when_resumed(program)
        if program.waiting:
            group = WAITING if program.paused else NEW
        else:
            group = IDLE
            demand = int(demand * self.config.acting_token_weight)
        self._queue.put(session, group, demand, since, program.priority)

    # -- which lazily validated deadlines still matter (see DeadlineHeap) --------------------

    def _wait_deadline_wanted(self, entry: tuple[float, str]) -> bool:
        call = self.calls.get(entry[1])
        return call is not None and call.worker is None

    def _dormancy_check_wanted(self, entry: tuple[float, str, float]) -> bool:
        program = self.programs.get(entry[1])
        return program is not None and program.acting_since == entry[2]

    def _retain_refresh_wanted(self, entry: tuple[float, str]) -> bool:
        # the latest refresh of a retained session is due at or after its Retain was sent
        until = self._retained_until.get(entry[1])
        return until is not None and entry[0] >= until - self.config.retention.ttl_s
