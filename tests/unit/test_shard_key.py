"""The key an ingress hashes to find a call's shard (controller.identity.shard_key): the
headers of ops/nginx/sluice-shard-key.conf in its order, so nginx and the Ray Serve router
(ray_fleet/serve_shards.py) split programs alike."""

from __future__ import annotations

import re
from pathlib import Path

from controller.identity import SHARD_KEY_HEADERS, shard_key

NGINX_KEY_CONF = Path(__file__).resolve().parents[2] / "ops" / "nginx" / "sluice-shard-key.conf"


def test_the_headers_are_nginx_s_in_nginx_s_order():
    joined = re.search(r'^map "([^"]+)" \$sluice_shard_key', NGINX_KEY_CONF.read_text(), re.M)
    assert joined, "sluice-shard-key.conf's map line changed shape: update this test"
    nginx_headers = [field.removeprefix("$http_").replace("_", "-") for field in joined.group(1).split("|")]
    assert list(SHARD_KEY_HEADERS) == nginx_headers


def test_the_first_header_present_is_the_key():
    assert shard_key({"x-session-id": "s", "x-parent-session-id": "p"}) == "p"
    assert shard_key({"x-session-id": "s", "x-claude-code-session-id": "run",
                      "x-claude-code-agent-id": "a"}) == "run"
    assert shard_key({"thread-id": "t", "x-session-id": "s"}) == "t"
    # an empty header is absent, as nginx's regex skips an empty field
    assert shard_key({"x-parent-session-id": "", "x-session-id": "s"}) == "s"


def test_a_call_without_such_headers_has_the_empty_key():
    assert shard_key({}) == ""
    assert shard_key({"authorization": "Bearer k", "content-type": "application/json"}) == ""
