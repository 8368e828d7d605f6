"""What the simulator's commands (``sluice sim``, ``replay``, ``sweep``, ``tune``, and
``simworker``) read alike from the command line: the options they share, the checks of their
values, and the command line itself as their results record it."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from entry.usage_error import usage_error
from scheduler.config import ConfigError, PolicyConfig
from sim.engine import SCHEDULING_POLICIES
from sim.preset_file import read_preset_file
from sim.runs import policy_cost_notes, preset_policy_costs
from sim.step_time import DEFAULT_PRESET, StepTimeModel, presets

SchedulingPolicyOption = Annotated[str, typer.Option(
    "--scheduling-policy", metavar="fcfs|priority",
    help="The simulated engines' vLLM --scheduling-policy. priority (default, what the "
         "committed results use): the policy's admission priority orders each engine's "
         "queue (held and resumed calls ahead, soft-band calls later, autellix's queues); "
         "fcfs (vLLM's own default): the engines ignore it, as a fleet whose vLLM runs "
         "without --scheduling-policy priority.")]


# The step-time model: a named preset or a preset file, never both. --preset has no default
# of its own so that naming both is an error rather than the file silently winning.
PresetOption = Annotated[str | None, typer.Option(
    "--preset", metavar="NAME",
    help=f"Hardware/model step-time preset (see `sluice presets`; default {DEFAULT_PRESET}).")]
PresetFileOption = Annotated[Path | None, typer.Option(
    "--preset-file", dir_okay=False, metavar="PATH",
    help="Use the step-time preset in this YAML file instead of a named one: one that "
         "`sluice calibrate` or bench/gpu_profile.py measured and wrote (`sluice presets "
         "--file PATH` shows it). Not with --preset.")]


def step_time_model(preset: str | None, preset_file: Path | None) -> StepTimeModel:
    """The model --preset or --preset-file chose (the default preset if neither did); both,
    an unknown name or a bad file is a usage error naming it."""
    if preset is not None and preset_file is not None:
        raise usage_error("--preset and --preset-file both choose the step-time model; give one")
    if preset_file is not None:
        try:
            return read_preset_file(preset_file)
        except ConfigError as err:
            raise usage_error(str(err)) from None
    name = DEFAULT_PRESET if preset is None else preset
    check_preset(name)
    return presets()[name]


def policy_costs(model: StepTimeModel, preset_file: Path | None, policy_config: PolicyConfig | None,
                 policies: Sequence[str]) -> dict[str, float]:
    """The policies' cost terms from the preset (a named preset gives only vllm_router's:
    :func:`~sim.runs.preset_policy_costs`), saying on stderr what each policy that has them
    takes and keeps."""
    costs = preset_policy_costs(model, preset_file)
    source = "the preset file" if preset_file is not None else f"the {model.name} preset"
    for note in policy_cost_notes(policy_config, policies, costs, source):
        typer.echo(note, err=True)
    return costs


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
