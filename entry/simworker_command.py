"""``sluice simworker``: serve the engine model as a vLLM-like worker (simworker/worker.py).

Registered on the ``sluice`` app by ``entry.sim_commands.register``. Bad options print ``error: ...`` and
exit with status 2; a KV-event endpoint that cannot be bound stops the server at startup.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

from entry.sim_options import PresetFileOption, PresetOption, step_time_model
from entry.usage_error import usage_error


def _configure_logging() -> None:
    """JSON lines on stderr (structlog), configured when the command runs."""
    import structlog

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    structlog.configure(
        processors=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def simworker(
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="HTTP port of the OpenAI API."),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP address to listen on."),
    preset: PresetOption = None,
    preset_file: PresetFileOption = None,
    blocks: Optional[int] = typer.Option(None, "--blocks", min=2,
                                         help="KV blocks, null block included (vLLM's num_gpu_blocks); "
                                              "default: the preset's KV pool."),
    block_size: int = typer.Option(16, "--block-size", min=1, help="KV block size in tokens."),
    kv_events: Optional[str] = typer.Option(
        None, "--kv-events",
        help="ZMQ PUB endpoint for KV events; bound if it holds '*' or '::' (e.g. tcp://*:5557, "
             "which needs keys or --allow-insecure-bind) or is ipc://, else connected to, as in "
             "vLLM. Default: ipc://<temp dir>/sluice-simworker-<port>-kv (a 0600 file)."),
    replay: Optional[str] = typer.Option(None, "--replay",
                                         help="ZMQ ROUTER endpoint answering replay requests."),
    directives: Optional[str] = typer.Option(
        None, "--directives",
        help="ZMQ PULL endpoint for Sluice's retention directives (the worker's `directives` in "
             "sluice.yaml), as the engine plugin's SLUICE_DIRECTIVE_ENDPOINT; e.g. tcp://*:5590."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Wall seconds per model second (0.1 runs 10x faster)."),
    prefill_scale: float = typer.Option(1.0, "--prefill-scale",
                                        help="Multiply the preset's prefill costs, per prompt token "
                                             "and per prefill attention pair, so a prompt costs this "
                                             "many times as much (a small demo pool's short contexts "
                                             "re-prefill as dearly as long ones on a GPU)."),
    topic: Optional[str] = typer.Option(None, "--topic",
                                        help='Topic frame of KV events (default "kv@<name>").'),
    name: str = typer.Option("w0", "--name", help="Worker name (engine name, default topic)."),
    model: str = typer.Option("sluice-sim", "--model",
                              help="Model name served on /v1/models; a request naming another is a 404, as on vLLM."),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", min=1,
        help="vLLM's --max-model-len: the most a prompt plus its reply may hold, and the largest "
             "max_tokens accepted; default 131072 or the KV pool, whichever is larger."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", min=1,
                                               help="vLLM's --max-num-seqs: calls in a batch; "
                                                    "default: the preset's."),
    scheduling_policy: str = typer.Option(
        "fcfs", "--scheduling-policy",
        help="vLLM's --scheduling-policy: fcfs (arrival order; a request's priority is ignored) or "
             "priority (the body's integer priority orders the queue, lower first)."),
    tool_call_turns: int = typer.Option(
        0, "--tool-call-turns", min=0,
        help="Answer a request that offers tools with a call of one of them while its conversation "
             "holds fewer than this many tool results (0: always text)."),
    sampling_seed: Optional[int] = typer.Option(
        None, "--sampling-seed",
        help="Seed of the worker's sampling (replies to requests without a seed or temperature 0); "
             "default: fresh entropy."),
    zmq_secret_key_file: Optional[str] = typer.Option(
        None, "--zmq-secret-key-file",
        help="This worker's CurveZMQ key pair (a NAME.key_secret file from `sluice keys`): the "
             "KV-event, replay and directive sockets become CURVE servers. Needs "
             "--zmq-client-keys-dir."),
    zmq_client_keys_dir: Optional[str] = typer.Option(
        None, "--zmq-client-keys-dir",
        help="Directory of the client public keys (NAME.key) the sockets accept: the gateway's."),
    allow_insecure_bind: bool = typer.Option(
        False, "--allow-insecure-bind",
        help="Let a socket without keys listen beyond loopback (e.g. tcp://*:5557): anyone who "
             "reaches it can read KV events or push directives."),
) -> None:
    """Serve the OpenAI API, /metrics and vLLM-format KV events from the simulated engine."""
    step_time = step_time_model(preset, preset_file)
    if not time_scale > 0:
        raise usage_error(f"--time-scale must be > 0, got {time_scale}")
    if not prefill_scale > 0:
        raise usage_error(f"--prefill-scale must be > 0, got {prefill_scale}")
    if kv_events is None:
        # private to this machine's user by default: a bound ipc:// file is made 0600
        kv_events = f"ipc://{Path(tempfile.gettempdir()) / f'sluice-simworker-{port}-kv'}"
    if not kv_events:
        raise usage_error("--kv-events needs an endpoint such as ipc:///tmp/w0-kv")
    if scheduling_policy not in ("fcfs", "priority"):
        raise usage_error(f"--scheduling-policy must be fcfs or priority, got {scheduling_policy!r}")

    import uvicorn

    from simworker.worker import SimWorkerConfig, create_app

    try:
        config = SimWorkerConfig(name=name, model=model, preset=step_time, num_blocks=blocks,
                                 block_size=block_size, kv_events=kv_events, replay=replay or None,
                                 directives=directives or None,
                                 topic=topic, time_scale=time_scale, prefill_scale=prefill_scale,
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 scheduling_policy=scheduling_policy,
                                 tool_call_turns=tool_call_turns, sampling_seed=sampling_seed,
                                 zmq_secret_key_file=zmq_secret_key_file,
                                 zmq_client_keys_dir=zmq_client_keys_dir,
                                 allow_insecure_bind=allow_insecure_bind)
    except ValueError as err:
        raise usage_error(str(err)) from None
    _configure_logging()
    origin = f" from {preset_file}" if preset_file is not None else ""
    typer.echo(f"simworker {name}: http://{host}:{port} model {model}, preset {step_time.name}"
               f"{origin} ({step_time.provenance.kind}), "
               f"KV events {kv_events} topic {config.kv_topic!r}"
               + (f", replay {replay}" if replay else "")
               + (f", directives {directives}" if directives else "") + f", time scale {time_scale}"
               + f", scheduling {scheduling_policy}"
               + (f", tool calls for {tool_call_turns} turns" if tool_call_turns else ""), err=True)
    uvicorn.run(create_app(config), host=host, port=port, log_level="warning", lifespan="on",
                access_log=False)
