"""Sluice's engine-side vLLM plugin, a package of its own: it is installed into vLLM's
environment alone (``sluice_vllm_plugin/pyproject.toml``, distribution ``sluice-vllm-plugin``;
``scripts/setup_vllm_venv.sh`` does it) and imports nothing else of Sluice's.

Registered as a ``vllm.general_plugins`` entry point::

    [project.entry-points."vllm.general_plugins"]
    sluice = "sluice_vllm_plugin:register"

vLLM calls ``register()`` in every process that loads general plugins (API server, engine core,
workers), possibly more than once. The patches only matter where the scheduler's ``BlockPool``
lives, the engine-core process, so ``register()`` applies them only there. Detection: vLLM starts
the engine core as a ``multiprocessing`` process named ``"EngineCore"`` (``"EngineCore_DP<n>"``
with data parallelism; ``vllm/v1/engine/utils.py``), so the current process's name is checked.
When vLLM runs the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the name is
``"MainProcess"``; that mode is recognised from the environment variable. ``SLUICE_PLUGIN=force``
applies the patches anywhere, ``SLUICE_PLUGIN=off`` nowhere.

Every KV-event message also carries the publisher's per-start epoch as a fourth frame
(:mod:`sluice_vllm_plugin.epoch`; ``SLUICE_PUBLISHER_EPOCH=off`` turns it off). With
``SLUICE_ZMQ_SECRET_KEY_FILE`` and ``SLUICE_ZMQ_CLIENT_KEYS_DIR`` set the publisher's sockets
are CurveZMQ servers, and without them it does not listen beyond loopback unless
``SLUICE_ZMQ_ALLOW_INSECURE_BIND=1`` (:mod:`sluice_vllm_plugin.publisher_auth`).

When ``SLUICE_DIRECTIVE_ENDPOINT`` is set the engine core also listens there for retention and
host-tier directives (:mod:`sluice_vllm_plugin.directives`). The host-tier patches
(:mod:`sluice_vllm_plugin.host_tier`, built on :mod:`sluice_vllm_plugin.retention`) apply only
where vLLM has its offloading manager.

On a vLLM other than 0.32.x ``register()`` logs one line and does nothing.

This package imports only the standard library, vLLM and what vLLM brings (msgspec, pyzmq);
the directive envelope it decodes (:mod:`sluice_vllm_plugin.directive_envelope`) is the one the
gateway encodes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

logger = logging.getLogger("sluice.vllm_plugin")

SUPPORTED_PREFIX = "0.32."
_registered = False


def _vllm_version() -> str:
    try:
        import vllm
        return str(getattr(vllm, "__version__", ""))
    except ImportError:  # pragma: no cover - vllm missing
        return ""


def is_engine_core_process() -> bool:
    mode = os.environ.get("SLUICE_PLUGIN", "").strip().lower()
    if mode == "force":
        return True
    if mode == "off":
        return False
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return True
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() == "0"


def apply_patches() -> None:
    """Apply every patch to vLLM's classes (idempotent)."""
    from . import directives, epoch, labels, publisher_auth, retention
    labels.apply()
    retention.apply()
    try:
        from . import host_tier
    except ImportError as exc:  # pragma: no cover - a vLLM build without kv_offload
        logger.info("sluice vllm plugin: no host tier (%s)", exc)
    else:
        host_tier.apply()
    epoch.apply()
    publisher_auth.apply()
    directives.start_from_env()


def register() -> None:
    """``vllm.general_plugins`` entry point."""
    global _registered
    if _registered:
        return
    version = _vllm_version()
    if not version.startswith(SUPPORTED_PREFIX):
        logger.warning("sluice vllm plugin: vLLM %s is not supported (needs %sx); not applied",
                       version or "?", SUPPORTED_PREFIX)
        _registered = True
        return
    if not is_engine_core_process():
        return
    apply_patches()
    _registered = True
    logger.info("sluice vllm plugin: applied to vLLM %s in %s", version,
                multiprocessing.current_process().name)
