"""Configuration of ``sluice serve``: the gateway's own keys, the fleet and the policy.

One YAML document, every top-level key optional except ``workers``::

    listen: {host: 127.0.0.1, port: 8080}
    admin_token_env: SLUICE_ADMIN_TOKEN   # or admin_token: "..." (the env var wins if set)
    max_body_bytes: 8388608
    request_log: /var/log/sluice/requests.jsonl   # opt-in
    health_interval_s: 5.0
    capacity_retry_s: 5.0
    upstream: {connect_timeout_s: 5, read_timeout_s: 600, ...}
    workers: [{name, url, kv_events, replay, kv_topic?, directives, capacity_tokens?,
               scheduling_policy?}, ...]   # scheduling_policy: fcfs | priority (vLLM's flag)
    kv_events_bind: tcp://*:5557          # llm-d layout: one SUB, topics kv@<worker>@<model>
    kv_events_queue: 1000                 # batches queued per worker before drops (repaired)
    kv_replay_timeout_s: 2.0
    policy: {name: ..., ...}              # one section per policy: scheduler.config.AnyPolicyConfig

Errors name the key with its dotted path (``workers.1.url: ...``), as ``check-config`` does
for ``policy:``; the ``policy:`` section is validated by
:func:`scheduler.config_reading.parse_policy_config`, so both report alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from scheduler.config import ConfigError, PolicyConfig, ProgramAwareConfig, load_yaml_text

from scheduler.config_reading import AnyPolicyConfig, format_validation_errors, parse_policy_config

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"

Seconds = Annotated[float, Field(gt=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080


class UpstreamConfig(_Strict):
    """Timeouts and pool sizes of the connections to each worker."""

    connect_timeout_s: Seconds = 5.0
    # Between two chunks of a stream, or for a whole non-streaming response.
    read_timeout_s: Seconds = 600.0
    write_timeout_s: Seconds = 30.0
    # Waiting for a free connection of the worker's pool.
    pool_timeout_s: Seconds = 30.0
    max_connections: Annotated[int, Field(ge=1)] = 1024
    max_keepalive_connections: Annotated[int, Field(ge=0)] = 256
    # An idle keep-alive connection is not reused after this long; keep it below the
    # workers' own keep-alive (uvicorn's, and so vLLM's: 5 s) so a worker never closes one
    # under a request that is being sent.
    idle_expiry_s: Seconds = 3.0


class LimitsConfig(_Strict):
    """Bounds on what the gateway keeps for its clients; a call past one is refused with
    ``Retry-After`` (and counted in ``sluice_limit_refusals_total``) instead of growing
    memory or a wait without end."""

    # Programs (sessions) tracked at once: a call that would start one more is a 429.
    max_programs: Annotated[int, Field(ge=1)] = 100_000
    # Calls held at once: a call the policy would hold past this is a 429.
    max_held_calls: Annotated[int, Field(ge=1)] = 10_000
    # Longest a held call waits for admission before it gets a 503. The policy's own
    # ``max_wait_s`` (program_aware: 60 s) normally admits it long before; this bounds
    # policies without one and a fleet with no room at all.
    max_hold_s: Seconds = 600.0
    # Seconds a refused client is told to wait (``Retry-After``).
    retry_after_s: Annotated[int, Field(ge=1, le=3600)] = 5


def _check_url(value: str, schemes: tuple[str, ...], what: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"{what} must look like {schemes[0]}://HOST:PORT, got {value!r}")
    return value


# sizeof(sockaddr_un.sun_path) on Linux less the terminating NUL: ZMQ refuses longer ipc paths.
IPC_PATH_MAX_BYTES = 107


def _check_zmq_endpoint(value: str) -> str:
    """A ZMQ endpoint as zmq_bind/zmq_connect read it. ``ipc://`` is a filesystem path
    (``ipc:///abs/path``, ``ipc://relative``, ``ipc://@abstract``), not HOST:PORT, so it
    is checked apart from tcp/inproc, which a URL parser reads correctly."""
    scheme, separator, rest = value.partition("://")
    if separator and scheme == "ipc":
        if not rest or rest.endswith("/"):
            raise ValueError(f"an ipc ZMQ endpoint needs a socket path such as "
                             f"ipc:///tmp/sluice-kv.sock, got {value!r}")
        if "\x00" in rest or any(ch.isspace() for ch in rest):
            raise ValueError(f"an ipc ZMQ endpoint path cannot hold NUL or whitespace, got {value!r}")
        if len(rest.encode()) > IPC_PATH_MAX_BYTES:
            raise ValueError(f"an ipc ZMQ endpoint path is at most {IPC_PATH_MAX_BYTES} bytes "
                             f"(a Unix socket address), got {len(rest.encode())} in {value!r}")
        return value
    return _check_url(value, ("tcp", "ipc", "inproc"), "a ZMQ endpoint")


class WorkerConfig(_Strict):
    """One engine behind the gateway (configs/example.yaml documents each key)."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    url: str
    kv_events: str | None = None
    replay: str | None = None
    # -- KV-event subscriber (controller/subscriber.py) --
    # SUB filter (a topic prefix) on this worker's kv_events socket; None: every topic.
    kv_topic: str | None = None
    directives: str | None = None
    capacity_tokens: Annotated[int, Field(gt=0)] | None = None
    # How this worker's vLLM was started (its --scheduling-policy). "priority": the gateway
    # puts the policy's engine priority on each chat, completions and Responses call it sends
    # there, and vLLM orders its waiting queue by it (held and resumed calls ahead, soft-band
    # calls later, autellix's queues). "fcfs" (vLLM's default): nothing is added, and the
    # policy's ordering does not reach this engine. Anthropic Messages calls never carry it:
    # vLLM 0.32's Messages route has no priority field.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    @field_validator("name")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        if not all("!" <= ch <= "~" for ch in value):
            raise ValueError(f"must be printable ASCII without spaces, got {value!r}")
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _check_url(value.rstrip("/"), ("http", "https"), "url")

    @field_validator("kv_events", "replay", "directives")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return _check_zmq_endpoint(value)


class ServeConfig(_Strict):
    """Everything ``sluice serve`` reads. ``policy`` is the one section hot-reloaded."""

    listen: ListenConfig = ListenConfig()
    # The bearer token of /sluice/* admin endpoints. ``admin_token_env`` names an
    # environment variable read at start-up; when it is set it wins over ``admin_token``.
    # Neither set: the admin endpoints answer 403.
    admin_token: Annotated[str, Field(min_length=8)] | None = None
    admin_token_env: str | None = DEFAULT_ADMIN_TOKEN_ENV
    max_body_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_BODY_BYTES
    # One dynamo.request.trace.v1 request_end record per finished call (JSONL); opt-in.
    request_log: Path | None = None
    health_interval_s: Seconds = 5.0
    # Consecutive failed health checks before a worker counts as down.
    unhealthy_after: Annotated[int, Field(ge=1)] = 2
    capacity_retry_s: Seconds = 5.0
    # How often the config file's mtime is polled for a policy reload; 0 turns polling off
    # (SIGHUP still reloads).
    reload_poll_s: Annotated[float, Field(ge=0.0)] = 2.0
    # Served by GET /v1/models instead of asking the workers, when set.
    models: list[str] | None = None
    # Client body keys that steer the engine and are dropped before forwarding unless named
    # here: "priority" (vLLM's scheduling priority, and vLLM's X-Vllm-Priority header: a
    # client's own value then goes as sent and wins over the policy's engine priority),
    # "vllm_xargs" (every key inside it) or
    # "vllm_xargs.<key>" (that one key). Clients must not outrank the policy by default.
    forward_client_keys: list[str] = []
    limits: LimitsConfig = LimitsConfig()
    # On SIGTERM/Ctrl-C: stop accepting, let calls in progress finish for this long, then
    # end what is left (a stream gets an SSE error event, a held call a 503). Long enough
    # for one agent turn by default.
    shutdown_grace_s: Annotated[float, Field(ge=0.0)] = 120.0
    log_level: str = "info"
    upstream: UpstreamConfig = UpstreamConfig()
    # -- KV-event subscriber (controller/subscriber.py) --
    # llm-d layout: Sluice binds one SUB here and engines connect to it with topic
    # kv@<worker>@<model>; workers without their own kv_events are fed from it.
    kv_events_bind: str | None = None
    # Batches queued per worker between the socket reader and the applier; past it batches
    # are dropped, counted and repaired from the worker's replay socket.
    kv_events_queue: Annotated[int, Field(ge=1)] = 1000
    # Longest wait for each message of a replay answer before the repair gives up.
    kv_replay_timeout_s: Seconds = 2.0
    workers: Annotated[list[WorkerConfig], Field(min_length=1)]
    policy: AnyPolicyConfig = ProgramAwareConfig()

    _path: Path | None = PrivateAttr(default=None)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.lower()
        if level not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError(f"must be one of debug, info, warning, error, critical, got {value!r}")
        return level

    @field_validator("forward_client_keys")
    @classmethod
    def _engine_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key in ("priority", "vllm_xargs"):
                continue
            head, dot, sub = key.partition(".")
            if head == "vllm_xargs" and dot and sub:
                continue
            raise ValueError(f"{key!r} is not an engine key Sluice strips; name \"priority\", "
                             "\"vllm_xargs\" or \"vllm_xargs.<key>\"")
        return keys

    @field_validator("kv_events_bind")
    @classmethod
    def _zmq_bind(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return _check_zmq_endpoint(value)

    @field_validator("workers")
    @classmethod
    def _unique_worker_names(cls, workers: list[WorkerConfig]) -> list[WorkerConfig]:
        seen: set[str] = set()
        for worker in workers:
            if worker.name in seen:
                raise ValueError(f"worker name {worker.name!r} appears twice")
            seen.add(worker.name)
        return workers

    @property
    def path(self) -> Path | None:
        """The file this config was loaded from (hot reload watches it), if any."""
        return self._path

    def resolved_admin_token(self, environ: dict[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        if self.admin_token_env and env.get(self.admin_token_env):
            return env[self.admin_token_env]
        return self.admin_token


def parse_serve_config(data: Any, source: str = "<config>") -> ServeConfig:
    """Validate a mapping as a :class:`ServeConfig`; every error names its dotted key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    problems: list[str] = []
    rest = dict(data)
    policy: PolicyConfig | None = None
    try:
        policy = parse_policy_config(rest.pop("policy", None), "policy")
    except ConfigError as err:
        problems.append(str(err))
    try:
        config = ServeConfig.model_validate({**rest, "policy": policy or ProgramAwareConfig()})
    except ValidationError as err:
        problems.append(format_validation_errors(err, ""))
        config = None
    if problems:
        raise ConfigError(f"{source}: " + "\n".join(problems).replace("\n", f"\n{source}: "))
    assert config is not None
    return config


def read_config_file(path: str | os.PathLike[str]) -> str:
    """The file's text; an unreadable file is a ConfigError that says why."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a YAML file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror or err})") from None


def load_serve_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Read and validate a YAML file; errors (unreadable file included) are ConfigErrors."""
    path = Path(path)
    text = read_config_file(path)
    config = parse_serve_config(load_yaml_text(text, str(path)), str(path))
    config._path = path.resolve()
    return config
