"""The policy process's service and a relay's link to it, in one event loop: a real gateway app
(its lifespan started, fake workers on loopback), a real Unix socket between them. The
orderings a whole ``sluice serve --relays N`` cannot make deterministic are made here: a call
let go of after its admission, a relay whose connection closes, a policy that never answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from controller.errors import GatewayError
from controller.gateway import create_app
from controller.policy_service import PolicyService
from controller.relay_link import RemotePolicyLink
from controller.relay_wire import NO_ANSWER, Abandon, frame
from controller.upstream import UpstreamPool
from scheduler.calls import CallRequest, Usage
from tests.support.gateway_harness import LogSink, fakes, serve_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _call(n: int, session: str = "s") -> CallRequest:
    return CallRequest(request_id=f"r{n}", session_id=session, prompt_tokens=10,
                       prompt_estimated=True)


async def _with_service(tmp_path: Path, test) -> None:
    with fakes("w0") as started:
        config = serve_config([{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000}
                               for f, s in started])
        app = create_app(config, log_stream=LogSink())
        path = str(tmp_path / "policy.sock")
        service = PolicyService(app.state.sluice, app.state.policy_link, app, path, 1 << 20)
        async with app.router.lifespan_context(app):
            await service.start()
            try:
                await test(app.state.sluice, path, config)
            finally:
                await service.aclose()


def _link(endpoint: str, config, name: str = "relay-0", **kwargs) -> RemotePolicyLink:
    return RemotePolicyLink(endpoint, name, UpstreamPool([], config.upstream), LogSink(),
                            max_hold_s=config.limits.max_hold_s,
                            retry_after_s=config.limits.retry_after_s, frame_limit=1 << 20,
                            **kwargs)


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_an_admitted_call_let_go_of_is_aborted_and_a_completed_one_counts(tmp_path):
    async def test(parts, endpoint, config):
        link = _link(endpoint, config)
        await link.open()
        try:
            admitted = await link.admit(_call(1))
            assert admitted is not None and admitted.worker == "w0"
            assert link.worker_count() == 1
            assert parts.admission.program_view("s").in_flight == 1
            # the relay's connections to the worker were opened from the policy's config
            assert link._pool.names() == ["w0"]
            await link.complete("r1", Usage(10, 5))
            view = parts.admission.program_view("s")
            assert view.in_flight == 0 and view.steps == 1
            # admitted, then let go of (the abandon crossed the answer): aborted in the policy
            assert await link.admit(_call(2)) is not None
            link._writer.transport.write(frame(NO_ANSWER, msgspec.msgpack.encode(Abandon("r2"))))
            await _until(lambda: parts.admission.program_view("s").in_flight == 0)
            assert parts.admission.program_view("s").steps == 1  # not counted as a step
        finally:
            await link.aclose()

    asyncio.run(_with_service(tmp_path, test))


def test_a_relay_whose_connection_closes_leaves_none_of_its_calls_in_the_policy(tmp_path):
    async def test(parts, endpoint, config):
        first = _link(endpoint, config)
        other = _link(endpoint, config, "relay-1")
        await first.open()
        await other.open()
        for n, session in enumerate(("a", "b")):
            assert await first.admit(_call(n, session)) is not None
        assert await other.admit(_call(7, "c")) is not None
        await first.aclose()  # gone without a word for its calls

        def settled(session: str) -> bool:
            view = parts.admission.program_view(session)
            return view is None or view.in_flight == 0

        await _until(lambda: settled("a") and settled("b"))
        assert parts.admission.program_view("c").in_flight == 1  # the other relay's stays
        await other.complete("r7", Usage(10, 5))
        await other.aclose()

    asyncio.run(_with_service(tmp_path, test))


def test_refusals_cross_as_the_same_gateway_error_and_shared_tables_answer(tmp_path):
    async def test(parts, endpoint, config):
        link = _link(endpoint, config)
        await link.open()
        try:
            await link.remember_response("resp_1", "s")
            assert await link.lookup_response("resp_1") == "s"
            assert await link.lookup_response("resp_none") is None
            assert await link.model_served("fake-model") is True
            session = await link.continue_conversation("g", None, "head", None, "fresh")
            assert session.startswith("g-") and parts.conversations.in_flight(session) == 1
            await link.conversation_ended(session, "head", False, None)
            assert parts.conversations.in_flight(session) == 0
            # a refusal of the policy reaches the relay as the GatewayError it was
            parts.admission.limits = parts.admission.limits.model_copy(update={"max_programs": 0})
            with pytest.raises(GatewayError) as refused:
                await link.admit(_call(9, "new"))
            assert refused.value.status == 429 and "max_programs" in refused.value.message
        finally:
            await link.aclose()

    asyncio.run(_with_service(tmp_path, test))


def test_a_policy_that_does_not_answer_fails_the_ask_with_a_503(tmp_path):
    async def test() -> None:
        config = serve_config([{"name": "w0", "url": "http://127.0.0.1:9", "capacity_tokens": 1000}])
        # nobody listens: the connect fails as a 503
        link = _link(str(tmp_path / "nobody.sock"), config)
        with pytest.raises(GatewayError) as gone:
            await link.open()
        assert gone.value.status == 503 and "policy process did not answer" in gone.value.message
        # a listener that never answers: the ask times out as a 503
        silent = await asyncio.get_running_loop().create_unix_server(
            asyncio.Protocol, str(tmp_path / "silent.sock"))
        link = _link(str(tmp_path / "silent.sock"), config, ask_timeout_s=0.3)
        with pytest.raises(GatewayError) as gone:
            await link.open()  # the hello goes unanswered
        assert gone.value.status == 503 and "(hello)" in gone.value.message
        await link.aclose()
        silent.close()

    asyncio.run(test())
