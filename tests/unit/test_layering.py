"""Dependencies point one way: core ← shells ← entry points, and the engine plugin stands alone.

The core (``scheduler``) imports only itself; the offline simulator (``sim``) and the live
gateway (``controller``) import the core and never each other; the simworker, a live process
around the simulator's engine model, imports ``sim`` (which never imports it back); only the
entry points (``entry``) compose shells. The engine plugin (``sluice_vllm_plugin``) runs inside
vLLM's environment, where nothing else of Sluice's is installed, so it imports nothing of ours;
the gateway and the simworker import its directive envelope, the one wire format they share.

Checked statically (every import statement of every source file, wherever it sits) and, for the
plugin, dynamically (what importing it pulls into a fresh interpreter).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.imports import imported_roots

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "sluice_vllm_plugin"

# What each package may import of the project's own packages.
ALLOWED_PROJECT_IMPORTS = {
    "scheduler": {"scheduler"},
    "sim": {"scheduler", "sim"},
    "controller": {"scheduler", "controller", PLUGIN},
    "simworker": {"scheduler", "sim", "simworker", PLUGIN},
    PLUGIN: {PLUGIN},
    "entry": {"scheduler", "controller", "sim", "simworker", "entry"},
    # The Ray deployment composes the shells as entry does; nothing imports it back.
    "ray_fleet": {"scheduler", "controller", "sim", "simworker", "entry", "ray_fleet"},
}
PROJECT = set(ALLOWED_PROJECT_IMPORTS)


def _package_sources(package: str) -> list[Path]:
    return sorted((REPO_ROOT / package).rglob("*.py"))


def _wrong_imports(package: str) -> list[str]:
    wrong = []
    for path in _package_sources(package):
        used = imported_roots(path.read_text(encoding="utf-8")) & PROJECT
        if bad := used - ALLOWED_PROJECT_IMPORTS[package]:
            wrong.append(f"{path.relative_to(REPO_ROOT)} imports {sorted(bad)}")
    return wrong


def test_every_project_package_has_a_rule():
    top_level = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    assert top_level - {"tests", "bench", "experiments"} == PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED_PROJECT_IMPORTS))
def test_dependencies_point_one_way(package):
    assert _package_sources(package), f"{package}/ has no source files"
    assert _wrong_imports(package) == []


def test_the_plugin_loads_nothing_of_ours():
    probe = (
        "import json, sys\n"
        f"import {PLUGIN}, {PLUGIN}.directive_envelope, {PLUGIN}.directives\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert loaded & PROJECT == {PLUGIN}
