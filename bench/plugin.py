"""``BENCH plugin_alloc_overhead_pct``: extra time per block allocation on vLLM's own
``BlockPool`` with the Sluice engine plugin's patches (labels, removal attribution, retention
classes, session ownership of freed blocks) against without, over a request's whole life in the
pool (prefix hit, prefill, decode, free, later eviction), measured in vLLM's virtualenv by
``bench/plugin_overhead_driver.py`` (its docstring says what one cycle contains). Target ≤ 5%.
The same cycles with a retention directive per finished request give
``BENCH plugin_alloc_overhead_with_directives_pct`` (target ≤ 10%), and with the offload pair a
paused program gets (``offload`` when it pauses, ``prefetch`` when it resumes, with a host tier)
``BENCH plugin_alloc_overhead_with_offload_directives_pct`` (reported, no target)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.common import progress, result

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def run() -> None:
    if not VLLM_PYTHON.exists():
        progress(f"skipping plugin_alloc_overhead_pct: {VLLM_PYTHON} not found (make vllm-venv)")
        return
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(VLLM_PYTHON), str(REPO / "bench" / "plugin_overhead_driver.py")],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        progress(f"plugin benchmark failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    progress(f"plugin: {figures['plain_us_per_block']:.2f} µs/block plain, "
             f"{figures['patched_us_per_block']:.2f} µs/block with the plugin; "
             f"{figures['directives_overhead_pct']:.1f}% over plain with a retain per request, "
             f"{figures['offload_directives_overhead_pct']:.1f}% with offload/prefetch; CPU time "
             f"{figures['overhead_cpu_pct']:.1f}% / {figures['directives_overhead_cpu_pct']:.1f}% / "
             f"{figures['offload_directives_overhead_cpu_pct']:.1f}%")
    result("plugin_alloc_overhead_pct", figures["overhead_pct"], "%")
    result("plugin_alloc_overhead_with_directives_pct", figures["directives_overhead_pct"], "%")
    result("plugin_alloc_overhead_with_offload_directives_pct",
           figures["offload_directives_overhead_pct"], "%")
