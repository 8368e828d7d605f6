"""Live against simulated (architecture.md §1 "One policy, two shells"; design notes "Live
against simulated"): the gateway on simworkers does what the simulator measured.

One scripted workload (sim/scripted.py) runs through the real gateway in front of real
simworkers on loopback, in real time, and through the simulator with the same engine model,
preset, KV pools, policy and config (tests/support/parity.py). The targets compare two
measurements of the same workload: prefix-cache hit rate within 2 points, pauses and resumes
within 10%, output tokens per second within 5% of the simulator's (the mean of its runs with
the first programs' start times a few milliseconds apart), for program_aware. About two and a
half minutes of wall time; ``-m parity`` selects it.
"""

from __future__ import annotations

import json

import pytest

from tests.support.parity import Comparison, ParitySetup, compare, comparison_table

pytestmark = [pytest.mark.parity, pytest.mark.slow]

HIT_RATE_POINTS = 2.0
PAUSES_RESUMES = 0.10
OUTPUT_TOKENS_PER_S = 0.05


def _report(comparison: Comparison) -> str:
    diagnostics = comparison.live.diagnostics
    return "\n".join([*comparison_table([comparison]), json.dumps(diagnostics, indent=1)])


def _check_same_workload(comparison: Comparison) -> None:
    live = comparison.live.diagnostics
    assert live["errors"] == 0, _report(comparison)
    # every answer's usage had the script's prompt and output lengths: the shells played the
    # same calls (an edited reply or another tokenization would show here first)
    assert live["calls_off_script"] == 0, _report(comparison)
    assert comparison.live.calls_completed > 300, _report(comparison)


# 120 virtual seconds: program_aware's pause count then spans ±2.3% across the simulator's own
# jittered runs, against ±3.5% over 60 s, where one live run in five came out 12% above. The
# engines order by the policy's priority (the simulator's default; the gateway sends it);
# first-come first-served engines and the baselines are compared by experiments/parity
# (kv_aware's live hit rate runs 1.4–2.2 points above the simulator's for a known reason:
# design notes, "Live against simulated").
def test_the_gateway_on_simworkers_measures_what_the_simulator_measured():
    comparison = compare(ParitySetup(), "program_aware")
    print("\n" + _report(comparison))
    _check_same_workload(comparison)
    # the workload oversubscribes the fleet's KV: the policy pauses and resumes
    assert min(comparison.live.pauses, comparison.live.resumes) > 50, _report(comparison)
    assert abs(comparison.difference("hit_rate")) <= HIT_RATE_POINTS, _report(comparison)
    assert abs(comparison.difference("pauses")) <= PAUSES_RESUMES, _report(comparison)
    assert abs(comparison.difference("resumes")) <= PAUSES_RESUMES, _report(comparison)
    assert abs(comparison.difference("output_tokens_per_s")) <= OUTPUT_TOKENS_PER_S, _report(comparison)
