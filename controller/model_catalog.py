"""Which models the fleet serves: the answer to ``GET /v1/models`` and the check that turns
a call naming a model nobody serves into a 404 instead of a worker's error.

The config's ``models`` list, when set, is the whole answer. Otherwise the workers' own
``/v1/models`` lists are merged (in config order, first one wins per id) and cached. A name
missing from the cache triggers a refresh, at most once per ``refresh_interval_s``, so a
model loaded on a worker after the gateway started (a LoRA adapter, a restarted worker) is
found within seconds while a client repeating a wrong name cannot make the gateway ask the
workers on every call. Until some worker has answered, nothing is rejected: the check must
never make the gateway less available than forwarding would be.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx

from controller.serve_config import ServeConfig
from controller.upstream import UpstreamPool
from controller.worker_answers import decode_json
from controller.workers import WorkerRegistry

MODELS_TIMEOUT_S = 5.0
REFRESH_INTERVAL_S = 2.0


class ModelCatalog:
    def __init__(self, config: ServeConfig, pool: UpstreamPool, workers: WorkerRegistry, log: Any,
                 clock: Callable[[], float] = time.monotonic,
                 refresh_interval_s: float = REFRESH_INTERVAL_S) -> None:
        self._config = config
        self._pool = pool
        self._workers = workers
        self._log = log
        # Its own monotonic clock: the policy's clock may be a test's frozen one.
        self._clock = clock
        self.refresh_interval_s = refresh_interval_s
        self._known: frozenset[str] | None = None  # None: no worker has answered yet
        self._last_refresh: float | None = None
        self._refresh_lock = anyio.Lock()

    async def from_workers(self) -> list[dict] | None:
        """The healthy workers' models merged, or None when none of them answered. Also
        refreshes the cache the check uses."""
        names = self._workers.healthy_names()
        answers: dict[str, list[dict]] = {}

        async def ask(name: str) -> None:
            try:
                response = await self._pool.client(name).get("/v1/models", timeout=MODELS_TIMEOUT_S)
            except httpx.HTTPError as err:
                self._log.warning("worker /v1/models failed", worker=name, problem=str(err))
                return
            if response.status_code != 200:
                self._log.warning("worker /v1/models failed", worker=name,
                                  problem=f"answered {response.status_code}")
                return
            data = decode_json(response.content)
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                answers[name] = [m for m in data["data"] if isinstance(m, dict)]

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(ask, name)
        if not answers:
            return None
        merged: dict[str, dict] = {}
        for name in names:  # config order, so the answer is stable
            for model in answers.get(name, []):
                merged.setdefault(str(model.get("id")), model)
        self._known = frozenset(merged)
        self._last_refresh = self._clock()
        return list(merged.values())

    async def is_served(self, model: str) -> bool:
        """False only when ``model`` is known not to be served: it is not in the config's
        list, or not in the workers' lists even after a refresh."""
        if self._config.models is not None:
            return model in self._config.models
        if self._known is not None and model in self._known:
            return True
        await self._refresh_if_due()
        if self._known is None:
            return True  # no worker list to judge by: forward, as without the check
        return model in self._known

    async def _refresh_if_due(self) -> None:
        # One refresh at a time: calls that miss together wait for the same answer.
        async with self._refresh_lock:
            now = self._clock()
            if self._last_refresh is not None and now - self._last_refresh < self.refresh_interval_s:
                return
            self._last_refresh = now  # a failed refresh also waits out the interval
            await self.from_workers()
