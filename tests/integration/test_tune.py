"""``sluice tune`` through the real typer app, on real (small) simulations: 2 workers, a minute
or two of simulated time, 3–4 trials on 2 processes. The trace is a tiny gateway request log
written by the test itself. The committed tuned section is hot-reloaded by a live gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from controller.serve_config import load_serve_config
from scheduler.config import ProgramAwareConfig
from scheduler.config_reading import parse_policy_yaml
from sim.tuning import default_params
from tests.support.cli import assert_error, invoke

pytest.importorskip("optuna", reason="sluice tune needs the `tune` extra (optuna)")

SMALL = ("--workers", "2", "--jobs", "2", "--batch", "2")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()




def test_tune_on_a_workload_writes_a_policy_file_that_check_config_and_serve_accept(runner, tmp_path):
    out, report = tmp_path / "tuned.yaml", tmp_path / "results.json"
    result = invoke(runner, "tune", "--workload", "swebench", "--concurrency", "24", "--duration", "90",
                    "--trials", "4", *SMALL, "--seed", "7", "--holdout-seed", "8",
                    "--out", out, "--json", report)
    assert result.exit_code == 0, result.output

    # progress on stderr, one line per trial, trial 0 being the defaults
    progress = [line for line in result.stderr.splitlines() if line.startswith("trial ")]
    assert len(progress) == 4 and progress[0].startswith("trial 1/4 (defaults): ")
    assert all("tok/s" in line and "best" in line for line in progress)
    # the comparison on both data, then the verdict and the file
    assert "tuning" in result.stdout and "held back" in result.stdout
    assert f"wrote {out}" in result.stdout

    doc = json.loads(report.read_text())
    trials = doc["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2, 3]
    assert trials[0]["params"] == default_params("program_aware")
    best = trials[doc["best_trial"]]
    assert best["feasible"]
    assert best["output_tokens_per_s"] >= trials[0]["output_tokens_per_s"]
    assert all(t["output_tokens_per_s"] <= best["output_tokens_per_s"] for t in trials if t["feasible"])

    text = out.read_text()
    assert text.startswith("# made by: sluice ")  # the command line as given
    assert yaml.safe_load(text)["policy"] == best["policy"]
    if doc["best_trial"] == 0:
        assert parse_policy_yaml(text) == ProgramAwareConfig()

    checked = invoke(runner, "check-config", out)
    assert checked.exit_code == 0, checked.output
    assert checked.stdout.startswith("ok: policy program_aware")

    # the section as `sluice serve` reads it, in a serve config with a fleet
    serve = tmp_path / "sluice.yaml"
    serve.write_text("workers:\n  - name: w0\n    url: http://127.0.0.1:8001\n" + text)
    settings = load_serve_config(serve)
    assert settings.policy.model_dump() == parse_policy_yaml(text).model_dump()
    assert settings.policy.pause_threshold == best["policy"]["pause_threshold"]


def test_the_study_is_the_same_whatever_the_number_of_processes(runner, tmp_path):
    common = ("tune", "--workload", "swebench", "--concurrency", "16", "--duration", "60",
              "--trials", "3", "--workers", "2", "--batch", "2")
    one = invoke(runner, *common, "--jobs", "1", "--out", tmp_path / "a.yaml",
                 "--json", tmp_path / "a.json")
    two = invoke(runner, *common, "--jobs", "2", "--out", tmp_path / "b.yaml",
                 "--json", tmp_path / "b.json")
    assert one.exit_code == two.exit_code == 0, one.output + two.output
    trials = [json.loads((tmp_path / name).read_text())["trials"] for name in ("a.json", "b.json")]
    assert trials[0] == trials[1]


def write_request_log(path: Path, sessions: int) -> Path:
    """A gateway request log (sluice.request.v1 request_end records): each session three
    calls whose prompts extend the previous one, sessions starting 20 s apart."""
    t0 = 1_700_000_000_000
    lines = []
    for s in range(sessions):
        start = t0 + s * 20_000
        for k in range(3):
            received = start + k * 6_000
            lines.append(json.dumps({
                "schema": "sluice.request.v1", "event_type": "request_end",
                "agent_context": {"session_id": f"session-{s}"},
                "request": {"request_id": f"r{s}-{k}", "input_tokens": 2_000 + 1_500 * k,
                            "output_tokens": 120, "request_received_ms": received,
                            "total_time_ms": 2_000},
            }))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tune_on_the_gateways_request_log_checks_the_held_back_sessions(runner, tmp_path):
    trace = write_request_log(tmp_path / "requests.jsonl", sessions=10)
    out, report = tmp_path / "tuned.yaml", tmp_path / "results.json"
    result = invoke(runner, "tune", "--format", "sluice", "--trace", trace, "--trials", "3",
                    *SMALL, "--drain", "120", "--out", out, "--json", report)
    assert result.exit_code == 0, result.output
    doc = json.loads(report.read_text())
    assert "first 7 sessions" in doc["config"]["tuning_data"]
    assert "last 3 sessions (held back)" in doc["config"]["held_back_data"]
    # defaults and the best on each part; the defaults alone when no trial beat them
    rows = [(row["data"], row["policy"]) for row in doc["results"]]
    if doc["best_trial"] == 0:
        assert rows == [("tuning", "defaults"), ("held back", "defaults")]
        assert "no trial beat the defaults" in result.stdout
    else:
        best = f"trial {doc['best_trial']}"
        assert rows == [("tuning", "defaults"), ("tuning", best), ("held back", "defaults"),
                        ("held back", best)]
    assert invoke(runner, "check-config", out).exit_code == 0


@pytest.mark.parametrize("args, fragments", [
    (("--p99-slack", "0.5"), ["--p99-slack must be ≥ 1"]),
    (("--p99-limit-s", "0"), ["--p99-limit-s must be > 0"]),
    (("--policy", "kv_aware"), ["'kv_aware' has no search space", "program_aware"]),
    (("--workload", "nope"), ["unknown workload 'nope'"]),
    (("--preset", "nope"), ["unknown preset 'nope'"]),
    (("--seed", "3", "--holdout-seed", "3"), ["--holdout-seed must differ from --seed"]),
    (("--workload", "swebench", "--format", "sluice", "--trace", "x.jsonl"), ["two forms"]),
    (("--format", "sluice"), ["needs both --format and --trace"]),
    (("--format", "sluice", "--trace", "x.jsonl", "--holdout-seed", "8"),
     ["--holdout-seed applies to --workload"]),
    (("--format", "sluice", "--trace", "x.jsonl", "--holdout-fraction", "1.5"),
     ["--holdout-fraction must be between 0 and 1"]),
    (("--format", "nope", "--trace", "x.jsonl"), ["unknown trace format 'nope'"]),
    (("--scheduling-policy", "lifo"), ["--scheduling-policy must be one of fcfs, priority"]),
])
def test_bad_flags_exit_2_with_the_reason(runner, tmp_path, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)
    Path("x.jsonl").write_text("")
    result = invoke(runner, "tune", "--trials", "2", *args)
    assert_error(result, *fragments)
    assert not Path("tuned.yaml").exists()


def test_a_trace_with_one_conversation_cannot_hold_any_back(runner, tmp_path):
    trace = write_request_log(tmp_path / "one.jsonl", sessions=1)
    result = invoke(runner, "tune", "--format", "sluice", "--trace", trace, "--trials", "2", *SMALL,
                    "--out", tmp_path / "t.yaml")
    assert_error(result, "at least 2 conversations")


def test_trials_below_one_is_refused_by_the_flag(runner):
    result = invoke(runner, "tune", "--trials", "0")
    assert result.exit_code == 2
    assert "--trials" in result.output


def test_the_committed_tuned_section_is_hot_reloaded_by_a_running_gateway(tmp_path):
    """experiments/results/tuning/tuned.yaml, pasted into a serve config the gateway is
    running with, is applied by the reload (no restart)."""
    import os
    import time

    from tests.support.gateway_harness import ADMIN, ADMIN_TOKEN, gateway, wait_for

    tuned = yaml.safe_load((REPO / "experiments/results/tuning/tuned.yaml").read_text())["policy"]
    path = tmp_path / "sluice.yaml"

    def write(policy: dict) -> None:
        path.write_text(yaml.safe_dump({
            "admin_token": ADMIN_TOKEN, "admin_token_env": None, "reload_poll_s": 0.05,
            "health_interval_s": 30, "policy": policy,
            "workers": [{"name": "w0", "url": "http://127.0.0.1:9", "capacity_tokens": 100_000}],
        }), encoding="utf-8")
        stamp = time.time_ns() + 10_000_000  # a distinct mtime even on coarse filesystems
        os.utime(path, ns=(stamp, stamp))

    write({"name": "program_aware"})
    with gateway(load_serve_config(path)) as gw:
        def served() -> dict:
            return gw.client.get("/sluice/config", headers=ADMIN).json()

        assert served()["policy"]["pause_threshold"] == ProgramAwareConfig().pause_threshold
        write(tuned)
        wait_for(lambda: served()["policy"]["pause_threshold"] == tuned["pause_threshold"],
                 what="the tuned section applied")
        assert served()["reload"]["ok"] is True
        policy = served()["policy"]
        assert {key: policy[key] for key in tuned} == tuned


def test_a_limit_no_trial_meets_is_said_plainly_and_the_file_says_it_is_not_tuned(runner, tmp_path):
    out = tmp_path / "tuned.yaml"
    result = invoke(runner, "tune", "--concurrency", "16", "--duration", "60", "--trials", "3",
                    *SMALL, "--p99-limit-s", "0.001", "--out", out)
    assert result.exit_code == 0, result.output
    assert "NO trial met the p99 limit" in result.stdout
    assert "beats the defaults" not in result.stdout
    assert "# NO trial met the p99 limit" in out.read_text()
    assert invoke(runner, "check-config", out).exit_code == 0


def test_a_best_that_loses_on_the_held_back_data_is_reported_as_not_generalizing():
    from entry.tune_command import _verdict
    from sim.tuning import HeldBackCheck, Measurement, Study, TrialRecord

    def trial(number: int, tok_s: float) -> TrialRecord:
        return TrialRecord(number=number, params={}, keys={"name": "program_aware"},
                           measurement=Measurement(tok_s, 20.0, 0.9, {}), p99_excess_s=-1.0)

    study = Study(records=[trial(0, 100.0), trial(1, 110.0)], p99_limit_s=21.0)
    slower = HeldBackCheck(Measurement(100.0, 20.0, 0.9, {}), Measurement(98.0, 20.0, 0.9, {}), 25.0)
    [line] = _verdict(study, study.best, slower)
    assert line.startswith("did NOT generalize") and "-2.0% output tokens/s" in line
    slow_tail = HeldBackCheck(Measurement(100.0, 20.0, 0.9, {}), Measurement(105.0, 30.0, 0.9, {}), 25.0)
    [line] = _verdict(study, study.best, slow_tail)
    assert line.startswith("did NOT generalize") and "p99 30.0 s over its limit of 25.0 s" in line
    better = HeldBackCheck(Measurement(100.0, 20.0, 0.9, {}), Measurement(105.0, 20.0, 0.9, {}), 25.0)
    [line] = _verdict(study, study.best, better)
    assert "beats the defaults on the held-back data too: +5.0%" in line and "tie" not in line
