"""The building blocks of the typed configuration (scheduler/config.py): the number types its
keys take, the strict model every section is, and the ``retention:`` section with the defaults
a host KV tier brings. Kept apart so that config.py holds the policy sections and their
parsing (with the error every reader raises, and the YAML reader)."""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

NonNegative = Annotated[float, Field(ge=0.0)]
Positive = Annotated[float, Field(gt=0.0)]
# A share of a worker's KV pool, as U is. U may pass 1.0: the active programs' demand can
# exceed the pool, and the engine's LRU then evicts what is idle. A threshold above 1.0
# oversubscribes on purpose; 2.0 (twice the pool) is the ceiling because past it most of
# every active program's KV could never be resident at once, so each call would re-prefill
# its context: the thrash that pausing exists to prevent.
Fraction = Annotated[float, Field(ge=0.0, le=2.0)]


class Strict(BaseModel):
    # strict: a YAML `true` or "100" is not silently taken for a number
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RetentionConfig(Strict):
    """Retention-bias directives sent to engines (architecture.md §3 "Retention")."""

    enabled: bool = True
    active_priority: Annotated[int, Field(ge=0, le=100)] = 90
    ttl_s: Positive = 300.0
    # Re-send a Retain when less than this share of its TTL is left.
    refresh_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5
    # The workers have a host KV tier (vLLM's CPU offloading): program_aware sends Offload
    # instead of Demote when it pauses a program, and Prefetch when it resumes one whose KV
    # the tier holds (docs/design-notes.md "Host KV tier on real vLLM").
    host_tier: bool = False
    # Among prefetched sessions the tier gives up the lowest priority first.
    prefetch_priority: Annotated[int, Field(ge=0, le=100)] = 50
    # A paused program's call is held: its KV in the tier is favoured at this priority (a
    # Prefetch, below a resumed one's), so a full tier gives up the KV of programs with nothing
    # to run before that of programs waiting to resume (eviction by predicted next use).
    # None: only resumed programs are favoured.
    held_priority: Annotated[int, Field(ge=0, le=100)] | None = 40
    # How long a Prefetch's favour lasts (None: until the session's call loads its blocks).
    prefetch_deadline_s: Positive | None = None
    # Offload a program when it turns dormant too (its KV then goes first on the GPU and its
    # Retain is not refreshed until its next call), not only when it is paused.
    offload_dormant: bool = False
    # Prefetch an offloaded dormant program when its tool call is predicted to end (the
    # median of the recent tool calls that lasted longer than it has so far), so that the tier
    # keeps its KV for the call that is coming rather than for programs still in theirs.
    prefetch_predicted: bool = True


# With a host KV tier (``retention.host_tier: true``) a program's KV that leaves the GPU waits
# in host memory instead of being lost, so the policy may count less of what waits: programs
# turn dormant after the 25th percentile of recent tool calls (at least 30 s) and are
# offloaded then (and ``host_tier_overcommit`` applies); and the tier keeps the KV of programs
# waiting to resume, so the oversubscription in GPU pools overstates what a forced resume
# costs: held calls' waits stretch from 3 pools on (``wait_stretch_from``), at most 3 times.
# These are the defaults of the keys a file leaves out when it turns the tier on
# (docs/architecture.md §3; measured in experiments/results/host_tier/README.md,
# overload/README.md and cc2048/README.md).
HOST_TIER_DEFAULTS: dict[str, Any] = {"dormant_quantile": 0.25, "dormant_min_s": 30.0,
                                      "wait_stretch_from": 3.0, "max_wait_stretch": 3.0}
HOST_TIER_RETENTION_DEFAULTS: dict[str, Any] = {"offload_dormant": True}


def host_tier_in(retention: Any) -> bool:
    if isinstance(retention, RetentionConfig):
        return retention.host_tier
    return isinstance(retention, dict) and retention.get("host_tier") is True


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key."""


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML, turning syntax errors into a :class:`ConfigError` naming ``source``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:
        # PyYAML composes and constructs nodes recursively, so a document nested deeper than
        # the interpreter's stack (e.g. ``[[[[...]]]]`` ~1,000 levels) would escape as a crash
        # of check-config or a 500 from a reload instead of a config problem.
        raise ConfigError(f"{source}: not valid YAML: nested too deeply to parse") from None
