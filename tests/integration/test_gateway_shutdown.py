"""Graceful drain: on SIGTERM ``sluice serve`` stops accepting, lets calls in progress finish
within ``shutdown_grace_s``, then ends what is left with an error its client can read (a
stream's last event is an SSE error, not a cut connection) and exits 0. A real ``sluice
serve`` process, a real signal, a fake worker on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from entry.ports import free_port
from tests.support.gateway_harness import chat, fakes, wait_for

REPO = Path(__file__).resolve().parents[2]


def _serve(tmp_path: Path, worker_url: str, grace_s: float) -> tuple[subprocess.Popen, str]:
    config = {"workers": [{"name": "w0", "url": worker_url, "capacity_tokens": 1_000_000}],
              "admin_token_env": None, "reload_poll_s": 0, "shutdown_grace_s": grace_s,
              "forward_client_headers": ["x-test-*"]}
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "entry.cli", "serve", "--config", str(path), "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", trust_env=False, timeout=2).status_code == 200
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stderr.read().decode()
            return False

    wait_for(up, timeout=60, what="sluice serve up")
    return proc, url


def test_sigterm_lets_a_short_call_finish_and_ends_a_long_stream_with_an_error_event(tmp_path):
    with fakes("w0") as started:
        _, worker = started[0]
        proc, url = _serve(tmp_path, worker.url, grace_s=1.5)
        try:
            results: dict[str, object] = {}
            streaming = threading.Event()

            def long_stream() -> None:
                with httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
                    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True),
                                       headers={"x-session-id": "long", "x-test-chunks": "400",
                                                "x-test-chunk-delay-s": "0.05"}) as r:
                        events = []
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                events.append(line[len("data: "):])
                                streaming.set()
                        results["stream"] = (r.status_code, events)

            def short_call() -> None:
                with httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
                    results["short"] = client.post("/v1/chat/completions", json=chat(),
                                                   headers={"x-session-id": "short",
                                                            "x-test-delay-s": "0.6"})

            threads = [threading.Thread(target=long_stream), threading.Thread(target=short_call)]
            threads[0].start()
            assert streaming.wait(20), "the stream never started"
            threads[1].start()
            wait_for(lambda: len(_fake_seen(started)) >= 2, timeout=10, what="both calls upstream")
            proc.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(30)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    short = results["short"]
    assert isinstance(short, httpx.Response) and short.status_code == 200  # finished in the grace
    status, events = results["stream"]
    assert status == 200
    assert len(events) < 400  # cut, not run to the end
    last = json.loads(events[-1])
    assert "shutting down" in last["error"]["message"]
    assert proc.returncode == 0, err.decode()
    assert b"gateway stopped" in err


def _fake_seen(started) -> list:
    return [seen for fake, _ in started for seen in fake.seen]
