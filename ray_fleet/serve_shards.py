"""Sharded gateways on Ray Serve: K gateway replicas, each the owner of its own workers and of
the programs homed there, behind a request router that sends every call to its owner
(docs/architecture.md §8, "Sharded gateways").

- :class:`GatewayShard` is the deployment: each replica runs the whole gateway
  (``controller.gateway.create_app``, its policy, KV subscriber and admin API) as the
  replica's ASGI app, over the workers whose index i in the list handed to it has
  ``i mod K`` equal to the replica's rank — the split the simulator's shards use
  (sim/shards.py). Ray Serve gives a replica that replaces a dead one the rank it left, so
  the new replica takes over the same workers, and its KV subscriber catches their streams up
  from replay before any call (controller/subscriber.py).
- :class:`ShardRouter` is the deployment's request router. For an HTTP call it reads the
  headers from the ASGI scope the Serve proxy hands over, takes the program's root session
  (:func:`controller.identity.shard_key`: the headers of ops/nginx/sluice-shard-key.conf, in
  its order) and hashes it to a shard (:func:`scheduler.rendezvous.rendezvous_shard`, the
  hash of ``sluice sim --shards``). ``x-sluice-shard: N`` names the shard outright, for what
  belongs to one replica rather than to a program: its admin API, its ``/metrics``. The call
  goes to the replica of that rank and to no other: while it is down (replaced after a
  crash) the call waits in the router, retried with Serve's backoff, until the new replica
  is up or the client gives up.

A gateway replica holds admitted calls for as long as the policy says, so the deployment's
``max_ongoing_requests`` is the gateway's own bound, not Serve's default of a few. The Serve
proxy, not the gateway's uvicorn, is the client-facing edge here: the ``http:`` bounds of
``sluice serve`` (header sizes and timeouts, connections) are Serve's to set
(``serve.start(http_options=...)``); the body limit, identity checks and client keys are
the gateway's and hold as ever.

Needs the ``ray`` extra with Serve (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from ray import serve
# StreamingHTTPRequest is Serve's private wrapper of the ASGI scope its proxy sends; the
# router's other names are its public request-router surface (ray.serve.request_router).
from ray.serve._private.common import StreamingHTTPRequest
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from controller.gateway import create_app as create_gateway_app
from controller.identity import asgi_headers, shard_key
from controller.serve_config import parse_serve_config
from scheduler.rendezvous import rendezvous_shard

# Names the shard a call is for when it belongs to a replica rather than to a program.
SHARD_HEADER = "x-sluice-shard"
# What a replica tells the routers about itself (Serve's record_replica_metadata).
SHARD_METADATA_KEY = "sluice_shard"
# Calls one replica may hold at once (Serve's max_ongoing_requests): held calls count too.
DEFAULT_MAX_ONGOING = 4096
# Keys of the gateway's config the deployment sets itself (the router does what `shards:` would).
DEPLOYMENT_OWNED_KEYS = ("workers", "shards")


def shard_workers(endpoints: Sequence[Mapping[str, Any]], shard: int, shards: int) -> list[dict[str, Any]]:
    """The workers shard ``shard`` of ``shards`` owns: those whose index i has i mod K = shard."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of 0 … {shards - 1}")
    mine = [dict(endpoint) for i, endpoint in enumerate(endpoints) if i % shards == shard]
    if not mine:
        raise ValueError(f"shard {shard} of {shards} owns no worker: give at least {shards} workers")
    return mine


def call_headers(pending_request: PendingRequest) -> dict[str, str]:
    """The HTTP headers of the call being routed; {} for a call made through a handle."""
    args = pending_request.args
    if not args:
        return {}
    first = args[0]
    if isinstance(first, (bytes, bytearray)):
        # The Serve proxy sends the request as a pickled StreamingHTTPRequest
        # (ray/serve/_private/proxy_request_response.py, serialized_replica_arg).
        first = pickle.loads(first)
    if isinstance(first, StreamingHTTPRequest):
        return asgi_headers(first.asgi_scope.get("headers", ()))
    return {}


def call_shard(headers: Mapping[str, str], session_id: str | None, shards: int) -> int:
    """The shard a call goes to: the one ``x-sluice-shard`` names, else its program's."""
    named = headers.get(SHARD_HEADER)
    if named is not None:
        try:
            shard = int(named)
        except ValueError:
            shard = -1
        # A shard that does not exist goes to shard 0, whose gateway then answers for itself
        # (a 404 or the admin API's refusal); the router has no way to answer a call.
        return shard if 0 <= shard < shards else 0
    return rendezvous_shard(shard_key(headers) or (session_id or ""), shards)


class ShardRouter(RequestRouter):
    """Sends each call to the replica whose rank is the call's shard, and to no other."""

    def initialize_state(self, shards: int = 1, **_: Any) -> None:
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"ShardRouter: shards must be a positive int, got {shards!r}")
        self.shards = shards

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            # Serve routes a request it holds, never None with this router's defaults;
            # answering with every candidate keeps its loop from spinning if it does.
            return [candidate_replicas]
        # no owner up yet (a replica being replaced): wait with backoff rather than spin
        pending_request.routing_context.should_backoff = True
        shard = call_shard(call_headers(pending_request), pending_request.metadata.session_id,
                           self.shards)
        owners = [replica for replica in candidate_replicas
                  if replica.replica_metadata.get(SHARD_METADATA_KEY) == shard]
        return [owners] if owners else []


@serve.ingress()
class GatewayShard:
    """One gateway replica: the shard of its rank, over that shard's workers."""

    def __init__(self, config: Mapping[str, Any], endpoints: Sequence[Mapping[str, Any]],
                 shards: int) -> None:
        owned = [key for key in DEPLOYMENT_OWNED_KEYS if key in config]
        if owned:
            raise ValueError(f"the sharded deployment sets {', '.join(owned)} itself; hand the "
                             "workers to it instead")
        context = serve.get_replica_context()
        rank = getattr(context.rank, "rank", context.rank)
        self.shard = int(rank)
        self._config = parse_serve_config({**config, "workers": shard_workers(endpoints, self.shard, shards)},
                                          f"shard {self.shard}")

    def __serve_build_asgi_app__(self) -> Any:
        return create_gateway_app(self._config)

    def record_replica_metadata(self) -> dict[str, Any]:
        return {SHARD_METADATA_KEY: self.shard}


def sharded_gateway(config: Mapping[str, Any], endpoints: Sequence[Mapping[str, Any]], shards: int, *,
                    max_ongoing_requests: int = DEFAULT_MAX_ONGOING, num_cpus: float = 1.0,
                    graceful_shutdown_timeout_s: float = 30.0) -> Any:
    """The application to ``serve.run``: ``shards`` gateway replicas over ``endpoints``
    (worker entries as in ``sluice.yaml``), each owning every ``shards``-th of them."""
    if shards < 1:
        raise ValueError(f"shards must be ≥ 1, got {shards}")
    shard_workers(endpoints, shards - 1, shards)  # every shard gets a worker: fail here, not in a replica
    deployment = serve.deployment(
        GatewayShard,
        name="GatewayShard",
        num_replicas=shards,
        max_ongoing_requests=max_ongoing_requests,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=f"{__name__}.ShardRouter",
            request_router_kwargs={"shards": shards},
        ),
    )
    return deployment.bind(dict(config), [dict(endpoint) for endpoint in endpoints], shards)
