"""The real-clients tier: experiments/clients/run_clients.py as a user runs it (a
subprocess that starts simworkers and ``sluice serve``), the official ``openai`` and
``anthropic`` SDKs and ``litellm`` through the gateway. Skipped, saying which, only when a
library of the ``clients`` extra cannot be imported."""

from __future__ import annotations

from tests.support.client_scripts import passed_checks, skip_unless_importable

LIBRARIES = {"openai": "openai", "anthropic": "anthropic", "litellm": "litellm"}
# What each library's checks must report (a check that silently stopped running fails here).
EXPECTED_CHECKS = {"openai": 7, "anthropic": 4, "litellm": 4}


def test_the_openai_anthropic_and_litellm_clients_pass_every_check_through_the_gateway():
    skip_unless_importable(LIBRARIES)
    passed = passed_checks("experiments.clients.run_clients", list(LIBRARIES), timeout_s=240)
    assert passed == EXPECTED_CHECKS
