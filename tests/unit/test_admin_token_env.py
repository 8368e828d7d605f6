"""An admin token from the environment needs the 8 characters a token in the YAML needs: a
shorter one stops the gateway at start with an error naming the variable (and not the
token)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.gateway import create_app
from controller.serve_config import parse_serve_config
from scheduler.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = {"name": "w0", "url": "http://127.0.0.1:9"}


def test_a_short_token_in_the_variable_is_refused_naming_the_variable():
    config = parse_serve_config({"workers": [WORKER]})
    with pytest.raises(ConfigError) as refused:
        config.resolved_admin_token({"SLUICE_ADMIN_TOKEN": "abc1234"})
    message = str(refused.value)
    assert "SLUICE_ADMIN_TOKEN" in message and "at least 8" in message, message
    assert "abc1234" not in message  # the token itself stays out of logs

    custom = parse_serve_config({"workers": [WORKER], "admin_token_env": "MY_GATEWAY_TOKEN",
                                 "admin_token": "literal-token"})
    with pytest.raises(ConfigError, match="MY_GATEWAY_TOKEN"):
        custom.resolved_admin_token({"MY_GATEWAY_TOKEN": "x"})


def test_a_token_of_eight_characters_or_none_at_all_is_taken_as_before():
    config = parse_serve_config({"workers": [WORKER], "admin_token": "literal-token"})
    assert config.resolved_admin_token({"SLUICE_ADMIN_TOKEN": "12345678"}) == "12345678"
    # an empty variable counts as unset: the YAML's token (or none) stands
    assert config.resolved_admin_token({"SLUICE_ADMIN_TOKEN": ""}) == "literal-token"
    off = parse_serve_config({"workers": [WORKER], "admin_token_env": None})
    assert off.resolved_admin_token({"SLUICE_ADMIN_TOKEN": "x"}) is None


def test_the_gateway_is_not_built_with_a_short_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "short")
    with pytest.raises(ConfigError, match="SLUICE_ADMIN_TOKEN"):
        create_app(parse_serve_config({"workers": [WORKER]}))


def test_sluice_serve_stops_at_start_with_a_short_token_from_the_environment(tmp_path):
    path = tmp_path / "sluice.yaml"
    path.write_text(f"listen: {{host: 127.0.0.1, port: 0}}\nworkers:\n"
                    f"  - {{name: w0, url: '{WORKER['url']}', capacity_tokens: 1000}}\n")
    env = {**os.environ, "SLUICE_ADMIN_TOKEN": "short"}
    proc = subprocess.run([sys.executable, "-m", "entry.cli", "serve", "--config", str(path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0, proc.stderr
    assert "SLUICE_ADMIN_TOKEN" in proc.stderr and "at least 8" in proc.stderr, proc.stderr
    assert "gateway starting" not in proc.stderr  # refused before it served anything
