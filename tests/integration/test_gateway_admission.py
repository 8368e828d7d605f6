"""Admission through the gateway: calls held under pressure and admitted when room frees,
clients leaving while held or while the worker computes or streams, capacity learnt from
/metrics, workers failing health checks. Real servers on loopback, real httpx clients in
threads (one call each), as concurrent agents would send them."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.support.gateway_harness import ADMIN, chat, fakes, gateway, serve_config, wait_for

# With ~9 estimated prompt tokens, a program's demand is 9 + growth_reserve 512 + buffer 100
# ≈ 0.62 of a 1000-token worker: one program per worker fits under pause_threshold 0.95,
# two do not. A completion replaces the reserve by the real context (10 + 5 tokens), which
# frees the room for a held program.
TINY = 1000


def _post(url: str, session: str, timeout: float = 10.0, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout, trust_env=False) as client:
        return client.post("/v1/chat/completions", json=chat(f"task of {session}"),
                           headers={"x-session-id": session, **headers})


@pytest.fixture
def tight(tmp_path):
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": TINY} for f, s in started]
        config = serve_config(workers, request_log=str(tmp_path / "requests.jsonl"))
        with gateway(config) as gw:
            yield gw, {f.name: f for f, _ in started}, tmp_path / "requests.jsonl"


def _seen_anywhere(workers, session) -> bool:
    return any(session in fake.sessions() for fake in workers.values())


def _fill_both_workers(pool, gw, workers, delay="1.0"):
    a = pool.submit(_post, gw.url, "a", **{"x-test-delay-s": delay})
    b = pool.submit(_post, gw.url, "b", **{"x-test-delay-s": delay})
    wait_for(lambda: _seen_anywhere(workers, "a") and _seen_anywhere(workers, "b"), what="a and b upstream")
    homes = {s: p["home_worker"] for s, p in gw.programs().items()}
    assert homes["a"] != homes["b"]  # one program per worker: each fills its worker
    return a, b, homes


def test_new_program_is_held_until_a_completion_frees_room_then_admitted(tight):
    gw, workers, log_path = tight
    with ThreadPoolExecutor(4) as pool:
        a, b, homes = _fill_both_workers(pool, gw, workers)
        c = pool.submit(_post, gw.url, "c")
        wait_for(lambda: gw.programs().get("c", {}).get("waiting") == 1, what="c held")
        program = gw.programs()["c"]
        assert program["lifecycle"] == "pending" and program["home_worker"] is None
        assert "sluice_calls_held 1.0" in gw.client.get("/metrics").text
        time.sleep(0.2)
        assert not _seen_anywhere(workers, "c")  # still held: nothing went upstream
        ra, rb, rc = a.result(), b.result(), c.result()
    assert ra.status_code == rb.status_code == rc.status_code == 200
    # c went where the first completion freed room.
    assert rc.headers["x-worker"] in (homes["a"], homes["b"])
    assert gw.programs()["c"]["lifecycle"] == "active"
    metrics = gw.client.get("/metrics").text
    assert "sluice_hold_seconds_count 1.0" in metrics
    assert "sluice_holds_total 1.0" in metrics
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    queue_ms = {r["agent_context"]["session_id"]: r["request"]["queue_time_ms"] for r in records}
    assert queue_ms["a"] == queue_ms["b"] == 0
    assert queue_ms["c"] > 500  # held until a 1 s call of a or b completed


def test_client_leaving_while_held_frees_its_place_and_never_reaches_a_worker(tight):
    gw, workers, _ = tight
    with ThreadPoolExecutor(4) as pool:
        a, b, _ = _fill_both_workers(pool, gw, workers)
        d = pool.submit(_post, gw.url, "d", timeout=0.3)
        with pytest.raises(httpx.ReadTimeout):
            d.result()
        # its only call dropped: the program never ran, so it is released, not kept
        wait_for(lambda: "d" not in gw.programs(), what="d's call dropped with its program")
        assert a.result().status_code == b.result().status_code == 200
        # A program arriving after that is not stuck behind d's dropped call.
        e = pool.submit(_post, gw.url, "e")
        assert e.result().status_code == 200
    assert not _seen_anywhere(workers, "d")
    assert any('"stage": "held"' in line for line in gw.log.lines())


def test_operator_release_refuses_the_programs_held_calls_with_503(tight):
    gw, workers, _ = tight
    with ThreadPoolExecutor(4) as pool:
        a, b, _ = _fill_both_workers(pool, gw, workers)
        c = pool.submit(_post, gw.url, "c")
        wait_for(lambda: gw.programs().get("c", {}).get("waiting") == 1, what="c held")
        assert gw.client.post("/sluice/programs/c/release", headers=ADMIN).status_code == 200
        rc = c.result()
        assert rc.status_code == 503
        assert "program c was released (operator)" in rc.json()["error"]["message"]
        assert a.result().status_code == b.result().status_code == 200
    assert not _seen_anywhere(workers, "c")


def test_final_call_releases_its_program(tight):
    gw, _, _ = tight
    r = _post(gw.url, "once", **{"x-dynamo-session-final": "true"})
    assert r.status_code == 200
    assert "once" not in gw.programs()
    assert "sluice_releases_total 1.0" in gw.client.get("/metrics").text


@pytest.fixture
def roomy():
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}])
        with gateway(config) as gw:
            yield gw, fake


def test_client_leaving_mid_stream_cancels_the_upstream_request(roomy):
    gw, fake = roomy
    with gw.client.stream("POST", "/v1/chat/completions", json=chat(stream=True),
                          headers={"x-session-id": "quitter", "x-test-chunks": "500",
                                   "x-test-chunk-delay-s": "0.01"}) as r:
        chunks = r.iter_raw()
        assert next(chunks).startswith(b"data: ")
    # Leaving the block closed the client's connection mid-stream.
    assert fake.disconnected.wait(5), "the worker never saw its stream cancelled"
    assert fake.disconnects == ["quitter"]
    # aborted in the policy; it was the program's only call, so the program went with it
    wait_for(lambda: "quitter" not in gw.programs(), what="abort in the policy")


def test_client_leaving_while_the_worker_computes_cancels_the_upstream_request(roomy):
    gw, fake = roomy
    with pytest.raises(httpx.ReadTimeout):
        _post(gw.url, "impatient", timeout=0.3, **{"x-test-delay-s": "3"})
    assert fake.disconnected.wait(2), "the worker never saw the request cancelled"
    assert fake.disconnects == ["impatient"]
    wait_for(lambda: "impatient" not in gw.programs(), what="abort in the policy")


def test_unknown_capacity_takes_no_new_programs_until_metrics_tell_it():
    with fakes("w0", num_gpu_blocks=None) as started:
        fake, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url}], capacity_retry_s=0.05)
        with gateway(config) as gw, ThreadPoolExecutor(1) as pool:
            worker = wait_for(lambda: gw.workers()["w0"]["capacity_error"] and gw.workers()["w0"],
                              what="a failed capacity probe")
            assert worker["capacity_tokens"] is None and "num_gpu_blocks" in worker["capacity_error"]
            pending = pool.submit(_post, gw.url, "early")
            wait_for(lambda: gw.programs().get("early", {}).get("waiting") == 1, what="held")
            fake.num_gpu_blocks = 500  # the engine finished profiling
            assert pending.result().status_code == 200
            worker = gw.workers()["w0"]
            assert worker["capacity_tokens"] == 499 * 16 and worker["capacity_source"] == "metrics"


def test_failing_worker_is_marked_down_its_programs_rehomed_and_back_when_it_recovers():
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 100_000} for f, s in started]
        by_name = {f.name: f for f, _ in started}
        config = serve_config(workers, health_interval_s=0.05, unhealthy_after=2)
        with gateway(config) as gw:
            assert _post(gw.url, "p").status_code == 200
            home = gw.programs()["p"]["home_worker"]
            other = next(n for n in by_name if n != home)
            by_name[home].healthy = False
            wait_for(lambda: not gw.workers()[home]["healthy"], what="worker marked down")
            assert gw.workers()[home]["last_error"] == "/health answered 503"
            assert f'sluice_worker_healthy{{worker="{home}"}} 0.0' in gw.client.get("/metrics").text
            assert gw.programs()["p"]["home_worker"] is None  # re-homed on its next call
            r = _post(gw.url, "p")
            assert r.status_code == 200 and r.headers["x-worker"] == other
            by_name[home].healthy = True
            wait_for(lambda: gw.workers()[home]["healthy"], what="worker back")
            assert gw.client.get("/health").json()["workers_healthy"] == 2


def test_no_healthy_worker_is_503_at_once():
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 100_000}],
                              health_interval_s=0.05, unhealthy_after=1)
        with gateway(config) as gw:
            fake.healthy = False
            wait_for(lambda: gw.client.get("/health").status_code == 503, what="gateway unavailable")
            r = _post(gw.url, "nowhere")
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "service_unavailable"
            assert "nowhere" not in gw.programs() and not fake.seen
