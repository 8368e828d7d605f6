"""A Python client of the gateway's admin API (``/sluice/*``), for operators' scripts and
RL trainers: list the fleet and its programs, add, drain, put to sleep, wake and remove
workers at run time. A worker added here is wired as a configured one is (KV events,
directives, capacity, health); removing it closes all of that.

A weight sync with it (every engine sleeps while the trainer updates it)::

    admin = SluiceAdmin("http://gateway:8080", token)
    for name in engines:
        admin.sleep(name)              # no new calls; its KV counts as gone
    admin.wait_idle(engines)           # calls already running finish
    ...sleep the engines, sync weights, wake them...
    for name in engines:
        admin.wake(name)               # calls held meanwhile go ahead
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import httpx


class AdminError(RuntimeError):
    """The gateway refused an admin request; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class SluiceAdmin:
    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, trust_env=False,
                                    headers={"Authorization": f"Bearer {token}"},
                                    transport=transport)

    def __enter__(self) -> SluiceAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    # -- reading ---------------------------------------------------------------------------

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["name"]: w for w in self._call("GET", "/sluice/workers")["workers"]}

    def programs(self) -> dict[str, dict[str, Any]]:
        return {p["session_id"]: p for p in self._call("GET", "/sluice/programs")["programs"]}

    # -- membership ------------------------------------------------------------------------

    def add_worker(self, name: str, url: str, capacity_tokens: int | None = None, *,
                   kv_events: str | None = None, replay: str | None = None,
                   kv_topic: str | None = None, directives: str | None = None) -> dict[str, Any]:
        """Add a worker, wired as one in the config's ``workers:`` is: its KV events (its
        own ``kv_events`` endpoint, else the gateway's ``kv_events_bind`` socket) caught up
        from ``replay``, its ``directives`` socket, its capacity from ``/metrics`` unless
        given. Returns its name, mode, health and wiring."""
        entry: dict[str, Any] = {"name": name, "url": url}
        optional = {"capacity_tokens": capacity_tokens, "kv_events": kv_events, "replay": replay,
                    "kv_topic": kv_topic, "directives": directives}
        entry.update({key: value for key, value in optional.items() if value is not None})
        return self._call("POST", "/sluice/workers", json=entry)

    def drain(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"{_worker_path(name)}/drain")

    def sleep(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"{_worker_path(name)}/sleep")

    def wake(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"{_worker_path(name)}/wake")

    def remove(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", _worker_path(name))

    def wait_idle(self, names: Iterable[str], timeout_s: float = 600.0,
                  poll_s: float = 0.2) -> None:
        """Until none of ``names`` has a call in flight (TimeoutError past ``timeout_s``)."""
        wanted = set(names)
        deadline = time.monotonic() + timeout_s
        while True:
            busy = {name: w["calls_in_flight"] for name, w in self.workers().items()
                    if name in wanted and w["calls_in_flight"]}
            if not busy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"calls still in flight after {timeout_s:g} s: {busy}")
            time.sleep(poll_s)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._client.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise AdminError(response.status_code, message)
        return response.json()


def _worker_path(name: str) -> str:
    # A data-parallel rank's worker is named "<worker>#dp<rank>": unquoted, "#" would start
    # the URL's fragment.
    return f"/sluice/workers/{quote(name, safe='')}"
