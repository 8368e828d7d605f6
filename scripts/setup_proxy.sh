#!/usr/bin/env bash
# Install nginx, the standard L7 proxy that fronts sharded gateways (ops/nginx/), so that the
# proxy tier of the tests (tests/integration/test_proxy_shards.py) runs. Installed from the
# system's packages only where this runs as root with apt-get (CI); elsewhere it says how to
# get it and the tier skips. Idempotent: does nothing when nginx is already on the PATH (or
# at $SLUICE_NGINX).
#
# The Debian package would start its own service on port 80 right after unpacking; a
# policy-rc.d that refuses every start (Debian's documented hook, invoke-rc.d(8)) keeps it
# from doing so, and is taken away again afterwards. The tests start their own nginx
# processes on loopback with their own configuration.
set -euo pipefail

log() { echo "[setup_proxy] $*" >&2; }

if [ -n "${SLUICE_NGINX:-}" ] && [ -x "${SLUICE_NGINX}" ]; then
    exit 0
fi
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "nginx is not installed and this is not a root shell with apt-get: the proxy tests"
    log "will skip (install nginx from your system's packages, or set SLUICE_NGINX=/path/to/nginx)"
    exit 0
fi

POLICY=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "${POLICY}" ]; then
    printf '#!/bin/sh\nexit 101\n' > "${POLICY}"
    chmod 0755 "${POLICY}"
    made_policy=1
fi
cleanup() { if [ "${made_policy}" = 1 ]; then rm -f "${POLICY}"; fi; }
trap cleanup EXIT

log "installing nginx from the system's packages (its service is not started)"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends nginx-light >/dev/null 2>&1 \
        && ! apt-get install -y -q --no-install-recommends nginx >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends nginx >/dev/null
fi
log "installed $(/usr/sbin/nginx -v 2>&1)"
