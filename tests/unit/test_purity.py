"""The functional core stays pure (architecture.md §2): no I/O stack, no clock, no randomness.

Checked twice: dynamically (what importing every module of ``scheduler`` pulls into a fresh
interpreter) and statically (what each source file's import statements name).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import scheduler
from tests.support.imports import imported_roots

PACKAGE_DIR = Path(scheduler.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent

# Not even transitively: these are the live shell's stack.
FORBIDDEN_LOADED = {
    "zmq", "httpx", "anyio", "asyncio", "starlette", "uvicorn", "h11", "aiohttp", "requests",
    "structlog", "prometheus_client",
}
# Not imported by the core's own code: I/O, the clock, threads, randomness, processes.
FORBIDDEN_IMPORTED = {
    "zmq", "httpx", "anyio", "asyncio", "starlette", "uvicorn", "socket", "time", "datetime",
    "threading", "random", "os", "subprocess", "select", "selectors",
}

_PROBE = """
import importlib, json, pkgutil, sys
import scheduler
names = ["scheduler"]
for info in pkgutil.walk_packages(scheduler.__path__, "scheduler."):
    importlib.import_module(info.name)
    names.append(info.name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def _source_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_import_scheduler_exits_zero():
    result = _run("import scheduler")
    assert result.returncode == 0, result.stderr


def test_importing_every_core_module_loads_no_io_stack():
    result = _run(_PROBE)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # the walk really covered the package: every source file was imported
    assert set(report["imported"]) == {_module_name(p) for p in _source_files()}
    loaded = {name.split(".")[0] for name in report["loaded"]}
    assert loaded & FORBIDDEN_LOADED == set()


def test_the_static_check_sees_every_kind_of_import():
    sample = (
        "import os.path\n"
        "from time import monotonic\n"
        "import json as j\n"
        "def f():\n"
        "    import random\n"
        "    __import__('socket')\n"
        "    importlib.import_module('datetime')\n"
        "    from . import sibling\n"
    )
    assert imported_roots(sample) == {"os", "time", "json", "random", "socket", "datetime"}


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_core_source_imports_no_clock_io_or_randomness(path):
    bad = imported_roots(path.read_text(encoding="utf-8")) & FORBIDDEN_IMPORTED
    assert not bad, f"{path.relative_to(REPO_ROOT)} imports {sorted(bad)}"


def test_the_core_has_source_files_to_check():
    names = {p.name for p in _source_files()}
    assert {"coordinates.py", "calls.py", "programs.py", "kv_events.py", "kv_index.py",
            "ledger.py", "config.py", "actions.py"} <= names


def test_the_shells_read_the_policy_only_through_its_snapshot_and_methods():
    """The live shell shows the policy's state from ``Policy.snapshot()`` (frozen values),
    never from its program table, ledger or index, which stay the policy's own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reaching_in = re.compile(r"policy\.(programs|ledger|index|calls|stats)\b")
    offenders = [f"{path.relative_to(root)}:{n}: {line.strip()}"
                 for folder in ("controller", "entry", "ray_fleet", "simworker")
                 for path in sorted((root / folder).rglob("*.py"))
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if reaching_in.search(line) and not line.lstrip().startswith("#")]
    assert not offenders, "\n".join(offenders)
