"""What the simulator's commands (``sluice sim``, ``replay``, ``sweep``, ``tune``) read alike
from the command line: the options they share, the checks of their values, and the command line
itself as their results record it."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer

from entry.usage_error import usage_error
from sim.engine import SCHEDULING_POLICIES
from sim.step_time import presets

SchedulingPolicyOption = Annotated[str, typer.Option(
    "--scheduling-policy", metavar="fcfs|priority",
    help="The simulated engines' vLLM --scheduling-policy. priority (default, what the "
         "committed results use): the policy's admission priority orders each engine's "
         "queue (held and resumed calls ahead, soft-band calls later, autellix's queues); "
         "fcfs (vLLM's own default): the engines ignore it, as a fleet whose vLLM runs "
         "without --scheduling-policy priority.")]


def check_scheduling_policy(value: str) -> str:
    if value not in SCHEDULING_POLICIES:
        raise usage_error(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                          f"got {value!r}")
    return value


def check_preset(name: str) -> None:
    if name not in presets():
        raise usage_error(f"unknown preset {name!r}; choose from {', '.join(presets())}")


def command_line() -> str:
    return "sluice " + " ".join(shlex.quote(arg) for arg in sys.argv[1:])
