"""The admin API, behind ``Authorization: Bearer <admin_token>`` (401 without it or with a
wrong one; 403 when no token is configured at all).

``GET /sluice/programs``, ``GET /sluice/workers``, ``GET /sluice/config``,
``POST /sluice/programs/{id}/release``, ``POST /sluice/reload``, and membership:
``POST /sluice/workers`` (a worker entry as in the config's ``workers:``, KV events and
directives included), ``POST /sluice/workers/{name}/drain|sleep|wake``,
``DELETE /sluice/workers/{name}``, carried out by the fleet (controller/fleet.py). Its
Python client is controller/admin_client.py.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controller.admission import Admission
from controller.config_reload import ConfigReloader
from controller.errors import (
    AUTHENTICATION,
    INVALID_REQUEST,
    NOT_FOUND,
    PERMISSION,
    UNAVAILABLE,
    error_response,
)
from controller.fleet import Fleet
from controller.serve_config import WorkerConfig
from controller.workers import MembershipError, WorkerMode
from scheduler.config_reading import format_validation_errors


class AdminApi:
    """The admin routes (:meth:`routes`), each checking the bearer token first."""

    def __init__(self, token: str | None, admission: Admission, fleet: Fleet,
                 reloader: ConfigReloader, clock: Callable[[], float]) -> None:
        self._token = token.encode() if token else None
        self._admission = admission
        self._fleet = fleet
        self._reloader = reloader
        self._clock = clock

    def routes(self) -> list[Route]:
        return [
            Route("/sluice/programs", self.programs, methods=["GET"]),
            Route("/sluice/programs/{session_id:path}/release", self.release, methods=["POST"]),
            Route("/sluice/workers", self.workers, methods=["GET"]),
            Route("/sluice/workers", self.add_worker, methods=["POST"]),
            Route("/sluice/workers/{name}", self.remove_worker, methods=["DELETE"]),
            Route("/sluice/workers/{name}/{action}", self.worker_action, methods=["POST"]),
            Route("/sluice/config", self.config, methods=["GET"]),
            Route("/sluice/reload", self.reload, methods=["POST"]),
        ]

    def _deny(self, request: Request) -> Response | None:
        if self._token is None:
            return error_response(403, "the admin API is off: set admin_token or the "
                                  "admin_token_env variable", PERMISSION)
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return error_response(401, "admin endpoints need Authorization: Bearer <admin token>",
                                  AUTHENTICATION, headers={"WWW-Authenticate": "Bearer"})
        return None

    async def programs(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        now = self._clock()
        items = [{
            "session_id": p.session_id,
            "parent_session_id": p.parent_session_id,
            "group_id": p.group_id,
            "lifecycle": p.lifecycle,
            "phase": p.phase,
            "marked": p.marked,
            "home_worker": p.home_worker,
            "context_tokens": p.context_tokens,
            "in_flight": p.in_flight,
            "waiting": p.waiting,
            "steps": p.steps,
            "age_s": round(now - p.created_at, 3),
            "idle_s": round(now - p.last_activity, 3),
        } for p in sorted(self._admission.snapshot().programs, key=lambda p: p.session_id)]
        return JSONResponse({"programs": items, "count": len(items)})

    async def workers(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        views = {w.name: w for w in self._admission.snapshot(with_programs=False).workers}
        items = []
        for record in self._fleet.records.values():
            state, view = record.state, views[record.name]
            items.append({
                "name": state.name,
                "url": state.url,
                "healthy": state.healthy,
                "capacity_tokens": state.capacity_tokens,
                "capacity_source": state.capacity_source,
                "capacity_error": state.capacity_error,
                # checks the gateway could not make for want of its own descriptors,
                # buffers or memory (not counted against the worker), and the shortage
                # that stops them now (None: they are being made)
                "local_shortages": state.local_shortages,
                "local_shortage": state.local_shortage,
                "utilization": view.utilization,
                # KV-event subscriber: "kv_index" once the worker's events flow, else "estimate"
                "utilization_source": "kv_index" if view.kv_events else "estimate",
                "programs": view.programs,
                "last_error": state.last_error,
                "last_check_unix": state.last_check_unix,
                "mode": state.mode.value,
                "calls_in_flight": view.calls_in_flight,
                # how its engine orders its queue: "priority" gets the policy's priority
                "scheduling_policy": record.config.scheduling_policy,
                # its KV-event endpoint ("kv_events_bind": fed from the bound socket) and
                # directive endpoint; None: not wired
                **record.wiring,
            })
        return JSONResponse({"workers": items})

    # -- membership ------------------------------------------------------------------------

    async def add_worker(self, request: Request) -> Response:
        """``POST /sluice/workers`` with a worker entry as in the config's ``workers:``. Its
        URL, and the ``tcp://`` hosts of the ``kv_events``, ``replay`` and ``directives`` it
        connects to, must be ones ``worker_urls`` allows (host names resolved, every address
        checked), a ``kv_events`` the gateway binds may not listen beyond loopback without
        keys unless ``allow_insecure_bind``, and its API key must be readable: else a 400
        naming the key (``worker.url``, ``worker.replay``, ``worker.kv_events``,
        ``worker.api_key_env`` ...), before any connection to it (:meth:`Fleet.add`)."""
        if (denied := self._deny(request)) is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the body must be a JSON worker entry: "
                                  '{"name": ..., "url": ..., "capacity_tokens": ...}', INVALID_REQUEST)
        try:
            worker = WorkerConfig.model_validate(body)
        except ValidationError as err:
            return error_response(400, format_validation_errors(err, "worker"), INVALID_REQUEST)
        try:
            record = await self._fleet.add(worker)
        except MembershipError as err:
            return _membership_refused(err)
        return JSONResponse({"name": record.name, "mode": record.state.mode.value,
                             "healthy": record.state.healthy, **record.wiring}, status_code=201)

    async def worker_action(self, request: Request) -> Response:
        """``POST /sluice/workers/{name}/drain|sleep|wake``."""
        if (denied := self._deny(request)) is not None:
            return denied
        name, action = request.path_params["name"], request.path_params["action"]
        modes = {"drain": WorkerMode.DRAINING, "sleep": WorkerMode.ASLEEP, "wake": WorkerMode.SERVING}
        if action not in modes:
            return error_response(404, f"no worker action {action!r}: drain, sleep or wake",
                                  NOT_FOUND)
        try:
            state = await self._fleet.set_mode(name, modes[action])
        except MembershipError as err:
            return _membership_refused(err)
        return JSONResponse({"name": name, "mode": state.mode.value,
                             "calls_in_flight": self._admission.calls_on(name)})

    async def remove_worker(self, request: Request) -> Response:
        """``DELETE /sluice/workers/{name}``: a drained or sleeping worker with nothing in flight."""
        if (denied := self._deny(request)) is not None:
            return denied
        name = request.path_params["name"]
        try:
            await self._fleet.remove(name)
        except MembershipError as err:
            return _membership_refused(err)
        return JSONResponse({"removed": name})

    async def config(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        return JSONResponse({
            "policy": self._admission.policy.config.model_dump(mode="json"),
            "path": str(self._reloader.path) if self._reloader.path else None,
            "reload": self._reloader.status,
        })

    async def release(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        session_id = request.path_params["session_id"]
        if not await self._admission.release(session_id, "operator"):
            return error_response(404, f"no program {session_id!r}", NOT_FOUND, param="session_id")
        return JSONResponse({"released": session_id})

    async def reload(self, request: Request) -> Response:
        if (denied := self._deny(request)) is not None:
            return denied
        if self._reloader.path is None:
            return error_response(404, "this gateway was not started from a config file", NOT_FOUND)
        ok = await self._reloader.reload("admin API")
        return JSONResponse({"reloaded": ok, **self._reloader.status}, status_code=200 if ok else 422)


def _membership_refused(err: MembershipError) -> Response:
    """A membership request that cannot be done, typed by its status: an unknown worker
    (404), the gateway unable to do it now (503: not running, out of local resources), or
    a request at odds with the fleet (409)."""
    type_ = {404: NOT_FOUND, 503: UNAVAILABLE}.get(err.status, INVALID_REQUEST)
    return error_response(err.status, str(err), type_)
