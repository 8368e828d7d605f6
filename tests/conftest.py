"""The fast lane: which tests are slow, in one place.

`make test` runs everything; `make test-fast` runs ``-m "not slow"`` (the edit-run loop,
under 3 minutes on a 2-core machine). A tier is slow as a whole when every test in it starts
real engines, real clients, Ray or long simulations; a single test is slow when its own run
is (``--durations`` on `make test` says which: keep SLOW_TESTS in step with it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Tiers that are slow as a whole: real vLLM (e2e, fidelity), real agent clients, Ray.
SLOW_TIERS = frozenset({"e2e", "fidelity", "clients", "ray"})

# Single files, relative to tests/, whose every test is slow.
SLOW_FILES = frozenset({
    "integration/test_parity.py",          # two shells over 120 virtual seconds (~2 min)
    "property/test_bounded_state.py",      # long lives of every policy (~60 s together)
    "integration/test_gpu_profile.py",     # a real transformer in vLLM's venv (torch), 15-35 s
})

# Single tests (file::name; a parametrised test by its function name) that run long on their
# own: the policy properties at their full example counts, a real client's tool loop.
SLOW_TESTS = frozenset({
    "property/test_policy_properties.py::test_program_aware_invariants_and_determinism",
    "property/test_policy_properties.py::test_thunderagent_invariants_and_determinism",
    "integration/test_simworker_tool_calls.py::test_litellm_runs_tool_turns",
    "integration/test_calibrate.py::test_calibrate_recovers_a_simworkers_coefficients",  # ~3 min
    "integration/test_calibrate.py::test_workers_measured_at_once_give_one_fit",  # ~75 s
})


def _is_slow(item: pytest.Item) -> bool:
    path = Path(str(item.path)).resolve()
    try:
        relative = path.relative_to(TESTS)
    except ValueError:
        return False
    if relative.parts[0] in SLOW_TIERS or relative.as_posix() in SLOW_FILES:
        return True
    names = {item.name, getattr(item, "originalname", item.name)}
    return any(f"{relative.as_posix()}::{name}" in SLOW_TESTS for name in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
