"""(d) The publisher epoch on vLLM 0.32's own ``ZmqEventPublisher`` with the plugin applied:
a fourth frame, one nonce per publisher (engine start), off on request, and the first three
frames unchanged (Sluice's decoder reads the payload as before)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from controller.kv_wire import publisher_epoch
from scheduler.kv_events import AllBlocksCleared, EventBatchDecoder

from tests.support.vllm_venv import ROOT, vllm_env, vllm_python

DRIVER = Path(__file__).resolve().parent / "epoch_driver.py"


@pytest.fixture(scope="module")
def published() -> list[dict]:
    proc = subprocess.run([str(vllm_python()), str(DRIVER), "on", "on", "off"], cwd=ROOT, env=vllm_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    return [{"frames": [bytes.fromhex(f) for f in run["frames"]],
             "epoch": bytes.fromhex(run["epoch"]) if run["epoch"] else None} for run in runs]


def test_each_publisher_start_stamps_its_own_epoch_as_a_fourth_frame(published):
    first, second, _ = published
    for run in (first, second):
        assert len(run["frames"]) == 4
        assert run["frames"][3] == run["epoch"] and len(run["epoch"]) == 16
        assert publisher_epoch(run["frames"]) == run["epoch"]
    assert first["epoch"] != second["epoch"]


def test_epoch_leaves_topic_seq_and_payload_as_vllm_sends_them(published):
    for run in published:
        topic, seq, payload = run["frames"][:3]
        assert topic == b"kv@w0" and int.from_bytes(seq, "big") == 0
        batch = EventBatchDecoder().decode(payload)
        assert [type(e) for e in batch.events] == [AllBlocksCleared]


def test_epoch_off_sends_vllms_three_frames(published):
    off = published[2]
    assert len(off["frames"]) == 3 and off["epoch"] is None
    assert publisher_epoch(off["frames"]) is None
