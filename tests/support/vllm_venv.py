"""vLLM's virtualenv for the tiers that run real vLLM code (fidelity, e2e): where it is, whether
vLLM imports there, building it with the project's own script when missing (a failure fails
the test, loudly; nothing skips), and the environment a subprocess there needs.

``SLUICE_VLLM_VENV`` points at another vLLM virtualenv (then nothing is built).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup_vllm_venv.sh"
SETUP_TIMEOUT_S = 3600


def vllm_venv() -> Path:
    return Path(os.environ.get("SLUICE_VLLM_VENV", ROOT / ".venv-vllm"))


def vllm_importable(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import importlib.util, sys; "
                            "sys.exit(0 if importlib.util.find_spec('vllm') else 1)"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def build_vllm_venv(log: Path | None = None) -> None:
    """Run scripts/setup_vllm_venv.sh (idempotent; it also repairs a broken venv); fail the
    test with the script's output when vLLM is still not importable."""
    if "SLUICE_VLLM_VENV" in os.environ:
        pytest.fail(f"SLUICE_VLLM_VENV={os.environ['SLUICE_VLLM_VENV']} has no importable vllm",
                    pytrace=False)
    proc = subprocess.run(["bash", str(SETUP_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=SETUP_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    if log is not None:
        log.write_text(output)
    if proc.returncode != 0 or not vllm_importable(vllm_venv() / "bin" / "python"):
        pytest.fail(f"{SETUP_SCRIPT} failed (exit {proc.returncode}); the real-vLLM tests cannot "
                    f"run:\n{output[-4000:]}", pytrace=False)


def vllm_python() -> Path:
    """The venv's interpreter, with vLLM importable (built first when it is not)."""
    python = vllm_venv() / "bin" / "python"
    if not vllm_importable(python):
        build_vllm_venv()
    return python


def vllm_env(**extra: str) -> dict[str, str]:
    """This environment for a subprocess in vLLM's venv: the repository importable (the plugin
    and the drivers load from the checkout), vLLM quiet, vLLM's default block-hash seed."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED")}
    env["PYTHONPATH"] = str(ROOT)
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    env.update(extra)
    return env


def run_check(code: str, *args: str) -> dict:
    """Run ``code`` (``python -c``) in vLLM's virtualenv; return the JSON it prints after
    ``RESULT`` on its last such line."""
    proc = subprocess.run([str(vllm_python()), "-c", code, *args], cwd=ROOT, env=vllm_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
