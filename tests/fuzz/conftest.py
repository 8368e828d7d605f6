"""The fuzz tier (tests/fuzz): its Hypothesis profiles are registered here, on import of
tests/fuzz/profiles.py, before any target is collected; the run's header says which one
is in use."""

from __future__ import annotations

from tests.fuzz.profiles import PROFILE_VARIABLE, is_long_run, long_run_examples, profile_name


def pytest_report_header() -> str:
    if is_long_run():
        return (f"sluice fuzz: {PROFILE_VARIABLE}={profile_name()}, "
                f"{long_run_examples()} inputs per target")
    return f"sluice fuzz: {PROFILE_VARIABLE}={profile_name()} (set it to long for `make fuzz`)"
