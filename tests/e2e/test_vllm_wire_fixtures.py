"""The committed wire fixtures (tests/fixtures/vllm_wire, decoded by tests/unit/test_vllm_wire.py)
are still what vLLM in .venv-vllm writes: the generator, re-run, gives the same bytes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_wire_fixtures_are_current(vllm_python: Path):
    result = subprocess.run(
        [str(vllm_python), str(REPO / "scripts" / "gen_vllm_wire_fixtures.py"), "--check"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, (
        "tests/fixtures/vllm_wire differs from what vLLM writes now; regenerate with "
        "`.venv-vllm/bin/python scripts/gen_vllm_wire_fixtures.py` and review the diff.\n"
        + result.stdout + result.stderr)
