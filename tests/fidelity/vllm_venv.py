"""Running code in vLLM's virtualenv for the plugin tests: the interpreter (built by the
project's own script when missing; a failure fails the test, loudly) and the environment a
subprocess there needs (the repository importable, vLLM quiet)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SETUP_SCRIPT = ROOT / "scripts" / "setup_vllm_venv.sh"


def vllm_python() -> Path:
    if not VLLM_PY.exists():
        proc = subprocess.run(["bash", str(SETUP_SCRIPT)], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not VLLM_PY.exists():
            pytest.fail(f"could not create .venv-vllm: {proc.stderr[-3000:]}", pytrace=False)
    return VLLM_PY


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    env["PYTHONPATH"] = str(ROOT)
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    env.update(extra)
    return env


def run_check(code: str, *args: str) -> dict:
    """Run ``code`` (``python -c``) in vLLM's virtualenv; return the JSON it prints after
    ``RESULT`` on its last such line."""
    import json
    proc = subprocess.run([str(vllm_python()), "-c", code, *args], cwd=ROOT, env=vllm_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
