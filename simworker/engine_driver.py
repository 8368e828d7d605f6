"""Drives a simworker's engine in scaled real time: the clock, the loop that runs iterations,
the calls in flight and the KV events each iteration publishes.

Time: virtual (model) time is ``(wall − start) / time_scale``. One task loops: start the next
iteration (or decode run), sleep until it ends on the wall clock, complete it, deliver the
tokens. Arrivals queue the call in the engine (cutting a decode run at its next step) and wake
the loop. Decode runs are capped (``max_run_steps``, ``max_run_wall_s``) so streamed tokens
flow in small chunks. When the loop falls behind the wall clock (a busy event loop) it starts
the next iteration where the last one ended, so throughput stays the model's (a call that
arrived meanwhile may join it that little early); a lag beyond ``max_lag_wall_s`` is skipped
instead of caught up, logged and counted. If the loop fails, every call in flight fails with
it and the worker refuses new ones (``failed``).
"""

from __future__ import annotations

import itertools
import time

import anyio
import anyio.lowlevel
from structlog.typing import FilteringBoundLogger

from scheduler.kv_events import BlockStored
from sim.engine import Engine
from sim.engine_request import EngineRequest
from simworker.calls import BadRequest, Call
from simworker.config import SimWorkerConfig
from simworker.kv_publisher import KvEventPublisher


class EngineDriver:
    def __init__(self, engine: Engine, config: SimWorkerConfig, publisher: KvEventPublisher | None,
                 log: FilteringBoundLogger) -> None:
        self.engine = engine
        self.config = config
        self.publisher = publisher
        self.aborted = 0
        self.lag_dropped_s = 0.0
        self._lag_logged_at = float("-inf")
        self.failed: str | None = None
        self._calls: dict[str, Call] = {}
        self._wake: anyio.Event | None = None
        self._t0 = time.monotonic()
        self._last_end: float | None = None
        self._log = log

    # -- clock -----------------------------------------------------------------------

    def vnow(self) -> float:
        return (time.monotonic() - self._t0) / self.config.time_scale

    def _wall(self, virtual: float) -> float:
        return self._t0 + virtual * self.config.time_scale

    def start_clock(self) -> None:
        """Virtual time 0 is now (the server has started)."""
        self._t0 = time.monotonic()

    # -- engine loop -----------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._engine_loop()
        except Exception as err:
            self.failed = f"engine loop failed: {type(err).__name__}: {err}"
            self._log.exception("engine loop failed; failing the calls in flight",
                                calls=len(self._calls), running=len(self.engine.running),
                                waiting=len(self.engine.waiting))
            for call in self._calls.values():
                call.error = self.failed
                call.changed.set()
            self._calls.clear()

    async def _engine_loop(self) -> None:
        engine = self.engine
        config = self.config
        max_run_s = config.max_run_wall_s / config.time_scale
        max_lag = config.max_lag_wall_s / config.time_scale
        while True:
            if engine.busy_until is None:
                now = self.vnow()
                last = self._last_end
                start_at = now
                if last is not None:
                    if now - last < max_lag:
                        start_at = last
                    else:
                        self._dropped_lag(now - last)
                until = engine.start(start_at, max_run_steps=config.max_run_steps, max_run_s=max_run_s)
                self._publish()
                if until is None:
                    self._last_end = None
                    await self._sleep(None)
                    continue
            delay = self._wall(engine.busy_until) - time.monotonic()
            if delay > 0:
                await self._sleep(delay)
                continue
            end = engine.busy_until
            done = engine.complete()
            engine.finished.clear()  # the offline simulator's record; a server must not keep it
            self._last_end = end
            self._publish()
            self._deliver(done)
            await anyio.lowlevel.checkpoint()

    def _dropped_lag(self, lag: float) -> None:
        """The loop fell behind the wall clock by more than ``max_lag_wall_s``: that much
        model time is skipped rather than caught up (the host is too slow for the scale)."""
        self.lag_dropped_s += lag
        wall = time.monotonic()
        if wall - self._lag_logged_at >= 10.0:
            self._lag_logged_at = wall
            self._log.warning("engine loop behind the wall clock; skipping the lag",
                              lag_model_s=round(lag, 4), time_scale=self.config.time_scale,
                              skipped_total_model_s=round(self.lag_dropped_s, 3))

    async def _sleep(self, delay: float | None) -> None:
        self._wake = wake = anyio.Event()
        with anyio.move_on_after(delay):
            await wake.wait()
        self._wake = None

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _publish(self) -> None:
        events = self.engine.pool.take_events()
        if events and self.publisher is not None:
            for event in events:
                # vLLM's KVCacheManager.take_events annotates stores with the group's spec
                if isinstance(event, BlockStored) and event.group_idx is not None:
                    event.kv_cache_spec_kind = "full_attention"
            self.publisher.publish(events)

    def _deliver(self, done: list[EngineRequest]) -> None:
        calls = self._calls
        for request in itertools.chain(self.engine.running, done):
            call = calls.get(request.request_id)
            if call is None:
                continue
            if request.num_output != call.seen or request.finished:
                call.seen = request.num_output
                call.changed.set()
            if request.finished:
                del calls[request.request_id]

    def submit(self, call: Call) -> None:
        if self.failed:
            raise BadRequest(self.failed, status=503)
        self.engine.add_request(call.request, self.vnow())
        self._calls[call.request.request_id] = call
        self._wake_loop()

    def abort(self, call: Call) -> None:
        if call.over:
            return
        self._calls.pop(call.request.request_id, None)
        removed = self.engine.abort(call.request.request_id)
        call.error = "aborted"
        if removed is not None:
            self.aborted += 1
            self._log.info("call aborted: client went away", request_id=call.request.request_id,
                           session_id=call.request.session_id, output_tokens=call.request.num_output)
        self._wake_loop()
