"""What the policy learns online reaches the gateway's metrics and its log."""

from __future__ import annotations

import anyio
from prometheus_client.parser import text_string_to_metric_families

from controller.admission import Admission
from controller.metrics import Metrics
from scheduler.calls import CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.policies import make_policy


class RecordingLog:
    def __init__(self) -> None:
        self.infos: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.infos.append((event, fields))

    def debug(self, event: str, **fields) -> None:
        pass


def _tool_calls(policy, seconds: float, count: int, start: float = 0.0) -> float:
    """``count`` tool calls of ``seconds`` each by one program; returns the time after."""
    now = start
    for n in range(count + 1):
        request = CallRequest(f"t#{start}:{n}", SessionId(f"tool-user-{start}"), 10)
        policy.on_arrival(request, now)
        policy.on_complete(request.request_id, Usage(10, 1), now)
        now += seconds
    return now


def test_the_dormancy_cutoff_is_logged_when_learnt_and_when_it_moves_and_exported():
    policy = make_policy(ProgramAwareConfig(dormant_quantile=0.5, dormant_min_s=0.0))
    policy.add_worker("w0", 100_000)
    log = RecordingLog()
    admission = Admission(policy, clock=lambda: 1_000.0, log=log)
    anyio.run(admission.tick)
    # nothing learnt yet: only the wait stretch, which the policy reports from the start
    assert [fields["setting"] for _, fields in log.infos] == ["wait_stretch"]
    _tool_calls(policy, 4.0, 30)
    anyio.run(admission.tick)
    anyio.run(admission.tick)  # unchanged: not logged again
    adapted = [fields for event, fields in log.infos
               if event == "policy setting adapted" and fields["setting"] == "dormancy_cutoff_s"]
    assert adapted == [{"policy": "program_aware", "setting": "dormancy_cutoff_s", "value": 4.0,
                        "previous": None}]
    _tool_calls(policy, 9.0, 40, start=500.0)
    anyio.run(admission.tick)
    adapted = [fields for event, fields in log.infos
               if event == "policy setting adapted" and fields["setting"] == "dormancy_cutoff_s"]
    assert [f["value"] for f in adapted] == [4.0, 9.0]
    text = Metrics(admission).render().body.decode()
    samples = {(s.name, s.labels.get("setting")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("sluice_policy_adaptive", "dormancy_cutoff_s")] == 9.0
