"""The Sluice gateway and simulated vLLM engines as Ray actors.

:class:`GatewayActor` runs the gateway (``controller.gateway.create_app`` under uvicorn with
its graceful drain) inside the actor process, on a port it picks, in front of the engine
endpoints handed to it: plain endpoint mappings (``name``, ``url``, and optionally
``kv_events``, ``replay``, ``directives``, ``capacity_tokens``, as in ``sluice.yaml``).
:func:`start_gateway` also takes handles of actors that answer ``endpoint()`` with one, such
as :class:`SimWorkerActor`, and asks them before the actor starts. These are the workers it
starts with; more join and leave at run time through the admin API (``/sluice/workers``,
controller/fleet.py), and a restarted gateway actor starts again with the list it was given.

:class:`SimWorkerActor` serves the simworker (the engine model behind vLLM's HTTP API, KV
events, replay and directive sockets) so a fleet runs on a machine without a GPU. On a GPU
cluster the engines are real vLLM servers and their endpoints are handed to the gateway as
mappings instead.

Both bind the address Ray knows the node by (``ray.util.get_node_ip_address()``), or the one
``SLUICE_NODE_ADDRESS`` names in the actor's environment (a local cluster on loopback: Ray
reports the machine's own address even when started with ``_node_ip_address="127.0.0.1"``),
unless told another, so the URLs they report reach them from any node of the cluster. The
simworker's ZMQ sockets bind that address on a port the kernel picks (``tcp://HOST:*``; it
binds only endpoints with a wildcard) and are advertised at it.

The classes are plain; :func:`start_gateway` and :func:`start_simworker` make them Ray actors
with the resources and restart policy given, so importing this module needs no Ray session.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import uvicorn

from controller.drain import CUT_MARGIN_S
from controller.gateway import create_app as create_gateway_app
from controller.serve_config import parse_serve_config
from controller.server import DrainingServer, server_config
from ray_fleet.serving import ServerInThread
from simworker.worker import SimWorkerConfig
from simworker.worker import create_app as create_simworker_app

# Keys of the gateway's config the actor sets itself: where it listens and what it fronts.
ACTOR_OWNED_KEYS = ("listen", "workers")
# The address actors bind and advertise instead of Ray's node address, when set.
NODE_ADDRESS_ENV = "SLUICE_NODE_ADDRESS"
# Simworker settings the actor derives (sockets, name); everything else of SimWorkerConfig
# may be passed.
SIMWORKER_OWNED_KEYS = ("name", "kv_events", "replay", "directives")


def node_address() -> str:
    explicit = os.environ.get(NODE_ADDRESS_ENV)
    if explicit:
        return explicit
    import ray

    return ray.util.get_node_ip_address()


def discover_endpoints(engines: Sequence[Any]) -> list[dict[str, Any]]:
    """The worker entries of ``engines``: each a mapping as in ``sluice.yaml``'s ``workers``,
    or an actor handle whose ``endpoint()`` returns one (asked all at once)."""
    import ray

    pending = {i: engine.endpoint.remote() for i, engine in enumerate(engines)
               if not isinstance(engine, Mapping)}
    answered = dict(zip(pending, ray.get(list(pending.values())))) if pending else {}
    endpoints = [dict(answered[i]) if i in answered else dict(engine)
                 for i, engine in enumerate(engines)]
    names = [endpoint.get("name") for endpoint in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be distinct, got {names}")
    return endpoints


def _bound_port(endpoint: str | None) -> int:
    """The port of a bound ZMQ endpoint (``tcp://0.0.0.0:41234``)."""
    if endpoint is None:
        raise RuntimeError("a simworker socket is not bound")
    return int(endpoint.rsplit(":", 1)[1])


class GatewayActor:
    """One Sluice gateway, and so one policy object, over the engines it was handed."""

    def __init__(self, config: Mapping[str, Any], endpoints: Sequence[Mapping[str, Any]], *,
                 host: str | None = None, port: int = 0) -> None:
        owned = [key for key in ACTOR_OWNED_KEYS if key in config]
        if owned:
            raise ValueError(f"the gateway actor sets {', '.join(owned)} itself; leave it out of "
                             "the config (engines are handed to it, the port is its pick)")
        self._endpoints = [dict(endpoint) for endpoint in endpoints]
        self._host = host or node_address()
        serve_config = parse_serve_config({**config, "listen": {"host": self._host, "port": port},
                                           "workers": self._endpoints})
        self._app = create_gateway_app(serve_config)
        drain = self._app.state.sluice.drain
        self._grace_s = drain.grace_s
        server = DrainingServer(server_config(self._app, self._host, port, drain.grace_s), drain)
        self._server = ServerInThread(server, "sluice-gateway")
        self._server.start()

    def url(self) -> str:
        return f"http://{self._host}:{self._server.port}"

    def endpoints(self) -> list[dict[str, Any]]:
        return [dict(endpoint) for endpoint in self._endpoints]

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Until every engine is healthy and its capacity known (a worker of unknown capacity
        takes no new program); returns the capacity of each, in tokens."""
        states = self._app.state.sluice.workers.states
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._server.serving:
                raise RuntimeError("the gateway server stopped (the actor's stderr says why)")
            pending = {name: state.capacity_error or state.last_error or "capacity not read yet"
                       for name, state in states.items()
                       if state.capacity_tokens is None or not state.healthy}
            if not pending:
                return {name: int(state.capacity_tokens) for name, state in states.items()}
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready after {timeout_s:.0f} s: {pending}")
            time.sleep(0.1)

    def stop(self) -> bool:
        """Shut down as on SIGTERM: stop accepting, give calls in progress the drain's grace,
        end the rest with an error their clients can read. True once the server has exited."""
        return self._server.stop(self._grace_s + CUT_MARGIN_S + 5.0)


class SimWorkerActor:
    """One simworker: a vLLM stand-in serving the engine model in scaled real time."""

    def __init__(self, name: str, settings: Mapping[str, Any] | None = None, *,
                 host: str | None = None) -> None:
        settings = dict(settings or {})
        owned = [key for key in SIMWORKER_OWNED_KEYS if key in settings]
        if owned:
            raise ValueError(f"the simworker actor sets {', '.join(owned)} itself")
        self._host = host or node_address()
        # The gateway reaches the actor from another node, so its sockets listen on the node's
        # address: authenticated when settings give zmq_secret_key_file and
        # zmq_client_keys_dir, else allowed as before unless settings say otherwise.
        settings.setdefault("allow_insecure_bind", "zmq_secret_key_file" not in settings)
        any_port = f"tcp://{self._host}:*"  # a port the kernel picks (the '*' makes it a bind)
        config = SimWorkerConfig(name=name, kv_events=any_port, replay=any_port,
                                 directives=any_port, **settings)
        app = create_simworker_app(config)
        server = uvicorn.Server(uvicorn.Config(app, host=self._host, port=0, log_level="warning",
                                               access_log=False, lifespan="on"))
        self._server = ServerInThread(server, f"simworker-{name}")
        port = self._server.start()
        worker = app.state.worker  # its sockets are bound once the server has started
        self._endpoint = {
            "name": name,
            "url": f"http://{self._host}:{port}",
            "kv_events": f"tcp://{self._host}:{_bound_port(worker.kv_endpoint)}",
            "replay": f"tcp://{self._host}:{_bound_port(worker.replay_endpoint)}",
            "directives": f"tcp://{self._host}:{_bound_port(worker.directives.bound_endpoint)}",
        }

    def endpoint(self) -> dict[str, Any]:
        """This engine's entry for the gateway's ``workers``."""
        return dict(self._endpoint)

    def stop(self) -> bool:
        return self._server.stop(10.0)


def start_gateway(config: Mapping[str, Any], engines: Sequence[Any], *, num_cpus: float = 1.0,
                  max_restarts: int = 1, host: str | None = None, port: int = 0,
                  **actor_options: Any) -> Any:
    """A :class:`GatewayActor` handle in front of ``engines`` (endpoint mappings, or handles
    of actors that answer ``endpoint()``: :func:`discover_endpoints`). Ray restarts the actor
    up to ``max_restarts`` times when its process or node dies; the new process starts with an
    empty policy (docs/architecture.md, "Scaling out on Ray"). Calls on the handle made
    meanwhile wait for the restart and are retried (``max_task_retries``), so ``url()``
    reports the new address."""
    import ray

    # Resolved here rather than in the actor: its constructor arguments then are small plain
    # data Ray keeps with the actor's definition, so a restart can always run it again
    # (arguments holding actor handles would live in the object store, and a restart after
    # they went out of scope would fail).
    endpoints = discover_endpoints(engines)
    actor = ray.remote(GatewayActor).options(num_cpus=num_cpus, max_restarts=max_restarts,
                                             max_task_retries=-1 if max_restarts else 0,
                                             **actor_options)
    return actor.remote(dict(config), endpoints, host=host, port=port)


def start_simworker(name: str, settings: Mapping[str, Any] | None = None, *,
                    num_cpus: float = 1.0, host: str | None = None, **actor_options: Any) -> Any:
    """A :class:`SimWorkerActor` handle (no restarts: a restarted engine comes back with an
    empty cache, which the gateway learns from its health checks and KV events)."""
    import ray

    actor = ray.remote(SimWorkerActor).options(num_cpus=num_cpus, **actor_options)
    return actor.remote(name, dict(settings or {}), host=host)
