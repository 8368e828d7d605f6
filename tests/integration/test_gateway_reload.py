"""Hot reload of the policy thresholds: a changed file is applied, a bad one keeps the old
config and the log says why; ``sluice serve`` reloads on SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from entry.ports import free_port
from tests.support.gateway_harness import ADMIN, ADMIN_TOKEN, fakes, gateway, wait_for

from controller.serve_config import load_serve_config

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    # A distinct mtime even on coarse-grained filesystems.
    stamp = time.time_ns() + 10_000_000
    os.utime(path, ns=(stamp, stamp))


def _document(worker_url: str, **policy) -> dict:
    return {
        "admin_token": ADMIN_TOKEN,
        "admin_token_env": None,
        "reload_poll_s": 0.05,
        "health_interval_s": 30,
        "workers": [{"name": "w0", "url": worker_url, "capacity_tokens": 100_000}],
        "policy": {"name": "program_aware", **policy},
    }


def _policy(gw) -> dict:
    return gw.client.get("/sluice/config", headers=ADMIN).json()


def test_changed_file_is_applied_and_a_bad_one_keeps_the_old_config(tmp_path):
    path = tmp_path / "sluice.yaml"
    _write(path, _document("http://127.0.0.1:9", pause_threshold=0.95))
    with gateway(load_serve_config(path)) as gw:
        assert _policy(gw)["policy"]["pause_threshold"] == 0.95
        _write(path, _document("http://127.0.0.1:9", pause_threshold=0.9, tick_interval_s=0.5))
        wait_for(lambda: _policy(gw)["policy"]["pause_threshold"] == 0.9, what="reload applied")
        assert gw.parts.admission.policy.tick_interval_s == 0.5
        assert _policy(gw)["reload"]["ok"] is True

        # Invalid thresholds: rejected, old config kept, the log names the key.
        _write(path, _document("http://127.0.0.1:9", pause_threshold=0.5, pause_target=0.7))
        wait_for(lambda: _policy(gw)["reload"]["ok"] is False, what="reload rejected")
        status = _policy(gw)
        assert status["policy"]["pause_threshold"] == 0.9
        assert "pause_target" in status["reload"]["error"]
        rejected = [json.loads(line) for line in gw.log.lines() if "reload rejected" in line]
        assert rejected and "policy" in rejected[-1]["problem"]
        assert rejected[-1]["level"] == "error"

        # Not YAML at all: rejected too.
        path.write_text("policy: [unclosed", encoding="utf-8")
        os.utime(path, ns=(time.time_ns() + 20_000_000,) * 2)
        wait_for(lambda: "not valid YAML" in (_policy(gw)["reload"]["error"] or ""), what="YAML error")
        assert _policy(gw)["policy"]["pause_threshold"] == 0.9

        # Switching the policy kind live is refused.
        _write(path, _document("http://127.0.0.1:9", name="kv_aware"))
        wait_for(lambda: "cannot switch policy" in (_policy(gw)["reload"]["error"] or ""),
                 what="kind change refused")
        assert gw.parts.admission.policy.name == "program_aware"

        # A good file again, through the admin endpoint this time.
        _write(path, _document("http://127.0.0.1:9", pause_threshold=0.85))
        r = gw.client.post("/sluice/reload", headers=ADMIN)
        assert r.status_code == 200 and r.json()["reloaded"] is True
        assert _policy(gw)["policy"]["pause_threshold"] == 0.85
        metrics = gw.client.get("/metrics").text
        assert 'sluice_config_reloads_total{result="rejected"}' in metrics


def test_sluice_serve_reloads_on_sighup(tmp_path):
    with fakes("w0") as started:
        _, server = started[0]
        path = tmp_path / "sluice.yaml"
        document = _document(server.url, pause_threshold=0.95)
        document["reload_poll_s"] = 0  # only SIGHUP reloads
        _write(path, document)
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "entry.cli", "serve", "--config", str(path), "--port", str(port)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5)

            def up() -> bool:
                try:
                    return client.get("/health").status_code == 200
                except httpx.HTTPError:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    return False

            wait_for(up, timeout=20, what="sluice serve up")
            r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": [
                {"role": "user", "content": "hi"}]}, headers={"x-claude-code-session-id": "s1"})
            assert r.status_code == 200
            programs = client.get("/sluice/programs", headers=ADMIN).json()["programs"]
            assert [p["session_id"] for p in programs] == ["s1"]

            document["policy"]["pause_threshold"] = 0.9
            _write(path, document)
            time.sleep(0.2)
            assert client.get("/sluice/config", headers=ADMIN).json()["policy"]["pause_threshold"] == 0.95
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: client.get("/sluice/config", headers=ADMIN).json()["policy"]["pause_threshold"] == 0.9,
                     what="SIGHUP reload")
            assert client.get("/sluice/config", headers=ADMIN).json()["reload"]["trigger"] == "SIGHUP"
            client.close()
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert b"gateway stopped" in err


def test_serve_rejects_a_bad_config_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("workers:\n  - name: w0\n    url: ftp://nowhere\npolicy:\n  pause_target: 7\n")
    proc = subprocess.run([sys.executable, "-m", "entry.cli", "serve", "--config", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "workers.0.url" in proc.stderr and "policy.pause_target" in proc.stderr


def test_deeply_nested_yaml_reload_is_rejected_and_keeps_the_old_config(tmp_path):
    path = tmp_path / "sluice.yaml"
    document = _document("http://127.0.0.1:9", pause_threshold=0.95)
    document["reload_poll_s"] = 0  # only the admin endpoint reloads: no race with the poller
    _write(path, document)
    with gateway(load_serve_config(path)) as gw:
        r = gw.client.post("/sluice/reload", headers=ADMIN)
        assert r.status_code == 200 and _policy(gw)["reload"]["ok"] is True

        # ~1,000 levels: past PyYAML's recursion this used to escape as a 500 while the
        # status still said "ok".
        path.write_text("policy: " + "[" * 1000 + "]" * 1000 + "\n", encoding="utf-8")
        r = gw.client.post("/sluice/reload", headers=ADMIN)
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["reloaded"] is False and body["ok"] is False
        assert str(path) in body["error"] and "nested too deeply" in body["error"]
        status = _policy(gw)
        assert status["reload"]["ok"] is False
        assert status["policy"]["pause_threshold"] == 0.95
