"""The shell around a :class:`~scheduler.policies.base.Policy`: it feeds observations in and
carries out what comes back; it decides nothing itself.

- Every policy call runs under one lock, with ``now`` from the injected clock.
- A held call waits on its own :class:`anyio.Event` (no polling) until an :class:`Admit`
  for its request id comes back from a later completion, abort or tick.
- A periodic tick runs every ``policy.tick_interval_s`` (re-read each time, so a hot reload
  applies), and one runs after each completion or abort when the policy asks for it
  (``ticks_after_completion``).
- Actions: ``Admit`` wakes its waiter with the worker; ``Release`` refuses the released
  program's held calls (503) and, like ``Retain``/``Demote``/``Offload``/``Prefetch``, goes
  to the :class:`DirectiveSink` (the gateway's is the directive sender,
  controller/directives.py); ``Pause``/``Resume``/``Mark`` are logged (the policy counts
  them in its stats).
- A waiter cancelled (its client went away) is aborted in the policy: a held call simply
  disappears, one admitted meanwhile ends without usage.
- Bounds (``limits:``): a call that would start a program past ``max_programs``, or be held
  past ``max_held_calls``, is refused with 429; one held ``max_hold_s`` gets 503. Both carry
  ``Retry-After`` and are counted in :attr:`Admission.refusals`. With client keys
  (controller/client_keys.py), a key's own ``max_programs`` and ``max_held_calls`` bound
  the programs it owns and its calls held, on top of them (429, counted as
  ``client_max_programs`` / ``client_max_held_calls``).
- A policy error is that call's failure, never a silent divergence: the exception is
  logged with its context and counted (:attr:`Admission.core_errors`), and the shell then
  reconciles its view with the policy's (:meth:`Admission.disagreements` lists what differs):
  a waiter the policy dispatched without saying so is woken, one the policy forgot is
  refused with 500, a call the policy tracks but the shell does not is aborted in the policy.
  An arrival that fails is a 500; a completion that fails still delivers the answer, which
  is already computed, and the call is retired.

**Invariants** (cited where kept):

1. Every policy call that can change it runs under the admission lock, so it sees one
   operation at a time, each with its own ``now``; reads (:meth:`Admission.snapshot`,
   ``program_view``, ``calls_on``) are taken in one go on the event loop's thread.
2. The shell and the policy agree on the calls: every held call (a waiter) is held in the
   policy, every dispatched one dispatched there, and the policy tracks no call the shell
   does not. A policy error is the one way it can break; :meth:`Admission._reconcile`
   restores it, and :meth:`Admission.disagreements` lists where it does not hold.
3. The policy's workers are the fleet's: a KV batch or reset for a worker not (or no
   longer) entered is dropped (:meth:`Admission.observe_kv`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

import anyio

from controller.client_keys import ClientKey, ClientKeys
from controller.errors import INTERNAL, RATE_LIMITED, UNAVAILABLE, GatewayError
from controller.serve_config import LimitsConfig, WorkerConfig
from scheduler.actions import Action, Admit, Directive, Hold, Mark, Pause, Release, Resume, engine_priority
from scheduler.calls import CallRequest, Usage
from scheduler.config import PolicyConfig
from scheduler.kv_events import EventBatch
from scheduler.policies.base import Policy, UnknownCall
from scheduler.snapshot import PolicySnapshot, ProgramView


# A learnt policy setting is logged again once it moves by more than this share.
ADAPTIVE_LOG_CHANGE = 0.1

class DirectiveSink:
    """Where retention directives go: counted by kind (the ``sluice_directives_sent``
    metric) and logged at debug level. The gateway's sink is its subclass, the directive
    sender (controller/directives.py), which also sends each to its worker's engine plugin;
    this base sink alone sends nothing anywhere (an :class:`Admission` built without a sink,
    as in tests, gets it). ``send`` must not block: it is called under the admission lock.
    Workers come and go with :meth:`add` and :meth:`remove` (here: nothing to open; the
    sender opens and closes a socket)."""

    def __init__(self, log: Any | None = None) -> None:
        self._log = log
        self.sent: dict[str, int] = {"retain": 0, "demote": 0, "release": 0}
        self.dropped: dict[str, int] = {}  # worker -> directives that could not be queued

    def add(self, worker: WorkerConfig) -> None:
        """A worker joined the fleet."""

    def remove(self, worker: str) -> None:
        """A worker left the fleet: its count of dropped directives goes with it."""
        self.dropped.pop(worker, None)

    def send(self, action: Directive) -> None:
        kind = type(action).__name__.lower()
        self.sent[kind] = self.sent.get(kind, 0) + 1
        if self._log is not None:
            self._log.debug("directive", kind=kind, session_id=action.session_id,
                            worker=action.worker)

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Admitted:
    """Where a call goes, its place in the engine's queue, and how long Sluice held it."""

    worker: str
    priority: float     # the Admit's: policy-clock time the call counts as arrived
    admitted_at: float  # the policy's ``now`` when it was admitted (the dispatch)
    held_s: float

    @property
    def engine_priority(self) -> int:
        """What the request to a worker started with ``--scheduling-policy priority`` carries
        (the simulator gives its engines the same: scheduler/actions.py)."""
        return engine_priority(self.priority, self.admitted_at)


def hold_shorter_than_wait(limits: LimitsConfig, policy: PolicyConfig) -> dict[str, float] | None:
    """The figures of a config whose ``limits.max_hold_s`` ends a held call before the
    policy's longest wait would let it go ahead (``max_wait_s`` × ``max_wait_stretch``):
    under deep overload its clients would get 503s instead of their programs resumed. None
    when the hold outlasts the wait, or the policy has no such bound."""
    max_wait = getattr(policy, "max_wait_s", None)
    if max_wait is None:
        return None
    longest_wait = max_wait * getattr(policy, "max_wait_stretch", 1.0)
    if limits.max_hold_s >= longest_wait:
        return None
    return {"max_hold_s": limits.max_hold_s, "max_wait_s": max_wait,
            "longest_wait_s": round(longest_wait, 3)}


def warn_if_hold_shorter_than_wait(log: Any, limits: LimitsConfig, policy: PolicyConfig) -> None:
    figures = hold_shorter_than_wait(limits, policy)
    if figures is not None:
        log.warning("limits.max_hold_s is shorter than the policy's longest wait "
                    "(policy.max_wait_s × policy.max_wait_stretch): under deep overload held "
                    "calls get 503 before their programs are resumed", **figures)


class _Waiter:
    __slots__ = ("request", "event", "outcome", "held_at", "client")

    def __init__(self, request: CallRequest, held_at: float, client: str | None = None) -> None:
        self.request = request
        self.event = anyio.Event()
        self.outcome: Admitted | GatewayError | None = None
        self.held_at = held_at
        self.client = client  # the name of the client key whose call it is (None: no keys)


class Admission:
    def __init__(self, policy: Policy, *, clock: Callable[[], float], log: Any,
                 sink: DirectiveSink | None = None, limits: LimitsConfig | None = None,
                 clients: ClientKeys | None = None) -> None:
        self.policy = policy
        self._clock = clock
        self._log = log
        self.sink = sink if sink is not None else DirectiveSink(log)
        self.limits = limits if limits is not None else LimitsConfig()
        # The client keys and the sessions they own; None: the gateway has no keys.
        self.clients = clients
        self._held_by_client: dict[str, int] = {}  # key name -> its calls held now
        # Every policy call that can change it holds this (invariant 1). fast_acquire: an
        # uncontended lock is taken without yielding to the event loop (measured: ~14 us
        # less per call, and no extra scheduling turn per call under load).
        self._lock = anyio.Lock(fast_acquire=True)
        self._waiters: dict[str, _Waiter] = {}
        # Calls admitted to a worker whose completion or abort the policy has not heard yet.
        self._dispatched: set[str] = set()
        # The workers entered in the policy (add_worker, not yet remove_worker).
        self._workers: set[str] = set()
        self._tick_after = getattr(policy, "ticks_after_completion", True)
        self._adaptive_logged: dict[str, float] = {}
        self.refusals: dict[str, int] = {"max_programs": 0, "max_held_calls": 0, "max_hold_s": 0}
        self.core_errors: dict[str, int] = {}

    @property
    def held(self) -> int:
        return len(self._waiters)

    # -- calls -------------------------------------------------------------------------

    async def arrive(self, request: CallRequest) -> Admitted:
        """Admit ``request`` now or wait until the policy admits it. Raises GatewayError:
        429 past ``max_programs`` / ``max_held_calls`` (the global ones, or its key's own),
        503 when its program is released while it waits or it waited ``max_hold_s``, 500 when
        the policy fails on it.
        Cancelling the wait (the client went away) aborts the call in the policy."""
        limits = self.limits
        async with self._lock:
            now = self._clock()
            if (not self.policy.has_program(request.session_id)
                    and self.policy.program_count() >= limits.max_programs):
                raise self._refuse("max_programs", 429, f"the gateway tracks {limits.max_programs} "
                                   "programs, its limit (limits.max_programs); retry later")
            client = self.clients.owner(request.session_id) if self.clients is not None else None
            if client is not None:
                self._check_client_programs(client, request)
            try:
                decision = self.policy.on_arrival(request, now)
            except Exception as err:
                self._core_failed("on_arrival", err, now, request_id=request.request_id,
                                  session_id=request.session_id)
                raise GatewayError(500, "internal error in the scheduling policy; the call was "
                                   "not run", INTERNAL) from None
            if isinstance(decision, Admit):
                self._dispatched.add(request.request_id)
                return Admitted(decision.worker, decision.priority, now, 0.0)
            if len(self._waiters) >= limits.max_held_calls:
                self._forget(request.request_id, now)
                raise self._refuse("max_held_calls", 429, f"{limits.max_held_calls} calls are "
                                   "held already, the limit (limits.max_held_calls); retry later")
            if (client is not None and client.max_held_calls is not None
                    and self._held_by_client.get(client.name, 0) >= client.max_held_calls):
                self._forget(request.request_id, now)
                raise self._refuse("client_max_held_calls", 429, f"{client.max_held_calls} calls "
                                   f"of the client key {client.name} are held already, its limit "
                                   "(max_held_calls of clients:); retry later")
            waiter = _Waiter(request, now, client.name if client is not None else None)
            self._hold(waiter)
            self._log.info("call held", request_id=request.request_id,
                           session_id=request.session_id, reason=decision.reason)
        try:
            with anyio.move_on_after(limits.max_hold_s):
                await waiter.event.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abandon(waiter)
            raise
        if waiter.outcome is None:  # held max_hold_s (unless admitted while we took the lock)
            with anyio.CancelScope(shield=True):
                gave_up = await self._give_up(waiter)
            if gave_up:
                raise self._refuse("max_hold_s", 503, f"the call was held {limits.max_hold_s:g} s "
                                   "without room on any worker (limits.max_hold_s); retry later")
        outcome = waiter.outcome
        if isinstance(outcome, GatewayError):
            raise outcome
        return outcome

    def _check_client_programs(self, client: ClientKey, request: CallRequest) -> None:
        """429 when ``request`` would start one program more than its key may own."""
        assert self.clients is not None
        if client.max_programs is None or self.policy.has_program(request.session_id):
            return
        # Under the lock (invariant 1): programs start only here, so the count is exact.
        if self.clients.programs_of(client, self.policy.has_program) >= client.max_programs:
            raise self._refuse("client_max_programs", 429, f"the client key {client.name} owns "
                               f"{client.max_programs} programs, its limit (max_programs of "
                               "clients:); retry later")

    def _hold(self, waiter: _Waiter) -> None:
        self._waiters[waiter.request.request_id] = waiter
        if waiter.client is not None:
            self._held_by_client[waiter.client] = self._held_by_client.get(waiter.client, 0) + 1

    def _unhold(self, request_id: str) -> _Waiter | None:
        """Take a call out of the held ones (woken, refused, given up or abandoned)."""
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and waiter.client is not None:
            left = self._held_by_client[waiter.client] - 1
            if left:
                self._held_by_client[waiter.client] = left
            else:
                del self._held_by_client[waiter.client]
        return waiter

    def _refuse(self, limit: str, status: int, message: str) -> GatewayError:
        # .get: the client_* limits appear in the counts (and metrics) once they refuse
        self.refusals[limit] = self.refusals.get(limit, 0) + 1
        self._log.warning("call refused", limit=limit, status=status)
        return GatewayError(status, message, RATE_LIMITED if status == 429 else UNAVAILABLE,
                            retry_after_s=self.limits.retry_after_s)

    async def complete(self, request_id: str, usage: Usage) -> None:
        async with self._lock:
            now = self._clock()
            self._dispatched.discard(request_id)
            try:
                actions = self.policy.on_complete(request_id, usage, now)
            except UnknownCall:
                self._log.error("completion of an unknown call", request_id=request_id)
                return
            except Exception as err:
                self._core_failed("on_complete", err, now, request_id=request_id)
                return
            if self._tick_after:
                actions += self._tick(now)
            self._carry_out(actions, now)

    async def abort(self, request_id: str) -> None:
        """A dispatched call ended without a usable response (error or disconnect)."""
        async with self._lock:
            now = self._clock()
            self._dispatched.discard(request_id)
            try:
                actions = self.policy.on_abort(request_id, now)
            except UnknownCall:
                self._log.error("abort of an unknown call", request_id=request_id)
                return
            except Exception as err:
                self._core_failed("on_abort", err, now, request_id=request_id)
                return
            if self._tick_after:
                actions += self._tick(now)
            self._carry_out(actions, now)

    async def _abandon(self, waiter: _Waiter) -> None:
        request_id = waiter.request.request_id
        async with self._lock:
            now = self._clock()
            outcome = waiter.outcome
            if isinstance(outcome, GatewayError):
                return  # refused: the policy dropped it already
            if outcome is None:
                self._unhold(request_id)
            else:
                self._dispatched.discard(request_id)
            self._log.info("client left", request_id=request_id,
                           session_id=waiter.request.session_id,
                           state="held" if outcome is None else "admitted")
            try:
                actions = self.policy.on_abort(request_id, now)
            except UnknownCall:
                self._log.error("abort of an unknown call", request_id=request_id)
                return
            except Exception as err:
                self._core_failed("on_abort", err, now, request_id=request_id)
                return
            if outcome is not None and self._tick_after:
                actions += self._tick(now)
            self._carry_out(actions, now)

    async def _give_up(self, waiter: _Waiter) -> bool:
        """Stop holding a call that waited too long; False when it was admitted or refused
        meanwhile (then its outcome stands)."""
        async with self._lock:
            if waiter.outcome is not None:
                return False
            self._unhold(waiter.request.request_id)
            self._forget(waiter.request.request_id, self._clock())
            return True

    def _forget(self, request_id: str, now: float) -> None:
        """Take a call the shell will not carry out back out of the policy."""
        try:
            self._carry_out(self.policy.on_abort(request_id, now), now)
        except UnknownCall:
            pass  # the policy never recorded it: nothing to take back
        except Exception as err:
            self._core_failed("on_abort", err, now, request_id=request_id)

    # -- policy errors ---------------------------------------------------------------------

    def _tick(self, now: float) -> list[Action]:
        try:
            return self.policy.tick(now)
        except Exception as err:
            self._core_failed("tick", err, now)
            return []

    def _core_failed(self, operation: str, err: BaseException, now: float, **context: Any) -> None:
        """Count and log a policy error, then make the shell and the policy agree again."""
        self._count_core_error(operation)
        self._log.error("policy error", operation=operation, policy=self.policy.name,
                        programs=self.policy.program_count(), held=self.held,
                        exc_info=err, **context)
        self._reconcile(now)

    def _reconcile(self, now: float) -> None:
        """Make the shell's calls the policy's again after a policy error (invariant 2)."""
        tracked = self.policy.call_workers()
        for request_id, waiter in list(self._waiters.items()):
            if request_id not in tracked:
                self._unhold(request_id)
                waiter.outcome = GatewayError(500, "internal error in the scheduling policy; "
                                              "the call was not run", INTERNAL)
                waiter.event.set()
            elif tracked[request_id] is not None:
                # Dispatched inside the policy, but the Admit was lost with the error.
                self._wake(Admit(request_id, waiter.request.session_id, tracked[request_id],
                                 waiter.held_at), now)
        self._dispatched &= tracked.keys()
        for request_id in tracked.keys() - self._waiters.keys() - self._dispatched:
            try:
                self.policy.on_abort(request_id, now)
            except Exception:
                # Counted once more and left: reconciling a policy that keeps failing
                # would loop; the disagreement stays visible in disagreements().
                self._count_core_error("on_abort")
                self._log.exception("policy error while reconciling", request_id=request_id)

    def _count_core_error(self, operation: str) -> None:
        self.core_errors[operation] = self.core_errors.get(operation, 0) + 1

    def disagreements(self) -> list[str]:
        """Where the shell's view of the calls differs from the policy's (empty when they
        agree): every held call is held in the policy, every dispatched one dispatched
        there, and the policy tracks no call the shell does not."""
        tracked = self.policy.call_workers()
        problems = [f"{rid}: held here, " + ("unknown" if rid not in tracked else "dispatched")
                    + " in the policy" for rid in self._waiters if tracked.get(rid, "?") is not None]
        problems += [f"{rid}: dispatched here, " + ("unknown" if rid not in tracked else "held")
                     + " in the policy" for rid in self._dispatched if tracked.get(rid) is None]
        problems += [f"{rid}: tracked by the policy only"
                     for rid in tracked.keys() - self._waiters.keys() - self._dispatched]
        return problems

    # -- periodic and operator actions ---------------------------------------------------

    async def tick(self) -> None:
        async with self._lock:
            now = self._clock()
            self._carry_out(self._tick(now), now)
            self._log_adaptive_changes()

    def _log_adaptive_changes(self) -> None:
        """Log a setting the policy learns online when it first appears or moves by more
        than ADAPTIVE_LOG_CHANGE of its last logged value (not on every tick)."""
        for setting, value in self.policy.adaptive_settings().items():
            last = self._adaptive_logged.get(setting)
            if last is None or abs(value - last) > ADAPTIVE_LOG_CHANGE * abs(last):
                self._log.info("policy setting adapted", policy=self.policy.name,
                               setting=setting, value=round(value, 3), previous=last)
                self._adaptive_logged[setting] = value

    async def run_ticks(self) -> None:
        """Tick every ``policy.tick_interval_s`` until cancelled; a failing tick is logged
        with its context and the loop goes on (the next tick sees fresh state)."""
        while True:
            await anyio.sleep(self.policy.tick_interval_s)
            try:
                await self.tick()
            except Exception:
                self._log.exception("tick failed", policy=self.policy.name,
                                     programs=self.policy.program_count(), held=self.held)

    async def release(self, session_id: str, reason: str) -> bool:
        """End a program (operator); False when there is no such program."""
        async with self._lock:
            if not self.policy.has_program(session_id):
                return False
            now = self._clock()
            actions = self.policy.release(session_id, now, reason)
            actions += self._tick(now)
            self._carry_out(actions, now)
            return True

    async def set_worker_health(self, worker: str, healthy: bool) -> None:
        async with self._lock:
            now = self._clock()
            actions = self.policy.set_worker_health(worker, healthy, now)
            if not healthy:
                # A worker that stops answering has most likely restarted or died with an
                # empty cache; keeping its old index would steer programs back to blocks that
                # are gone until its first new KV event. Under-counting a cache that did
                # survive only costs a prefix hit; the events that follow rebuild it.
                self.policy.reset_worker_kv(worker)
            actions += self._tick(now)
            self._carry_out(actions, now)

    def snapshot(self, with_programs: bool = True) -> PolicySnapshot:
        """What the policy holds, frozen, for metrics and admin views (no lock needed: the
        policy runs on this thread only, and a snapshot is taken in one go)."""
        return self.policy.snapshot(with_programs)

    def program_view(self, session_id: str) -> ProgramView | None:
        return self.policy.program_view(session_id)

    def calls_on(self, worker: str) -> int:
        return self.policy.calls_on(worker)

    async def add_worker(self, worker: str, capacity_tokens: int | None) -> None:
        """Enter ``worker`` in the policy's ledger and index; held calls may fit on it now."""
        async with self._lock:
            self.policy.add_worker(worker, capacity_tokens)
            self._workers.add(worker)
            now = self._clock()
            self._carry_out(self._tick(now), now)  # held calls may fit on it now

    async def remove_worker(self, worker: str) -> None:
        """Take ``worker`` out of the policy (its ledger and index entries go); it must have
        no call in flight. A KV batch of it that comes after this is dropped (see
        :meth:`observe_kv`)."""
        async with self._lock:
            now = self._clock()
            actions = self.policy.remove_worker(worker, now)
            self._workers.discard(worker)
            self._carry_out(actions, now)

    async def set_capacity(self, worker: str, capacity_tokens: int) -> None:
        async with self._lock:
            now = self._clock()
            self.policy.set_capacity(worker, capacity_tokens)
            self._carry_out(self._tick(now), now)

    async def observe_kv(self, worker: str, batch: EventBatch) -> bool:
        """Feed one decoded KV-event batch to the policy's index; False, and nothing
        applied, when ``worker`` left the fleet while the batch waited for the lock (the
        index would otherwise take the worker back)."""
        async with self._lock:
            if worker not in self._workers:  # invariant 3
                return False
            self.policy.observe_kv(worker, batch)
            return True

    async def reset_worker_kv(self, worker: str) -> None:
        """Forget what the index knows of ``worker`` (engine restart, unrepairable gap); a
        worker no longer in the fleet has nothing left to forget."""
        async with self._lock:
            if worker in self._workers:
                self.policy.reset_worker_kv(worker)

    async def reconfigure(self, config: PolicyConfig) -> None:
        """Swap the policy's thresholds; ValueError when the policy kind would change."""
        async with self._lock:
            self.policy.reconfigure(config)

    # -- carrying out ----------------------------------------------------------------------

    def _carry_out(self, actions: list[Action], now: float) -> None:
        for action in actions:
            match action:
                case Admit():
                    self._wake(action, now)
                case Release():
                    self._refuse_held(action)
                    self.sink.send(action)
                    self._log.info("program released", session_id=action.session_id,
                                   worker=action.worker, reason=action.reason)
                case _ if isinstance(action, Directive):
                    self.sink.send(action)  # every other verb goes to its engine as it is
                case Pause():
                    self._log.info("program paused", session_id=action.session_id,
                                   worker=action.worker)
                case Resume():
                    self._log.info("program resumed", session_id=action.session_id,
                                   worker=action.worker, forced=action.forced)
                case Mark():
                    self._log.info("program marked", session_id=action.session_id,
                                   worker=action.worker)
                case Hold():
                    raise TypeError(f"a policy returned Hold as an action: {action}")
                case _:
                    assert_never(action)

    def _wake(self, action: Admit, now: float) -> None:
        waiter = self._unhold(action.request_id)
        if waiter is None:
            self._log.error("admit for a call nobody waits on", request_id=action.request_id,
                            session_id=action.session_id, worker=action.worker)
            return
        waiter.outcome = Admitted(action.worker, action.priority, now,
                                  max(0.0, now - waiter.held_at))
        self._dispatched.add(action.request_id)
        waiter.event.set()

    def _refuse_held(self, action: Release) -> None:
        for request_id, waiter in list(self._waiters.items()):
            if waiter.request.session_id != action.session_id:
                continue
            self._unhold(request_id)
            waiter.outcome = GatewayError(
                503, f"program {action.session_id} was released ({action.reason}) while this "
                "call waited", UNAVAILABLE,
            )
            waiter.event.set()
