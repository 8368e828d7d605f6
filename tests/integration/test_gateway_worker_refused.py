"""A worker that refuses connections: the call was never sent, so the gateway places it
again on another worker (the client sees a 200, not a 502) and takes the refusing worker out
at once instead of after ``unhealthy_after`` failed health checks. Real servers on loopback;
the dead worker is a port nothing listens on."""

from __future__ import annotations

from entry.ports import free_port
from tests.support.gateway_harness import ADMIN, chat, fakes, gateway, serve_config


def test_calls_to_a_refusing_worker_are_placed_again_and_it_is_marked_down_at_once():
    with fakes("alive") as started:
        _, server = started[0]
        dead = f"http://127.0.0.1:{free_port()}"
        workers = [{"name": "dead", "url": dead, "capacity_tokens": 100_000},
                   {"name": "alive", "url": server.url, "capacity_tokens": 100_000}]
        # Health checks far apart: only the refused call can take "dead" out in time.
        config = serve_config(workers, health_interval_s=60, unhealthy_after=3)
        with gateway(config) as gw:
            answers = [gw.client.post("/v1/chat/completions", json=chat(f"task {i}"),
                                      headers={"x-session-id": f"s{i}"}) for i in range(6)]
            assert [r.status_code for r in answers] == [200] * 6
            assert {r.headers["x-worker"] for r in answers} == {"alive"}
            states = gw.client.get("/sluice/workers", headers=ADMIN).json()["workers"]
            dead_state = next(w for w in states if w["name"] == "dead")
            assert dead_state["healthy"] is False
            assert "refused" in dead_state["last_error"].lower() or \
                "connect" in dead_state["last_error"].lower()
            assert any("worker unreachable" in line for line in gw.log.lines())
            assert gw.parts.admission.disagreements() == []
            programs = gw.programs()
            assert all(p["home_worker"] == "alive" and p["in_flight"] == 0
                       for p in programs.values())
