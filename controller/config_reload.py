"""Hot reload of the ``policy:`` section (:class:`ConfigReloader`).

The YAML file is re-read when its mtime or size changes (polled every ``reload_poll_s``), on
SIGHUP, or on ``POST /sluice/reload``; a valid file's ``policy:`` thresholds go to
``policy.reconfigure``; a bad file keeps the old config and logs why. Other sections need a
restart, and a reload that changes them says so in the log.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import anyio

from controller.admission import Admission, warn_if_hold_shorter_than_wait
from controller.metrics import Metrics
from controller.serve_config import ServeConfig, load_serve_config
from scheduler.config import ConfigError


class ConfigReloader:
    """Watches the config file and applies its ``policy:`` section; :attr:`status` says how
    the last reload went (the admin API shows it)."""

    def __init__(self, config: ServeConfig, admission: Admission, metrics: Metrics, log: Any,
                 wall_clock: Callable[[], float]) -> None:
        self.config = config
        self.path = config.path
        self._admission = admission
        self._metrics = metrics
        self._log = log
        self._wall = wall_clock
        self._stamp = self._file_stamp()
        # What the file said last: a reload reports the keys it changed that need a restart
        # (compared with the file, not with command-line overrides such as --port).
        self._file_config = config
        if self.path is not None:
            try:
                self._file_config = load_serve_config(self.path)
            except ConfigError:
                pass  # changed since it was loaded; compare with what runs
        self._lock = anyio.Lock()
        self.status: dict[str, Any] = {"ok": None, "at_unix": None, "error": None, "trigger": None}

    def _file_stamp(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    async def run(self) -> None:
        if self.path is None:
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_sighup)
            if self.config.reload_poll_s > 0:
                tg.start_soon(self._poll)

    async def _poll(self) -> None:
        while True:
            await anyio.sleep(self.config.reload_poll_s)
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                try:
                    await self.reload("file changed")
                except Exception:
                    self._log.exception("config reload failed", path=str(self.path))

    async def _watch_sighup(self) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGHUP)
            signals = receiver.__enter__()
        except (ValueError, RuntimeError, NotImplementedError) as err:
            # Signal handlers can only be installed from the main thread (not the case when
            # the app runs inside a test's server thread); file polling still works.
            self._log.info("SIGHUP reload unavailable", problem=str(err))
            return
        try:
            async for _ in signals:
                try:
                    await self.reload("SIGHUP")
                except Exception:
                    self._log.exception("config reload failed", path=str(self.path))
        finally:
            receiver.__exit__(None, None, None)

    async def reload(self, trigger: str) -> bool:
        """Apply the file's policy thresholds; False (old config kept, reason logged) when
        the file is unusable or changes the policy kind."""
        async with self._lock:
            assert self.path is not None
            self._stamp = self._file_stamp()
            self.status.update(at_unix=self._wall(), trigger=trigger)
            try:
                new = load_serve_config(self.path)
                if new.policy != self.config.policy:
                    await self._admission.reconfigure(new.policy)
            except (ConfigError, ValueError) as err:
                self.status.update(ok=False, error=str(err))
                self._metrics.reloads.labels("rejected").inc()
                self._log.error("config reload rejected; keeping the old config",
                                path=str(self.path), trigger=trigger, problem=str(err))
                return False
            restart = sorted(
                key for key in type(new).model_fields
                if key != "policy" and getattr(new, key) != getattr(self._file_config, key)
            )
            if restart:
                self._log.warning("config keys changed that only a restart applies",
                                  keys=restart, path=str(self.path))
            changed = new.policy != self.config.policy
            if changed:
                warn_if_hold_shorter_than_wait(self._log, self.config.limits, new.policy)
            self._file_config = new
            self.config = self.config.model_copy(update={"policy": new.policy})
            self.status.update(ok=True, error=None)
            self._metrics.reloads.labels("applied").inc()
            self._log.info("config reloaded", path=str(self.path), trigger=trigger,
                           policy_changed=changed)
            return True
