"""The ``sluice`` command line.

Today: ``check-config``, ``policies`` and ``demo``. ``serve`` (the gateway) and ``sim`` /
``replay`` / ``sweep`` / ``simworker`` (the simulator) join as those shells land.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    name="sluice",
    help="Sluice: a session-aware admission scheduler for agentic LLM traffic in front of vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command(
    "check-config",
    help="Validate the policy: section of a Sluice YAML file; exit 2 if it is not usable.",
)
def check_config(
    path: str = typer.Argument(
        ..., help="The YAML file to check (e.g. configs/example.yaml).", metavar="PATH"
    ),
) -> None:
    from scheduler.config import ConfigError, parse_policy_yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(f"{path}: no such file") from None
    except IsADirectoryError:
        raise _fail(f"{path}: is a directory, not a YAML file") from None
    except PermissionError:
        raise _fail(f"{path}: permission denied") from None
    except UnicodeDecodeError as err:
        raise _fail(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise _fail(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        config = parse_policy_yaml(text, source=path)
    except ConfigError as err:
        raise _fail(str(err)) from None
    typer.echo(f"ok: policy {config.name}")


def _summary_line(cls: type) -> str:
    """The docstring's summary: its first line, continued to the end of that sentence when
    the sentence wraps. Falls back to the module docstring for a class without one."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    paragraph = []
    for line in doc.strip().splitlines():
        if not line.strip():
            break
        paragraph.append(line.strip())
        if line.rstrip().endswith("."):
            break
    return " ".join(paragraph).replace("``", "")


@app.command("policies", help="List the registered policies with a one-line description of each.")
def policies() -> None:
    from scheduler.config import PolicyConfig
    from scheduler.policies import POLICIES

    default = PolicyConfig().name
    width = max(len(name) for name in POLICIES)
    for name, cls in POLICIES.items():
        marker = "*" if name == default else " "
        typer.echo(f"{marker} {name:<{width}}  {_summary_line(cls)}")
    typer.echo("(* the default; choose one with policy.name in the YAML)")


@app.command(
    "demo",
    help="Run a scripted SWE-bench-like workload on two toy workers under each policy and "
    "print every decision the policy takes, then a comparison (virtual time, a few seconds).",
)
def demo(
    policy: Optional[list[str]] = typer.Option(
        None, "--policy", "-p",
        help="Policy to run; repeat to compare several. Default: program_aware and kv_aware.",
        metavar="NAME",
    ),
    json_path: Optional[Path] = typer.Option(
        None, "--json", help="Also write the summary (scenario and per-policy measures) to this JSON file.",
        metavar="PATH", dir_okay=False,
    ),
    seed: int = typer.Option(7, "--seed", help="Seed of the RNG that draws tool times and output lengths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary, not each decision."),
) -> None:
    from controller.demo import DEFAULT_POLICIES, Scenario, format_summary, run_demo
    from scheduler.policies import POLICIES

    names = tuple(policy) if policy else DEFAULT_POLICIES
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise _fail(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    scenario = Scenario(seed=seed)
    typer.echo(
        f"Sluice demo: {scenario.programs} SWE-bench-like programs sharing a "
        f"{scenario.shared_tokens:,}-token prompt, contexts growing to "
        f"~{scenario.max_context_tokens:,} tokens, on {scenario.workers} toy workers of "
        f"{scenario.capacity_tokens:,} tokens of KV each."
    )
    typer.echo(
        "Each line is a decision the policy returned: virtual time, action, session, worker, "
        "and the worker's utilization U (the policy's ledger) right after the call that returned it."
    )
    emit = None if quiet else typer.echo
    result = run_demo(names, scenario, emit=emit)
    for line in format_summary(result):
        typer.echo(line)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            raise _fail(f"{json_path}: cannot write ({err.strerror or err})") from None
        typer.echo(f"\nwrote {json_path}")


def _register_simulator_commands() -> None:
    from sim.cli import register

    register(app)


_register_simulator_commands()


if __name__ == "__main__":  # pragma: no cover
    app()
