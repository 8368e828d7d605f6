"""``sluice serve --relays N``: a real supervisor, policy process and relay processes on one
loopback port (SO_REUSEPORT), fake workers on loopback, httpx clients each on their own
connection so the kernel spreads them over the relays.

What must hold is what the one-process gateway does: one policy for every call whichever relay
takes it (programs, conversations without identity, Responses ids), metrics summed over the
processes, a client leaving a held call, the drain on SIGTERM, and a relay that dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
from entry.ports import free_port
from tests.support.gateway_harness import ADMIN, ADMIN_TOKEN, chat, fakes, wait_for

REPO = Path(__file__).resolve().parents[2]
# A program's demand with a ~9-token prompt is ≈ 0.62 of this (tests/integration/
# test_gateway_admission.py): one program per worker fits, two do not.
TINY = 1000


class RelayGateway:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def post(self, body: dict, path: str = "/v1/chat/completions", timeout: float = 20.0,
             **headers: str) -> httpx.Response:
        """One call on a connection of its own (so any relay may take it)."""
        with httpx.Client(base_url=self.url, timeout=timeout, trust_env=False) as client:
            return client.post(path, json=body, headers=headers)

    def get(self, path: str, **headers: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            return client.get(path, headers=headers)

    def programs(self) -> dict[str, dict]:
        r = self.get("/sluice/programs", **ADMIN)
        r.raise_for_status()
        return {p["session_id"]: p for p in r.json()["programs"]}

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                pass  # a traceback line
        return lines

    def calls_done(self) -> list[dict[str, Any]]:
        return [line for line in self.log_lines() if line.get("event") == "call done"]

    def metric(self, text: str, name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match is not None, f"{name} not in /metrics"
        return float(match.group(1))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@contextmanager
def relay_gateway(tmp_path: Path, workers: list[dict], relays: int = 2,
                  **overrides: Any) -> Iterator[RelayGateway]:
    config = {"workers": workers, "admin_token": ADMIN_TOKEN, "admin_token_env": None,
              "reload_poll_s": 0, "health_interval_s": 30.0,
              "forward_client_headers": ["x-test-*"], **overrides}
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "entry.cli", "serve", "--config", str(path), "--port", str(port),
             "--relays", str(relays)],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=log)
    gw = RelayGateway(proc, f"http://127.0.0.1:{port}", log_path)

    def up() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return gw.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout=90, what="sluice serve --relays up")
        # every relay listening: each logs "relay started" once its app has started
        wait_for(lambda: sum(line.get("event") == "relay started" for line in gw.log_lines())
                 >= relays, timeout=60, what="every relay started")
        yield gw
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _wide_workers(started) -> list[dict]:
    return [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]


def test_every_call_of_a_program_reaches_the_one_policy_whichever_relay_takes_it(tmp_path):
    with fakes("w0", "w1") as started:
        with relay_gateway(tmp_path, _wide_workers(started),
                           request_log=str(tmp_path / "requests.jsonl")) as gw:

            def program(session: str) -> list[int]:
                return [gw.post(chat(f"step {step} of {session}"), **{"x-session-id": session}
                                ).status_code for step in range(6)]

            with ThreadPoolExecutor(8) as pool:
                statuses = [s for run in pool.map(program, [f"s{i}" for i in range(8)]) for s in run]
            assert statuses == [200] * 48
            programs = gw.programs()
            assert sorted(programs) == [f"s{i}" for i in range(8)]  # one policy: 8, not 16
            assert all(p["steps"] == 6 and p["in_flight"] == 0 for p in programs.values())
            # each program stays on its home worker, whichever relay relayed its calls
            for fake, _ in started:
                for session in fake.sessions():
                    assert programs[session]["home_worker"] == fake.name
            # the kernel spread the connections over both relays
            relays = Counter(line["relay"] for line in gw.calls_done())
            assert set(relays) == {"relay-0", "relay-1"} and sum(relays.values()) == 48
            # metrics summed over the processes, with the policy's own beside them
            text = gw.get("/metrics").text
            assert gw.metric(text, 'sluice_requests_total{route="/v1/chat/completions",status="200"}') == 48
            assert gw.metric(text, "sluice_hold_seconds_count") == 0
            assert gw.metric(text, 'sluice_programs{lifecycle="active",phase="acting"}') == 8
            assert gw.metric(text, "sluice_up") == 1
            assert gw.stop() == 0
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 48 and {r["agent_context"]["session_id"] for r in records} == {f"s{i}" for i in range(8)}


def test_conversations_without_identity_and_responses_ids_continue_across_relays(tmp_path):
    with fakes("w0") as started:
        with relay_gateway(tmp_path, _wide_workers(started)) as gw:
            sessions: list[str] = []
            for n in range(16):  # each turn on its own connection: the pairs cross relays
                opening = {"role": "user", "content": f"test_{n} fails"}
                first = gw.post({"model": "fake-model", "messages": [opening]})
                assert first.status_code == 200
                answer = first.json()["choices"][0]["message"]
                second = gw.post({"model": "fake-model", "messages": [
                    opening, answer, {"role": "user", "content": "now run it"}]})
                assert second.status_code == 200
                sessions.append(started[0][0].seen[-1].body["session_id"])
                assert started[0][0].seen[-2].body["session_id"] == sessions[-1]
            programs = gw.programs()
            assert len(set(sessions)) == 16
            assert all(programs[s]["steps"] == 2 for s in sessions)
            by_session: dict[str, set[str]] = {}
            for line in gw.calls_done():
                by_session.setdefault(line["session_id"], set()).add(line["relay"])
            assert any(len(relays) == 2 for relays in by_session.values())  # 2^-16 to fail
            # Responses: previous_response_id finds its session from any relay
            for n in range(8):
                first = gw.post({"model": "fake-model", "input": "start"}, "/v1/responses",
                                **{"x-session-id": f"resp-{n}"})
                follow = gw.post({"model": "fake-model", "input": "go on",
                                  "previous_response_id": first.json()["id"]}, "/v1/responses")
                assert follow.status_code == 200
                assert started[0][0].seen[-1].body["session_id"] == f"resp-{n}"
            assert gw.stop() == 0


def test_a_client_leaving_a_held_call_frees_its_place_in_the_policy(tmp_path):
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": TINY} for f, s in started]
        with relay_gateway(tmp_path, workers) as gw, ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(gw.post, chat(f"task of {s}"), **{"x-session-id": s,
                                                                  "x-test-delay-s": "3"})
                    for s in ("a", "b")]
            wait_for(lambda: all(p.get("in_flight") == 1 for p in gw.programs().values())
                     and len(gw.programs()) == 2, timeout=20, what="a and b upstream")
            try:
                gw.post(chat("task of c"), timeout=1.0, **{"x-session-id": "c"})
                raise AssertionError("c was not held")
            except httpx.ReadTimeout:
                pass  # held, and its client gave up
            wait_for(lambda: "c" not in gw.programs() or gw.programs()["c"]["waiting"] == 0,
                     timeout=10, what="c's held call gone from the policy")
            assert "sluice_calls_held 0.0" in gw.get("/metrics").text
            assert [f.result().status_code for f in busy] == [200, 200]
            assert gw.post(chat("task of d"), **{"x-session-id": "d"}).status_code == 200
            assert not any("c" in fake.sessions() for fake, _ in started)
            assert gw.stop() == 0


def test_sigterm_drains_every_relay_then_stops_the_policy(tmp_path):
    with fakes("w0") as started:
        with relay_gateway(tmp_path, _wide_workers(started), shutdown_grace_s=1.5) as gw:
            results: dict[str, Any] = {}
            streaming = threading.Event()

            def long_stream(n: int) -> None:
                with httpx.Client(base_url=gw.url, trust_env=False, timeout=30) as client:
                    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True),
                                       headers={"x-session-id": f"long-{n}", "x-test-chunks": "400",
                                                "x-test-chunk-delay-s": "0.05"}) as r:
                        events = [line for line in r.iter_lines() if line.startswith("data: ")]
                        streaming.set()
                        results[f"stream-{n}"] = (r.status_code, events)

            def short_call(n: int) -> None:
                results[f"short-{n}"] = gw.post(chat(), **{"x-session-id": f"short-{n}",
                                                         "x-test-delay-s": "0.6"})

            threads = [threading.Thread(target=long_stream, args=(n,)) for n in range(4)]
            threads += [threading.Thread(target=short_call, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            wait_for(lambda: len(started[0][0].seen) >= 8, timeout=20, what="all calls upstream")
            # SIGHUP to the supervisor reaches the policy process's config reload
            gw.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: any(line.get("event") == "config reloaded" and
                                 line.get("trigger") == "SIGHUP" for line in gw.log_lines()),
                     timeout=10, what="the reload")
            status = gw.stop()
            for thread in threads:
                thread.join(30)
    assert status == 0, gw.log_path.read_text()
    for n in range(4):
        assert results[f"short-{n}"].status_code == 200  # finished within the grace
        code, events = results[f"stream-{n}"]
        assert code == 200 and len(events) < 400  # cut, not run to the end
        assert "shutting down" in json.loads(events[-1][len("data: "):])["error"]["message"]
    assert [line for line in gw.log_lines() if line.get("level") == "error"] == []
    events = [line.get("event") for line in gw.log_lines()]
    assert events.count("relay stopped") == 2
    # the policy process stops after the relays, and the supervisor last
    assert events.index("gateway stopped") > max(i for i, e in enumerate(events) if e == "relay stopped")
    assert gw.log_lines()[-1].get("process") == "supervisor"


def test_a_relay_that_dies_is_started_again_and_its_calls_leave_the_policy(tmp_path):
    with fakes("w0") as started:
        with relay_gateway(tmp_path, _wide_workers(started)) as gw, ThreadPoolExecutor(16) as pool:
            [starting] = [line for line in gw.log_lines() if line.get("event") == "gateway starting"
                          and line.get("process") == "supervisor"]
            victim = starting["relay_pids"][0]
            slow = [pool.submit(_try_post, gw, f"slow-{n}") for n in range(16)]
            wait_for(lambda: len(started[0][0].seen) >= 16, timeout=20, what="all calls upstream")
            os.kill(victim, signal.SIGKILL)
            outcomes = [f.result() for f in slow]
            assert "lost" in outcomes  # some calls were on the killed relay (2^-16 to fail)
            lost = [f"slow-{n}" for n, outcome in enumerate(outcomes) if outcome == "lost"]
            gone = wait_for(lambda: [line for line in gw.log_lines() if line.get("event") ==
                                     "relay gone; its calls aborted in the policy"],
                            timeout=60, what="the dead relay's calls aborted")
            assert gone[0]["relay"] == "relay-0" and gone[0]["calls"] == len(lost)
            wait_for(lambda: sum(line.get("event") == "relay started" for line in gw.log_lines())
                     >= 3, timeout=60, what="relay-0 started again")
            programs = gw.programs()  # a program whose only call was aborted is forgotten
            assert all(programs.get(s, {}).get("in_flight", 0) == 0 for s in lost)
            # both relays serve again
            for n in range(16):
                assert gw.post(chat(), **{"x-session-id": f"after-{n}"}).status_code == 200
            assert gw.stop() == 0


def _try_post(gw: RelayGateway, session: str) -> str:
    try:
        r = gw.post(chat(), **{"x-session-id": session, "x-test-delay-s": "2"})
    except httpx.HTTPError:
        return "lost"
    return "ok" if r.status_code == 200 else f"status {r.status_code}"


def test_relays_must_be_at_least_one(tmp_path):
    (tmp_path / "sluice.yaml").write_text(json.dumps({"workers": []}))
    done = subprocess.run([sys.executable, "-m", "entry.cli", "serve", "--config",
                           str(tmp_path / "sluice.yaml"), "--relays", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--relays" in done.stderr



def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody has reaped yet has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_children_of_a_killed_supervisor_drain_and_stop_by_themselves(tmp_path):
    with fakes("w0") as started:
        with relay_gateway(tmp_path, _wide_workers(started), shutdown_grace_s=1.0) as gw:
            [starting] = [line for line in gw.log_lines() if line.get("event") == "gateway starting"
                          and line.get("process") == "supervisor"]
            children = [starting["policy_pid"], *starting["relay_pids"]]
            assert gw.post(chat(), **{"x-session-id": "s"}).status_code == 200
            gw.proc.kill()  # no drain of its own: the children must notice
            gw.proc.wait(10)
            wait_for(lambda: not any(_running(pid) for pid in children), timeout=30,
                     what="the policy process and the relays stopped")
    events = [line.get("event") for line in gw.log_lines()]
    assert events.count("relay stopped") == 2 and "gateway stopped" in events  # drained
