"""The ``sluice`` command line.

``check-config``, ``policies``, ``demo``, ``serve`` (the gateway), ``keys`` and the simulator's
commands (registered from ``entry.sim_commands``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from entry.usage_error import usage_error

app = typer.Typer(
    name="sluice",
    help="Sluice: a session-aware admission scheduler for agentic LLM traffic in front of vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command(
    "check-config",
    help="Validate a Sluice YAML file exactly as `sluice serve` reads it (every section, workers "
    "included); a file with only a policy: section is checked as a policy file. Exit 2 if it is "
    "not usable.",
)
def check_config(
    path: str = typer.Argument(
        ..., help="The YAML file to check (e.g. configs/example.yaml).", metavar="PATH"
    ),
) -> None:
    import warnings

    # Deprecations are printed once, from the config itself, not as Python warnings too.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _check_config(path)


def _check_config(path: str) -> None:
    from scheduler.config import ConfigError, load_yaml_text
    from scheduler.config_reading import parse_policy_config

    from controller.serve_config import load_serve_config, read_config_file

    try:
        data = load_yaml_text(read_config_file(path), path)
        if not isinstance(data, dict) and data is not None:
            raise ConfigError(f"{path}: the top level must be a mapping")
        if set(data or {}) <= {"policy"}:
            # A policy-only file (what `sluice sim --config` reads) is a valid input of its
            # own; say plainly that serve needs more, rather than calling it a serve config.
            try:
                policy = parse_policy_config((data or {}).get("policy"), "policy")
            except ConfigError as err:
                raise ConfigError(f"{path}: {err}") from None
            _echo_deprecations(policy)
            typer.echo(f"ok: policy {policy.name} (policy section only: `sluice serve` "
                       f"also needs workers:)")
            return
        # Anything beyond policy: is a serve config: the very loader serve uses, so
        # check-config never passes a file that serve refuses.
        settings = load_serve_config(path)
    except ConfigError as err:
        raise usage_error(str(err)) from None
    _echo_deprecations(settings.policy)
    names = ", ".join(worker.name for worker in settings.workers)
    typer.echo(f"ok: policy {settings.policy.name}; serve config with "
               f"{len(settings.workers)} worker(s) ({names}), listening on "
               f"{settings.listen.host}:{settings.listen.port}")


def _echo_deprecations(policy: object) -> None:
    for note in getattr(policy, "deprecation_notes", ()):
        typer.echo(f"warning: {note}", err=True)


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
    from scheduler.config import DEFAULT_POLICY
    from scheduler.policies import POLICIES

    default = DEFAULT_POLICY
    width = max(len(name) for name in POLICIES)
    for name, cls in POLICIES.items():
        marker = "*" if name == default else " "
        typer.echo(f"{marker} {name:<{width}}  {_summary_line(cls)}")
    typer.echo("(* the default; choose one with policy.name in the YAML)")


@app.command(
    "demo",
    help="The whole system on this machine, no GPU: 4 simworkers, the gateway and a closed-loop "
    "SWE-bench-style agent client that oversubscribes the fleet, under each policy in turn; live "
    "per-worker utilization and programs by state, then the results side by side (about 90 s).",
)
def demo(
    policy: Optional[list[str]] = typer.Option(
        None, "--policy", "-p",
        help="Policy to run; repeat to compare several. Default: program_aware and kv_aware.",
        metavar="NAME",
    ),
    json_path: Optional[Path] = typer.Option(
        None, "--json", help="Also write the results (per policy) and the setup to this JSON file.",
        metavar="PATH", dir_okay=False,
    ),
    concurrency: int = typer.Option(32, "--concurrency", min=1, help="Agents alive at once."),
    duration: float = typer.Option(25.0, "--duration", min=5.0,
                                   help="Wall-clock seconds of load per policy."),
    seed: int = typer.Option(7, "--seed", help="Workload seed (tool times, lengths, turns)."),
) -> None:
    from entry.live_demo import DEFAULT_POLICIES, DemoSetup, run_demo
    from scheduler.policies import POLICIES

    names = tuple(policy) if policy else DEFAULT_POLICIES
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise usage_error(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    setup = DemoSetup(concurrency=concurrency, duration_s=duration, seed=seed)
    try:
        run_demo(names, setup, typer.echo, json_path)
    except RuntimeError as err:
        raise usage_error(str(err)) from None


@app.command(
    "serve",
    help="Run the gateway: the OpenAI/Anthropic-compatible proxy that admits programs onto the "
    "workers listed in the config (see configs/example.yaml). On Ctrl-C / SIGTERM it stops "
    "accepting and gives calls in progress shutdown_grace_s to finish; "
    "reloads the policy thresholds on SIGHUP or when the file changes.",
)
def serve(
    config: Path = typer.Option(..., "--config", "-c", help="The Sluice YAML file.", metavar="PATH"),
    host: Optional[str] = typer.Option(None, "--host", help="Override listen.host from the file."),
    port: Optional[int] = typer.Option(None, "--port", min=0, max=65535,
                                       help="Override listen.port from the file."),
    relays: int = typer.Option(
        1, "--relays", min=1, max=64,
        help="Processes relaying HTTP on the port. 1: the gateway is one process. N > 1: the "
        "policy in one process and N relay processes in front of it on the same port "
        "(SO_REUSEPORT), for more calls and streams than one core relays; same admission, "
        "metrics summed over the processes, the same drain on SIGTERM. Worth it only with "
        "cores to spare beyond the workers' and the clients' (docs/architecture.md §8)."),
) -> None:
    from controller.gateway import create_app
    from controller.server import run_gateway
    from controller.serve_config import load_serve_config
    from scheduler.config import ConfigError

    try:
        settings = load_serve_config(config)
    except ConfigError as err:
        raise usage_error(str(err)) from None
    listen_host = host or settings.listen.host
    listen_port = settings.listen.port if port is None else port
    if relays > 1:
        from controller.relay_processes import RelayGroup

        raise typer.Exit(RelayGroup(config, listen_host, listen_port, relays,
                                    settings.log_level).run())
    app_ = create_app(settings)
    run_gateway(app_, listen_host, listen_port)


@app.command(
    "top",
    help="A live view of a running gateway: workers (health, U, capacity, programs), programs "
    "by state, held calls and the largest programs, refreshed every --interval seconds from "
    "its admin API. Ctrl-C to leave.",
)
def top(
    url: str = typer.Option("http://127.0.0.1:8080", "--url", help="The gateway's base URL."),
    token: Optional[str] = typer.Option(None, "--token", help="The admin bearer token "
                                        "(default: the variable --token-env names)."),
    token_env: str = typer.Option("SLUICE_ADMIN_TOKEN", "--token-env",
                                  help="Environment variable holding the admin token."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one screen and exit (for scripts)."),
) -> None:
    import os

    from entry.top import TopError, run_top

    try:
        run_top(url.rstrip("/"), token or os.environ.get(token_env), interval, once, typer.echo)
    except TopError as err:
        raise usage_error(str(err)) from None
    except KeyboardInterrupt:
        pass


@app.command(
    "keys",
    help="Write a CurveZMQ key pair: DIR/NAME.key (public: give it to the other side) and "
    "DIR/NAME.key_secret (secret, mode 0600: the gateway's zmq_keys.secret_key_file, a "
    "simworker's --zmq-secret-key-file, the plugin's SLUICE_ZMQ_SECRET_KEY_FILE). A server "
    "accepts the clients whose NAME.key is in its client keys directory.",
)
def keys(
    directory: Path = typer.Argument(..., help="Where to write the files (made if missing).",
                                     metavar="DIR"),
    name: str = typer.Option(..., "--name", help="The files' name, e.g. gateway or worker0."),
) -> None:
    from controller.zmq_keys import ZmqKeyError, write_key_pair

    try:
        public, secret = write_key_pair(directory, name)
    except (ZmqKeyError, OSError) as err:
        raise usage_error(str(err)) from None
    typer.echo(f"public key: {public}\nsecret key: {secret} (mode 0600)")


def _register_simulator_commands() -> None:
    from entry.sim_commands import register

    register(app)
    from entry.calibrate_command import calibrate
    app.command("calibrate")(calibrate)


_register_simulator_commands()


if __name__ == "__main__":  # pragma: no cover
    app()
