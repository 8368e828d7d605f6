"""Where programs' first calls go after a gateway restarts (design notes, "Sharded gateways").

The restart test's fleet (tests/integration/test_gateway_restart.py: 2 simworkers with KV
events and replay, 8 programs with prompts of their own): a first gateway runs one call of
each program and stops; a second starts on the same workers, waits 2 s, and all 8 programs
call at once. Prints how many went back to the worker holding their KV and the share of
prompt tokens served from cache.

    .venv/bin/python -m experiments.restart_placement
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.integration.test_gateway_restart import PROGRAMS, first_gateway_run, fleet, turn
from tests.support.gateway_harness import gateway, serve_config


def main() -> None:
    with fleet() as entries:
        config = serve_config(entries, capacity_retry_s=0.05)
        homes = first_gateway_run(config)
        with gateway(config) as second:
            time.sleep(2.0)
            with ThreadPoolExecutor(len(PROGRAMS)) as pool:
                usages = list(pool.map(lambda program: turn(second, program, 2), PROGRAMS))
            placed = second.programs()
    back = sum(placed[program]["home_worker"] == homes[program] for program in PROGRAMS)
    cached = sum((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for usage in usages)
    prompt = sum(usage["prompt_tokens"] for usage in usages)
    print(f"{back}/{len(PROGRAMS)} programs back on the worker holding their KV; "
          f"{cached:,} of {prompt:,} prompt tokens from cache")


if __name__ == "__main__":
    main()
