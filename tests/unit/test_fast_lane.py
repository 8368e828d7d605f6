"""The fast lane's list of what is slow (tests/conftest.py) names tests that exist.

A renamed or moved slow test would otherwise fall silently into `make test-fast`.
"""

from __future__ import annotations

import re

from tests import conftest


def test_every_slow_tier_and_file_exists():
    for tier in conftest.SLOW_TIERS:
        assert (conftest.TESTS / tier).is_dir(), tier
    for file in conftest.SLOW_FILES:
        assert (conftest.TESTS / file).is_file(), file


def test_every_slow_test_is_a_test_function_of_its_file():
    for entry in conftest.SLOW_TESTS:
        file, name = entry.split("::")
        source = (conftest.TESTS / file).read_text(encoding="utf-8")
        assert re.search(rf"^(async )?def {re.escape(name)}\(", source, re.MULTILINE), entry
