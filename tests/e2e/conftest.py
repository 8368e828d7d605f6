"""The real-vLLM tier: session-scoped fixtures that build ``.venv-vllm`` if needed, write the
tiny model, and run two real vLLM CPU workers for the whole session.

- ``vllm_python``: ``.venv-vllm/bin/python`` with vLLM importable; runs
  scripts/setup_vllm_venv.sh when it is not (a long download on first use). A failure fails
  the tests that need it, loudly; nothing here skips.
- ``tiny_model``: scripts/make_tiny_model.py into a session temp dir.
- ``vllm_fleet``: workers ``w0`` and ``w1`` (started in parallel; see vllm_fleet.py for the
  flags), stopped at the end (SIGTERM, then SIGKILL). ``fleet`` is the same fleet with any
  worker a test crashed started again first.
- ``kv_tap``: the test's own ZMQ SUB on both workers' KV events.

Worker logs live in the session temp dir; a failing e2e test gets their tails in its report.
Environment: ``SLUICE_VLLM_VENV`` points at another vLLM virtualenv.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm_fleet import Fleet, KvEventTap
from tests.support.vllm_venv import ROOT, build_vllm_venv, vllm_importable, vllm_venv

WORKER_NAMES = ("w0", "w1")
TIMINGS: dict[str, float] = {}
# The fleet of this session, and the last test that uses it: the workers stop right after
# that test instead of idling through the rest of the suite.
_FLEETS: list[Fleet] = []
_LAST_USER: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end against real vLLM CPU workers (tests/e2e; builds .venv-vllm on first use)")


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = vllm_venv() / "bin" / "python"
    if vllm_importable(python):
        return python
    log = tmp_path_factory.mktemp("vllm-venv") / "setup.log"
    print(f"\n[e2e] .venv-vllm missing: running scripts/setup_vllm_venv.sh (log {log})",
          file=sys.__stderr__, flush=True)
    started = time.monotonic()
    build_vllm_venv(log)
    TIMINGS["venv_setup_s"] = time.monotonic() - started
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    result = subprocess.run([str(vllm_python), str(ROOT / "scripts" / "make_tiny_model.py"), str(out)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"make_tiny_model.py failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
    return out


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python: Path, tiny_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-workers"))
    started = time.monotonic()
    try:
        try:
            fleet.start(WORKER_NAMES)
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        TIMINGS["workers_ready_s"] = time.monotonic() - started
        print(f"\n[e2e] {len(fleet.workers)} vLLM workers ready in {TIMINGS['workers_ready_s']:.1f} s "
              f"(logs in {fleet.workdir})", file=sys.__stderr__, flush=True)
        _FLEETS.append(fleet)
        yield fleet
    finally:
        _stop(fleet)


def _stop(fleet: Fleet) -> None:
    if "workers_stop_s" in TIMINGS:
        return
    stop_started = time.monotonic()
    fleet.stop_all()
    TIMINGS["workers_stop_s"] = time.monotonic() - stop_started


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "vllm_fleet" in getattr(item, "fixturenames", ())]
    _LAST_USER[:] = users[-1:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _FLEETS and _LAST_USER and item.nodeid == _LAST_USER[0] and nextitem is not None:
        _stop(_FLEETS[0])


@pytest.fixture
def fleet(vllm_fleet: Fleet) -> Fleet:
    """The session's fleet, every worker up (one a test crashed is started again)."""
    for worker in vllm_fleet.workers:
        if not worker.alive:
            try:
                vllm_fleet.restart(worker.name)
            except RuntimeError as err:
                pytest.fail(str(err), pytrace=False)
    return vllm_fleet


@pytest.fixture(scope="session")
def kv_tap(vllm_fleet: Fleet) -> Iterator[KvEventTap]:
    tap = KvEventTap(vllm_fleet)
    time.sleep(0.3)  # let the SUBs join before anything is published
    yield tap
    tap.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("e2e") is not None:
        # the session's fleet, or a module's own (started with other flags)
        fleets = [value for value in getattr(item, "funcargs", {}).values() if isinstance(value, Fleet)]
        for fleet in fleets[:1]:
            report.sections.append(("vLLM worker logs", fleet.logs()))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if TIMINGS:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"[e2e] timings (s): {parts}")
