"""The fuzz tier's Hypothesis profiles, chosen by ``SLUICE_FUZZ_PROFILE``.

``short`` (the default, what `make test` runs): a few hundred inputs per target at most,
derandomized, so the whole tier takes well under a minute and a failure shows again on
the next run. ``long`` (what `make fuzz` sets): 100,000 inputs per target, random seeds and
no deadline, its failures kept in Hypothesis's example database for the next run.

Each target applies :func:`fuzz_settings` itself, with its own ``max_examples`` for the
short run (an HTTP call costs a hundred times a pure parser's call). The profiles are not
loaded globally, so the rest of the suite's property tests keep their own settings.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "SLUICE_FUZZ_PROFILE"
# Inputs per target of the long run; SLUICE_FUZZ_EXAMPLES sets another count, for a long run
# cut to fit the time at hand (the acceptance run keeps the default).
EXAMPLES_VARIABLE = "SLUICE_FUZZ_EXAMPLES"
LONG_RUN_EXAMPLES = 100_000

# Inputs are big and slow to build by design (deep nesting, long strings), and the HTTP
# targets share one gateway across examples: none of that is a flaw in the test.
_TOLERATED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
              HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]

settings.register_profile("sluice-fuzz-short", deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_TOLERATED)
settings.register_profile("sluice-fuzz-long", deadline=None, derandomize=False,
                          max_examples=LONG_RUN_EXAMPLES, print_blob=True,
                          suppress_health_check=_TOLERATED)


def profile_name() -> str:
    chosen = os.environ.get(PROFILE_VARIABLE, "short").strip() or "short"
    if chosen not in ("short", "long"):
        raise ValueError(f"{PROFILE_VARIABLE} must be short or long, got {chosen!r}")
    return chosen


def is_long_run() -> bool:
    return profile_name() == "long"


def long_run_examples() -> int:
    raw = os.environ.get(EXAMPLES_VARIABLE, "").strip()
    if not raw:
        return LONG_RUN_EXAMPLES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EXAMPLES_VARIABLE} must be a whole number ≥ 1, got {raw!r}")
    return int(raw)


def fuzz_settings(short_examples: int) -> settings:
    """The settings of one target: the chosen profile, with ``short_examples`` inputs on
    the short run (the long run's count is the profile's, or SLUICE_FUZZ_EXAMPLES)."""
    profile = settings.get_profile(f"sluice-fuzz-{profile_name()}")
    if is_long_run():
        return settings(profile, max_examples=long_run_examples())
    return settings(profile, max_examples=short_examples)
