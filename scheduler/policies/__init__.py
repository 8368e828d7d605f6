"""Policies behind one interface; :func:`make_policy` builds the one a config names."""

from __future__ import annotations

from scheduler.config import PolicyConfig, ProgramAwareConfig
from scheduler.policies.autellix import AutellixPolicy
from scheduler.policies.base import Policy
from scheduler.policies.continuum import ContinuumPolicy
from scheduler.policies.mori import MoriPolicy
from scheduler.policies.program_aware import ProgramAwarePolicy
from scheduler.policies.routing import (
    KvAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    StickyLeastLoadedPolicy,
)
from scheduler.policies.sticky_kv import StickyKvPolicy
from scheduler.policies.thunderagent import ThunderAgentPolicy
from scheduler.policies.vllm_router import VllmRouterPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        ProgramAwarePolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        KvAwarePolicy,
        StickyLeastLoadedPolicy,
        ThunderAgentPolicy,
        ContinuumPolicy,
        AutellixPolicy,
        StickyKvPolicy,
        MoriPolicy,
        VllmRouterPolicy,
    )
}


def make_policy(config: PolicyConfig | None = None, name: str | None = None) -> Policy:
    """Build a fresh policy (no config: program_aware's defaults); ``name`` overrides
    ``config.name``, and the policy then reads the section ``config`` carries for it over the
    keys both sections take (:meth:`PolicyConfig.for_policy`: one file configures a
    comparison)."""
    config = config or ProgramAwareConfig()
    if name is not None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        config = config.for_policy(name)
    return POLICIES[config.name](config)


__all__ = ["POLICIES", "Policy", "make_policy"]
