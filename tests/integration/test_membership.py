"""Live worker membership through the admin API and its Python client: add, drain, remove,
sleep and wake workers while agents run. Nothing is lost: no call fails, no program is left
without a worker, calls that find every worker asleep wait for the wake. Real servers on
loopback, real clients in threads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from controller.admin_client import AdminError, SluiceAdmin
from tests.support.gateway_harness import ADMIN_TOKEN, chat, fakes, gateway, serve_config, wait_for


def _post(url: str, session: str, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        return client.post("/v1/chat/completions", json=chat(f"turn of {session}"),
                           headers={"x-session-id": session, **headers})


def _agents(url: str, sessions: list[str], turns: int, stop: threading.Event,
            delay: str = "0.1") -> list[httpx.Response]:
    """Each session runs ``turns`` calls one after another (its tool time: none)."""
    def play(session: str) -> list[httpx.Response]:
        answers = []
        for _ in range(turns):
            if stop.is_set():
                break
            answers.append(_post(url, session, **{"x-test-delay-s": delay}))
        return answers

    with ThreadPoolExecutor(len(sessions)) as pool:
        return [r for answers in pool.map(play, sessions) for r in answers]


@pytest.fixture
def two_workers():
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 100_000} for f, s in started]
        with gateway(serve_config(workers)) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
            yield gw, admin, {f.name: f for f, _ in started}


def test_a_worker_added_live_takes_new_programs():
    with fakes("w0", "w1") as started:
        (_, first), (late_fake, late) = started
        config = serve_config([{"name": "w0", "url": first.url, "capacity_tokens": 100_000}])
        with gateway(config) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
            admin.add_worker("w1", late.url, capacity_tokens=100_000)
            assert admin.workers()["w1"]["mode"] == "serving" and admin.workers()["w1"]["healthy"]
            homes = {_post(gw.url, f"s{i}").headers["x-worker"] for i in range(6)}
            assert homes == {"w0", "w1"} and late_fake.seen
            with pytest.raises(AdminError) as taken:
                admin.add_worker("w1", late.url)
            assert taken.value.status == 409


def test_draining_moves_programs_off_a_worker_and_it_is_removed_once_idle(two_workers):
    gw, admin, fakes_by_name = two_workers
    homes = {f"s{i}": _post(gw.url, f"s{i}").headers["x-worker"] for i in range(4)}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_post, gw.url, "slow", **{"x-test-delay-s": "1.0"})
        wait_for(lambda: any("slow" in f.sessions() for f in fakes_by_name.values()),
                 what="the slow call upstream")
        busy = next(name for name, f in fakes_by_name.items() if "slow" in f.sessions())
        admin.drain(busy)
        with pytest.raises(AdminError) as refused:
            admin.remove(busy)  # its call is still running
        assert refused.value.status == 409 and "in flight" in str(refused.value)
        assert running.result().status_code == 200  # the drain let it finish
    for session in homes:  # every program's next call goes to the other worker
        assert _post(gw.url, session).headers["x-worker"] != busy
    admin.wait_idle([busy], timeout_s=5)
    admin.remove(busy)
    assert set(admin.workers()) == {"w0", "w1"} - {busy}
    assert all(p["home_worker"] != busy for p in admin.programs().values())
    assert gw.parts.admission.disagreements() == []


def test_sleep_and_wake_during_load_lose_no_call_and_strand_no_program(two_workers):
    gw, admin, _ = two_workers
    sessions = [f"agent-{i}" for i in range(8)]
    stop = threading.Event()
    answers: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: answers.extend(
        _agents(gw.url, sessions, turns=6, stop=stop)))
    runner.start()
    time.sleep(0.3)
    admin.sleep("w0")  # a weight sync of one engine in the middle of the rollout
    time.sleep(0.5)
    assert admin.workers()["w0"]["mode"] == "asleep"
    admin.wake("w0")
    runner.join(60)
    assert len(answers) == 6 * len(sessions)
    assert all(r.status_code == 200 for r in answers), [r.status_code for r in answers]
    assert gw.parts.admission.disagreements() == []
    programs = admin.programs()
    assert all(p["in_flight"] == 0 and p["waiting"] == 0 for p in programs.values())


def test_calls_wait_while_every_worker_sleeps_and_go_ahead_on_wake(two_workers):
    gw, admin, fakes_by_name = two_workers
    assert _post(gw.url, "rollout").status_code == 200
    for name in ("w0", "w1"):
        admin.sleep(name)
    admin.wait_idle(["w0", "w1"], timeout_s=5)
    seen_before = sum(len(f.seen) for f in fakes_by_name.values())
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(_post, gw.url, session) for session in ("rollout", "fresh")]
        wait_for(lambda: sum(p["waiting"] for p in admin.programs().values()) == 2,
                 what="both calls held while the fleet sleeps")
        assert sum(len(f.seen) for f in fakes_by_name.values()) == seen_before
        admin.wake("w1")
        assert [f.result().status_code for f in waiting] == [200, 200]
        assert {f.result().headers["x-worker"] for f in waiting} == {"w1"}
    admin.wake("w0")
    assert all(w["mode"] == "serving" for w in admin.workers().values())


def test_membership_errors_are_clear(two_workers):
    gw, admin, _ = two_workers
    with pytest.raises(AdminError) as unknown:
        admin.drain("nope")
    assert unknown.value.status == 404
    with pytest.raises(AdminError) as serving:
        admin.remove("w0")
    assert serving.value.status == 409 and "drain it first" in str(serving.value)
    r = gw.client.post("/sluice/workers", json={"name": "w2"},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 400 and "url" in r.json()["error"]["message"]
    assert gw.client.post("/sluice/workers/w0/sleep").status_code in (401, 403)
