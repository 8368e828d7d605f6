"""Configuration of ``sluice serve``: the gateway's own keys, the fleet and the policy.

One YAML document, every top-level key optional except ``workers``::

    listen: {host: 127.0.0.1, port: 8080}
    admin_token_env: SLUICE_ADMIN_TOKEN   # or admin_token: "..." (the env var wins if set)
    max_body_bytes: 8388608
    http: {keep_alive_s: 75, header_timeout_s: 20, max_connections: 2048, ...}
    request_log: /var/log/sluice/requests.jsonl   # opt-in
    health_interval_s: 5.0
    capacity_retry_s: 5.0
    upstream: {connect_timeout_s: 5, read_timeout_s: 600, ...}
    worker_urls: {schemes: [http, https], networks: [127.0.0.0/8, 10.0.0.0/8, ...], hosts: []}
    forward_client_headers: []            # client headers the workers get (none by default)
    workers: [{name, url, kv_events, replay, kv_topic?, directives, capacity_tokens?,
               scheduling_policy?}, ...]   # scheduling_policy: fcfs | priority (vLLM's flag)
    kv_events_bind: tcp://*:5557          # llm-d layout: one SUB, topics kv@<worker>@<model>
    kv_events_queue: 1000                 # batches queued per worker before drops (repaired)
    kv_replay_timeout_s: 2.0
    zmq_keys: {secret_key_file: keys/gateway.key_secret,   # CurveZMQ key pair
               publisher_keys_dir: keys/publishers}       # who may feed kv_events_bind
    allow_insecure_bind: false            # kv_events_bind, kv_events: tcp://*, without keys
    clients: {keys_file: clients.yaml, max_programs: 100}   # optional client API keys
    shards: {index: 0, gateways: [http://gw-0:8080, http://gw-1:8080]}   # optional
    policy: {name: ..., ...}              # one section per policy: scheduler.config.AnyPolicyConfig

Errors name the key with its dotted path (``workers.1.url: ...``), as ``check-config`` does
for ``policy:``; the ``policy:`` section is validated by
:func:`scheduler.config_reading.parse_policy_config`, so both report alike.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from scheduler.config import ConfigError, PolicyConfig, ProgramAwareConfig, load_yaml_text

from controller.kv_wire import binds, check_zmq_endpoint
from controller.shards_config import ShardsConfig
from controller.worker_urls import (
    DEFAULT_NETWORKS,
    DEFAULT_SCHEMES,
    UrlAllowList,
    WorkerUrlRefused,
)
from scheduler.config_reading import AnyPolicyConfig, format_validation_errors, parse_policy_config
from sluice_vllm_plugin.zmq_auth import PUBLIC_SUFFIX, check_bind, load_key_pair, load_public_key

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"
# Client body keys, besides "priority" and "vllm_xargs", with which vLLM 0.32 lets a request
# steer the engine rather than its own answer; dropped unless forward_client_keys names them.
ENGINE_CONTROL_KEYS = (
    # Passed to the KV connector as sampling_params.extra_args["kv_transfer_params"]
    # (entrypoints/openai/chat_completion/protocol.py and completion/protocol.py
    # to_sampling_params; read by v1/request.py Request.__init__ and the connectors): in a
    # disaggregated setup it tells the engine where to pull or push KV blocks.
    "kv_transfer_params",
    # The same for the encoder cache (extra_args["ec_transfer_params"], same places).
    "ec_transfer_params",
    # The engine's request id (chat_completion/serving.py and completion/serving.py
    # _base_request_id(raw_request, request.request_id); responses/serving.py uses it as
    # is): chosen by the client it can collide with another client's request.
    "request_id",
)
# Request headers the gateway sets itself (controller/upstream.py forward_headers), and those
# that are the connection's: never taken from the client through forward_client_headers.
GATEWAY_SET_HEADERS = frozenset({
    "content-type", "content-length", "host", "accept-encoding", "x-session-id",
    "x-vllm-priority", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})

Seconds = Annotated[float, Field(gt=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080


class HttpConfig(_Strict):
    """Bounds of the client-facing listener (controller/server.py): what a client connection
    may send, how long it may take, and how many may be open. A request past one is answered
    with an error (431, 408, 503) and its connection closed."""

    # An idle connection between two requests is closed after this long. Above the pool
    # expiry of common clients (httpx, and so the OpenAI and Anthropic Python SDKs: 5 s;
    # Node's undici: 4 s; aiohttp: 15 s), so that the client ends an idle connection, not
    # the gateway: a server that closes one just as the client reuses it loses that call.
    keep_alive_s: Seconds = 75.0
    # The request line and headers must arrive within this long of the connection's start
    # (or of a later request's first byte): else 408, or a plain close if nothing came.
    header_timeout_s: Seconds = 20.0
    # The whole request body must arrive within this long of its headers: else 408.
    body_timeout_s: Seconds = 60.0
    # A client that reads nothing of its answer for this long (the gateway's write buffer to
    # it stays full) is disconnected: its call is aborted upstream and in the policy.
    send_timeout_s: Seconds = 30.0
    # Open client connections (idle keep-alive ones included); a request on one past it
    # gets 503 with Retry-After. Keep it under the process's descriptor limit, less the
    # connections to the workers.
    max_connections: Annotated[int, Field(ge=1)] = 2048
    # The request line and headers together, in bytes, and the number of header fields:
    # past either, 431.
    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    max_headers: Annotated[int, Field(ge=1)] = 100


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


class ClientsConfig(_Strict):
    """Optional client API keys (controller/client_keys.py documents the keys' format). With
    neither source set, clients need no key; with one, every client call must carry a key
    (``Authorization: Bearer <key>`` or ``x-api-key: <key>``), else 401. Read at start-up."""

    # A YAML (or JSON) file of the keys, name → key or name → {key, max_programs,
    # max_held_calls}; a relative path is taken from the config file's folder.
    keys_file: Path | None = None
    # An environment variable that holds the same mapping as the file (both set: both are
    # read, and no name may appear in both). A variable named here but unset stops the start.
    keys_env: str | None = None
    # Each key's own bounds, for a key that names none of its own, on top of ``limits:``:
    # programs it owns at once and calls of it held at once (past either: 429). None: only
    # ``limits:`` bounds the key.
    max_programs: Annotated[int, Field(ge=1)] | None = None
    max_held_calls: Annotated[int, Field(ge=1)] | None = None


def _check_url(value: str, schemes: tuple[str, ...], what: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"{what} must look like {schemes[0]}://HOST:PORT, got {value!r}")
    return value


class WorkerUrlsConfig(_Strict):
    """Where workers may be (controller/worker_urls.py): every worker URL, from ``workers:``
    and from ``POST /sluice/workers``, is ``scheme://HOST[:PORT]`` with one of ``schemes``,
    and its host is named in ``hosts`` or lies (every address it resolves to) in one of
    ``networks``. The default allows loopback and private networks, not link-local ones
    (169.254.0.0/16, fe80::/10: cloud metadata services) nor public addresses."""

    schemes: Annotated[list[Literal["http", "https"]], Field(min_length=1)] = list(DEFAULT_SCHEMES)
    # Host names trusted as named, without resolving them (exact, case-insensitive): only
    # names whose DNS you control.
    hosts: list[Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")]] = []
    networks: list[IPvAnyNetwork] = [ipaddress.ip_network(n) for n in DEFAULT_NETWORKS]

    def allow_list(self) -> UrlAllowList:
        return UrlAllowList.of(self.schemes, self.hosts, self.networks)


# A worker API key is sent in a header: printable ASCII without spaces, of a sane length.
_API_KEY_MAX_CHARS = 4096


def _checked_api_key(key: str, source: str) -> str:
    if not key:
        raise ConfigError(f"{source} is empty")
    if len(key) > _API_KEY_MAX_CHARS:
        raise ConfigError(f"{source} holds {len(key)} characters; an API key has at most "
                          f"{_API_KEY_MAX_CHARS}")
    if not all("!" <= ch <= "~" for ch in key):
        # the key itself is not repeated: the message ends up in logs
        raise ConfigError(f"{source} must hold one API key of printable ASCII without spaces")
    return key


class ZmqKeysConfig(_Strict):
    """The gateway's CurveZMQ key pair (controller/zmq_keys.py): the ``NAME.key_secret``
    file ``sluice keys`` writes (it holds the public key too). Workers accept the gateway
    when its ``NAME.key`` is in their client keys directory."""

    secret_key_file: Path
    # The public keys (NAME.key) of the publishers that may feed kv_events_bind: with it that
    # socket is a CURVE server, and a publisher whose key is not here is not heard.
    publisher_keys_dir: Path | None = None

    @field_validator("secret_key_file")
    @classmethod
    def _key_pair(cls, value: Path) -> Path:
        load_key_pair(value)  # a ZmqKeyError (a ValueError) says what is wrong with it
        return value

    @field_validator("publisher_keys_dir")
    @classmethod
    def _public_keys(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.is_dir() and any(value.glob(f"*{PUBLIC_SUFFIX}"))):
            # an empty directory would turn every publisher away, which is surely a mistake
            raise ValueError(f"{value}: not a directory holding publisher public keys "
                             f"(*{PUBLIC_SUFFIX})")
        return value


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
    # The worker's vLLM API key (its --api-key), sent as "Authorization: Bearer <key>" on
    # every request to this worker and no other (calls, health checks, /metrics probes,
    # /v1/models): the name of an environment variable that holds it, or a file whose
    # content is it (one line). Never the key itself, so that no config or admin listing
    # shows it. Read when the worker joins (the gateway starting, or the admin API).
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    api_key_file: Path | None = None
    # The worker's CurveZMQ public key (its NAME.key file): the gateway's directive, KV-event
    # and replay sockets to this worker then authenticate it and themselves (needs zmq_keys).
    zmq_server_key: Path | None = None

    @field_validator("zmq_server_key")
    @classmethod
    def _public_key(cls, value: Path | None) -> Path | None:
        if value is not None:
            load_public_key(value)  # a ZmqKeyError (a ValueError) says what is wrong with it
        return value

    @model_validator(mode="after")
    def _one_api_key_source(self) -> WorkerConfig:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give the worker's API key by api_key_env or api_key_file, not both")
        return self

    def api_key(self, environ: dict[str, str] | None = None) -> str | None:
        """The worker's API key, read now (None when it has none); a ConfigError that names
        the key (``api_key_env`` or ``api_key_file``) and never the key's value."""
        if self.api_key_env is not None:
            env = os.environ if environ is None else environ
            value = env.get(self.api_key_env)
            if value is None:
                raise ConfigError(f"api_key_env: the environment variable {self.api_key_env} "
                                  "is not set")
            return _checked_api_key(value, f"api_key_env: the environment variable "
                                           f"{self.api_key_env}")
        if self.api_key_file is not None:
            source = f"api_key_file: {self.api_key_file}"
            try:
                with open(self.api_key_file, encoding="utf-8") as file:
                    text = file.read(_API_KEY_MAX_CHARS + 2)  # a key, a newline, and one more
            except (OSError, UnicodeDecodeError) as err:
                reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                raise ConfigError(f"{source}: cannot read ({reason})") from None
            return _checked_api_key(text.rstrip("\r\n"), source)
        return None

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
        return check_zmq_endpoint(value)

    def connected_endpoints(self) -> dict[str, str]:
        """The ZMQ endpoints the gateway connects to, by key (held to ``worker_urls`` as the
        URL is): all given but a ``kv_events`` it binds (controller/kv_wire.py ``binds``)."""
        given = {"kv_events": self.kv_events, "replay": self.replay, "directives": self.directives}
        return {key: endpoint for key, endpoint in given.items()
                if endpoint is not None and not (key == "kv_events" and binds(endpoint))}


class ServeConfig(_Strict):
    """Everything ``sluice serve`` reads. ``policy`` is the one section hot-reloaded."""

    listen: ListenConfig = ListenConfig()
    # The bearer token of /sluice/* admin endpoints. ``admin_token_env`` names an
    # environment variable read at start-up; when it is set it wins over ``admin_token``.
    # Neither set: the admin endpoints answer 403.
    admin_token: Annotated[str, Field(min_length=8)] | None = None
    admin_token_env: str | None = DEFAULT_ADMIN_TOKEN_ENV
    max_body_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_BODY_BYTES
    http: HttpConfig = HttpConfig()
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
    # "vllm_xargs.<key>" (that one key), and the keys of ENGINE_CONTROL_KEYS
    # ("kv_transfer_params", "ec_transfer_params", "request_id"). Clients must not outrank
    # the policy, nor steer the engine's KV transfers or request ids, by default.
    forward_client_keys: list[str] = []
    # Client request headers forwarded to the workers; no other is. Names (any case), or
    # prefixes ending in "*" ("x-trace-*"). The gateway sets what the worker needs itself
    # (content-type, x-session-id; x-vllm-priority when forward_client_keys names priority;
    # the worker's own Authorization when it has an API key, which replaces the client's).
    # By default a client's Authorization, Cookie, x-api-key... stay at the gateway.
    forward_client_headers: list[str] = []
    # Where workers may be: schemes, trusted host names, networks (controller/worker_urls.py).
    worker_urls: WorkerUrlsConfig = WorkerUrlsConfig()
    limits: LimitsConfig = LimitsConfig()
    clients: ClientsConfig = ClientsConfig()
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
    # The gateway's CurveZMQ key pair, used with each worker that has a zmq_server_key.
    zmq_keys: ZmqKeysConfig | None = None
    # kv_events_bind without publisher_keys_dir, or a worker's kv_events holding * without its
    # zmq_server_key, may listen beyond loopback only if true: anyone reaching it feeds the index.
    allow_insecure_bind: bool = False
    # Sharded gateways behind a balancer that knows nothing of programs: each call for a
    # program another gateway owns is forwarded to it once (controller/shard_forward.py).
    shards: ShardsConfig | None = None
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
            if key in ("priority", "vllm_xargs") or key in ENGINE_CONTROL_KEYS:
                continue
            head, dot, sub = key.partition(".")
            if head == "vllm_xargs" and dot and sub:
                continue
            raise ValueError(f"{key!r} is not an engine key Sluice strips; name \"priority\", "
                             "\"vllm_xargs\", \"vllm_xargs.<key>\" or one of "
                             + ", ".join(f'"{k}"' for k in ENGINE_CONTROL_KEYS))
        return keys

    @field_validator("forward_client_headers")
    @classmethod
    def _client_headers(cls, names: list[str]) -> list[str]:
        lowered = []
        for name in names:
            lower = name.lower()
            stem = lower[:-1] if lower.endswith("*") else lower
            if not stem or not all(ch.isalnum() or ch in "-_." for ch in stem):
                raise ValueError(f"{name!r} is not a header name (nor a prefix ending in *)")
            if lower in GATEWAY_SET_HEADERS:
                raise ValueError(f"{name!r} is set by the gateway itself and cannot be "
                                 "forwarded from the client")
            lowered.append(lower)
        return lowered

    @model_validator(mode="after")
    def _workers_allowed(self) -> ServeConfig:
        """Every configured worker URL is of a form and (when it is written as an IP
        address) in a network ``worker_urls`` allows; host names are resolved and checked
        when the workers join (controller/fleet.py), not here: validation also runs on a
        hot reload, inside the event loop, which must not wait on DNS."""
        allow = self.worker_urls.allow_list()
        problems = []
        for index, worker in enumerate(self.workers):
            try:
                allow.check_form(worker.url)
            except WorkerUrlRefused as err:
                problems.append(f"workers.{index}.url: {err}")
            for key, endpoint in worker.connected_endpoints().items():
                try:
                    allow.check_endpoint_form(endpoint)
                except WorkerUrlRefused as err:
                    problems.append(f"workers.{index}.{key}: {err}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _zmq_keys_given(self) -> ServeConfig:
        """A worker's zmq_server_key needs the gateway's own key pair; kv_events_bind, and a
        worker's kv_events the gateway binds, do not listen beyond loopback without keys
        unless allow_insecure_bind."""
        for index, worker in enumerate(self.workers):
            if self.zmq_keys is None and worker.zmq_server_key is not None:
                raise ValueError(f"workers.{index}.zmq_server_key: needs the gateway's own "
                                 "key pair too (zmq_keys.secret_key_file)")
            self.check_kv_events_bind(worker, f"workers.{index}.kv_events")
        if self.kv_events_bind is not None:  # always bound (controller/subscriber.py)
            keyed = self.zmq_keys is not None and self.zmq_keys.publisher_keys_dir is not None
            check_bind(self.kv_events_bind, keyed=keyed, allow_insecure=self.allow_insecure_bind,
                       setting="kv_events_bind",
                       keys_hint="zmq_keys.secret_key_file and zmq_keys.publisher_keys_dir",
                       allow_hint="allow_insecure_bind: true")
        return self

    def check_kv_events_bind(self, worker: WorkerConfig, setting: str = "kv_events") -> None:
        """Refuse (InsecureBindRefused, naming ``setting``) a ``kv_events`` the gateway binds
        (holding ``*``) beyond loopback without keys, unless allow_insecure_bind. The keys are
        the worker's zmq_server_key: CURVE roles do not follow bind and connect, so the bound
        SUB is a CURVE client that hears only a publisher holding that worker's secret key.
        publisher_keys_dir does not apply: the subscriber's one ZAP handler is kv_events_bind's."""
        if worker.kv_events is not None and binds(worker.kv_events):
            check_bind(worker.kv_events, keyed=worker.zmq_server_key is not None,
                       allow_insecure=self.allow_insecure_bind, setting=setting,
                       keys_hint="the worker's zmq_server_key, its publisher a CURVE server",
                       allow_hint="allow_insecure_bind: true")

    @field_validator("kv_events_bind")
    @classmethod
    def _zmq_bind(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return check_zmq_endpoint(value)

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
        """The admin token: the ``admin_token_env`` variable's when it is set (and not
        empty), else ``admin_token``. A ConfigError naming the variable when its token is
        shorter than the 8 characters ``admin_token`` must have: the gateway refuses to
        start rather than guard its admin API with a token that is easy to guess."""
        env = os.environ if environ is None else environ
        if self.admin_token_env and env.get(self.admin_token_env):
            token = env[self.admin_token_env]
            if len(token) < 8:  # admin_token's own minimum (its Field's min_length)
                # the token itself is not repeated: the message ends up in logs
                raise ConfigError(
                    f"the environment variable {self.admin_token_env} holds an admin token "
                    f"of {len(token)} character(s); it needs at least 8 (set a longer one, "
                    f"or unset {self.admin_token_env})")
            return token
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
