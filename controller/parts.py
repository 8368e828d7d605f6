"""What one gateway app is made of (``app.state.sluice``).

The composition root (controller/gateway.py ``create_app``) builds the parts once per app;
the endpoints and the relay read them; tests and the demo look inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.admission import Admission
from controller.config_reload import ConfigReloader
from controller.conversations import Conversations
from controller.drain import Drain
from controller.fleet import Fleet
from controller.identity import ResponseSessions
from controller.metrics import Metrics
from controller.model_catalog import ModelCatalog
from controller.request_log import RequestLog
from controller.serve_config import ServeConfig
from controller.subscriber import KvEventSubscriber
from controller.upstream import UpstreamPool
from controller.workers import WorkerRegistry


@dataclass(slots=True)
class Parts:
    """The app's components, one of each (no globals: a second app has its own)."""

    config: ServeConfig
    admission: Admission
    pool: UpstreamPool
    workers: WorkerRegistry
    metrics: Metrics
    request_log: RequestLog
    reloader: ConfigReloader
    responses: ResponseSessions
    log: Any
    models: ModelCatalog
    fleet: Fleet  # one record per worker; membership (controller/fleet.py)
    kv_events: KvEventSubscriber | None = None  # the KV-event subscriber (controller/subscriber.py)
    drain: Drain = field(default_factory=lambda: Drain(0.0))  # graceful shutdown (controller/drain.py)
    # programs of calls without identity, by the answers they carry on (controller/conversations.py)
    conversations: Conversations = field(default_factory=Conversations)
