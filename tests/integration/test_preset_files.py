"""Measured presets through the commands: ``--preset-file`` on ``sim``, ``replay``, ``tune`` and
``simworker``, the sweep's ``preset_file:`` key, ``sluice presets`` saying where each preset's
numbers come from, and autellix's cost terms taken from a preset file.

The preset file is written by the test with coefficients, a KV pool and batch limits unlike any
named preset's, so a run that ignored part of it would not match the same model run in process.
The simworker runs as a real process on 127.0.0.1; the simulator's commands through the typer
app, except where the test is that nothing but ``error: ...`` reaches the terminal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from entry.ports import free_port
from scheduler.config import AutellixConfig
from sim.preset_file import write_preset_file
from sim.report import with_ceiling_ratio
from sim.runs import run_policies, workload_feed
from sim.step_time import DEFAULT_PRESET, Provenance, policy_cost_terms, preset, presets
from tests.support.cli import assert_error, invoke

REPO = Path(__file__).resolve().parents[2]
MEASURED = dataclasses.replace(
    preset(DEFAULT_PRESET), name="calibrated-test", description="a made-up engine the test measured",
    base_s=0.025, prefill_token_s=9e-5, seq_s=2e-4, context_token_s=1.1e-7, prefill_attention_s=5e-9,
    kv_capacity_tokens=120_000, max_num_seqs=6, max_num_batched_tokens=4096,
    provenance=Provenance("measured", "tests: a made-up engine", "written by the test",
                          r_squared=0.97, max_relative_error=0.08, samples=24))
SIM = ("sim", "--concurrency", 8, "--workers", 2, "--duration", 60, "--seed", 7)
POLICIES = ["program_aware", "kv_aware"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def preset_path(tmp_path) -> Path:
    path = tmp_path / "presets" / "measured.yaml"
    write_preset_file(MEASURED, path)
    return path


@pytest.fixture
def bad_preset_path(tmp_path) -> Path:
    """A preset file with one impossible value: a negative per-step cost."""
    path = tmp_path / "bad.yaml"
    write_preset_file(MEASURED, path)
    path.write_text(path.read_text().replace("base_s: 0.025", "base_s: -0.025"))
    return path




def sluice(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    """The ``sluice`` command of this checkout, as a process of its own."""
    return subprocess.run([sys.executable, "-m", "entry.cli", *[str(a) for a in args]], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)


def in_process_rows(model, *, concurrency: int = 8, workers: int = 2, duration: float = 60,
                    policies=POLICIES, ceiling: bool = True) -> list[dict]:
    """What ``sluice sim`` reports for ``model``, computed here without the command."""
    results = run_policies(policies, lambda: workload_feed("swebench", concurrency, 7),
                           workers=workers, preset=model, duration_s=duration, ceiling=ceiling,
                           show_progress=False)
    return json.loads(json.dumps(with_ceiling_ratio([result.summary() for result in results])))


def mooncake_trace(path: Path, prompt_tokens: int) -> Path:
    rows = [{"timestamp": 0, "input_length": 1300, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": prompt_tokens, "output_length": 10, "hash_ids": [0, 9]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- sim and replay -----------------------------------------------------------------------


def test_sim_with_a_preset_file_reports_the_rows_of_its_model_and_records_where_it_came_from(
        runner, tmp_path, preset_path):
    out = tmp_path / "file.json"
    result = invoke(runner, *SIM, "--policy", ",".join(POLICIES), "--preset-file", preset_path,
                    "--json", out)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["results"] == in_process_rows(MEASURED)
    assert {key: doc["config"][key] for key in ("preset", "preset_file", "preset_provenance")} == \
        {"preset": "calibrated-test", "preset_file": str(preset_path), "preset_provenance": "measured"}
    # the named preset is another engine: other rows, and the record says so
    named = tmp_path / "named.json"
    assert invoke(runner, *SIM, "--policy", ",".join(POLICIES), "--json", named).exit_code == 0
    named_doc = json.loads(named.read_text())
    assert [row["output_tokens_per_s"] for row in named_doc["results"]] != \
        [row["output_tokens_per_s"] for row in doc["results"]]
    assert {key: named_doc["config"][key] for key in ("preset", "preset_file", "preset_provenance")} == \
        {"preset": DEFAULT_PRESET, "preset_file": None, "preset_provenance": "datasheet"}


def test_autellix_takes_its_cost_terms_from_the_preset_file_unless_its_config_sets_them(
        runner, tmp_path, preset_path, monkeypatch):
    import sim.runs

    made: list = []
    make_policy = sim.runs.make_policy

    def recording_make_policy(config):
        made.append(config)
        return make_policy(config)

    monkeypatch.setattr(sim.runs, "make_policy", recording_make_policy)
    costs = policy_cost_terms(MEASURED)
    out = tmp_path / "autellix.json"
    result = invoke(runner, *SIM, "--policy", "autellix", "--no-ceiling", "--preset-file", preset_path,
                    "--json", out)
    assert result.exit_code == 0, result.output
    assert (made[0].decode_token_s, made[0].prefill_token_s) == \
        (costs["decode_token_s"], costs["prefill_token_s"])
    assert (f"autellix: decode_token_s {costs['decode_token_s']:.4g} from the preset file, "
            f"prefill_token_s {costs['prefill_token_s']:.4g} from the preset file") in result.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["policy_costs"] == costs
    # the same as the policy configured with those costs, in process
    configured = AutellixConfig(decode_token_s=costs["decode_token_s"], prefill_token_s=costs["prefill_token_s"])
    expected = run_policies(["autellix"], lambda: workload_feed("swebench", 8, 7), workers=2, preset=MEASURED,
                            duration_s=60, policy_config=configured, show_progress=False)
    assert doc["results"] == json.loads(json.dumps([r.summary() for r in expected]))

    # a key the policy config sets wins; the other still comes from the preset file
    config = tmp_path / "sluice.yaml"
    config.write_text("policy:\n  name: autellix\n  decode_token_s: 0.05\n")
    made.clear()
    result = invoke(runner, *SIM, "--policy", "autellix", "--no-ceiling", "--preset-file", preset_path,
                    "--config", config)
    assert result.exit_code == 0, result.output
    assert (made[0].decode_token_s, made[0].prefill_token_s) == (0.05, costs["prefill_token_s"])
    assert "decode_token_s 0.05 as configured" in result.stderr

    # a named preset leaves the policy's configured costs, and its record as it was
    made.clear()
    named = tmp_path / "named.json"
    result = invoke(runner, *SIM, "--policy", "autellix", "--no-ceiling", "--json", named)
    assert result.exit_code == 0, result.output
    assert (made[0].decode_token_s, made[0].prefill_token_s) == (0.02, 3.6e-5)
    assert "from the preset file" not in result.stderr
    assert "policy_costs" not in json.loads(named.read_text())["config"]


def test_replay_checks_the_trace_against_the_preset_files_pool(runner, tmp_path, preset_path):
    # 150,010 tokens fit the named preset's 426,483-token pool but not the file's 120,000
    trace = mooncake_trace(tmp_path / "mc.jsonl", 150_000)
    args = ("replay", "--format", "mooncake", "--trace", trace, "--workers", 1,
            "--policy", "least_loaded", "--drain", 30, "--no-ceiling")
    assert invoke(runner, *args).exit_code == 0
    assert_error(invoke(runner, *args, "--preset-file", preset_path),
                 "150,010 tokens", "119,808 tokens under preset 'calibrated-test'")
    small = mooncake_trace(tmp_path / "small.jsonl", 1800)
    out = tmp_path / "replay.json"
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", small, "--workers", 1,
                    "--policy", "least_loaded", "--drain", 30, "--preset-file", preset_path, "--json", out)
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["config"]
    assert (config["preset"], config["preset_file"], config["preset_provenance"]) == \
        ("calibrated-test", str(preset_path), "measured")


@pytest.mark.parametrize("command", [
    ("sim", "--duration", 10),
    ("replay", "--format", "mooncake", "--trace", "TRACE"),
    ("tune", "--trials", 1),
    ("simworker", "--port", 0),
])
def test_naming_both_a_preset_and_a_preset_file_is_refused(runner, tmp_path, preset_path, command):
    trace = mooncake_trace(tmp_path / "mc.jsonl", 1800)
    args = [trace if arg == "TRACE" else arg for arg in command]
    result = invoke(runner, *args, "--preset", DEFAULT_PRESET, "--preset-file", preset_path)
    assert_error(result, "--preset and --preset-file")


@pytest.mark.parametrize("command", [
    ("sim", "--duration", 10),
    ("replay", "--format", "mooncake", "--trace", "TRACE"),
    ("tune", "--trials", 1),
    ("simworker", "--port", 0),
    ("presets",),
])
def test_a_bad_preset_file_is_refused_naming_the_file_and_the_key(tmp_path, bad_preset_path, command):
    trace = mooncake_trace(tmp_path / "mc.jsonl", 1800)
    args = [trace if arg == "TRACE" else arg for arg in command]
    option = "--file" if command[0] == "presets" else "--preset-file"
    done = sluice(*args, option, bad_preset_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {bad_preset_path}: not a preset file"), done.stderr
    assert "base_s: Input should be greater than or equal to 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_preset_file_is_refused(runner, tmp_path):
    assert_error(invoke(runner, *SIM, "--preset-file", tmp_path / "nope.yaml"),
                 "nope.yaml: cannot read the preset file")


# -- sweep --------------------------------------------------------------------------------


def write_sweep(folder: Path, out: Path, **keys) -> Path:
    lines = {"name": "measured_sweep", "workers": 2, "duration_s": 60, "concurrency": "[8]",
             "policies": "[program_aware, kv_aware]", "output_dir": str(out), "jobs": 1,
             "ceiling": "false", **keys}
    path = folder / "sweep.yaml"
    path.write_text("".join(f"{key}: {value}\n" for key, value in lines.items()))
    return path


def test_sweep_preset_file_key_is_read_beside_the_sweep_file(runner, tmp_path, preset_path):
    # a path relative to the sweep file's folder, not to where the command runs
    sweep = write_sweep(preset_path.parent, tmp_path / "out", preset_file="measured.yaml")
    result = invoke(runner, "sweep", sweep)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    expected = in_process_rows(MEASURED, ceiling=False)
    assert [{key: row[key] for key in expected[0]} for row in doc["results"]] == expected
    assert {key: doc["config"][key] for key in ("preset", "preset_file", "preset_provenance")} == \
        {"preset": "calibrated-test", "preset_file": str(preset_path), "preset_provenance": "measured"}
    assert f"preset `calibrated-test` ({preset_path}, measured)" in \
        (tmp_path / "out" / "results.md").read_text()


def test_a_sweep_on_a_preset_file_gives_autellix_its_cost_terms(runner, tmp_path, preset_path):
    sweep = write_sweep(preset_path.parent, tmp_path / "out", preset_file="measured.yaml",
                        policies="[autellix]", policy="{name: autellix, decode_token_s: 0.05}")
    result = invoke(runner, "sweep", sweep)
    assert result.exit_code == 0, result.output
    costs = policy_cost_terms(MEASURED)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["config"]["policy_costs"] == costs
    # the run is autellix with the file's prefill cost and the sweep's own decode cost
    configured = AutellixConfig(decode_token_s=0.05, prefill_token_s=costs["prefill_token_s"])
    [expected] = run_policies(["autellix"], lambda: workload_feed("swebench", 8, 7), workers=2,
                              preset=MEASURED, duration_s=60, policy_config=configured, show_progress=False)
    assert doc["results"][0]["output_tokens_per_s"] == expected.summary()["output_tokens_per_s"]
    note = (f"autellix: prefill_token_s {costs['prefill_token_s']:.4g} from the preset file, "
            "decode_token_s 0.05 as configured")
    assert note in result.stderr and f"Cost terms: {note}." in (tmp_path / "out" / "results.md").read_text()


def test_sweep_refuses_both_keys_and_a_bad_preset_file_naming_the_key(runner, tmp_path,
                                                                     preset_path, bad_preset_path):
    both = write_sweep(preset_path.parent, tmp_path / "never", preset=DEFAULT_PRESET,
                       preset_file="measured.yaml")
    assert_error(invoke(runner, "sweep", both), f"{both}: preset_file: preset and preset_file")
    bad = write_sweep(bad_preset_path.parent, tmp_path / "never", preset_file=bad_preset_path.name)
    assert_error(invoke(runner, "sweep", bad), f"{bad}: preset_file: {bad_preset_path}: not a preset file",
                 "base_s")
    assert not (tmp_path / "never").exists()


# -- tune ---------------------------------------------------------------------------------


def test_tune_runs_its_trials_on_the_preset_files_model(runner, tmp_path, preset_path):
    pytest.importorskip("optuna", reason="sluice tune needs the `tune` extra (optuna)")
    out = tmp_path / "tune.json"
    result = invoke(runner, "tune", "--workload", "swebench", "--concurrency", 8, "--workers", 2,
                    "--duration", 60, "--trials", 1, "--batch", 1, "--jobs", 1,
                    "--preset-file", preset_path, "--out", tmp_path / "tuned.yaml", "--json", out)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    # trial 0 is the policy's defaults, on the tuning seed: what sim reports for the same model
    [defaults] = [row for row in doc["results"] if row["data"] == "tuning"]
    [expected] = in_process_rows(MEASURED, policies=["program_aware"], ceiling=False)
    assert defaults["output_tokens_per_s"] == expected["output_tokens_per_s"]
    assert (doc["config"]["preset"], doc["config"]["preset_file"], doc["config"]["preset_provenance"]) == \
        ("calibrated-test", str(preset_path), "measured")


# -- simworker ----------------------------------------------------------------------------


def test_simworker_serves_the_preset_files_model(tmp_path, preset_path):
    port, kv = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "entry.cli", "simworker", "--port", str(port),
         "--kv-events", f"tcp://127.0.0.1:{kv}", "--time-scale", "0.05", "--name", "measured",
         "--preset-file", str(preset_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the simworker did not start in 20 s"
            time.sleep(0.05)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        # the file's pool: 120,000 tokens in 16-token blocks, plus vLLM's null block
        assert 'kv_cache_size_tokens="120000"' in metrics and 'num_gpu_blocks="7501"' in metrics
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "sluice-sim", "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello from a measured engine"}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    banner = err.decode()
    assert f"preset calibrated-test from {preset_path} (measured)" in banner
    ready = json.loads(next(line for line in banner.splitlines() if "simworker ready" in line))
    assert (ready["preset"], ready["preset_provenance"]) == ("calibrated-test", "measured")


# -- presets ------------------------------------------------------------------------------


def test_presets_say_where_their_numbers_come_from(runner, preset_path):
    named = invoke(runner, "presets")
    assert named.exit_code == 0
    lines = named.stdout.splitlines()
    assert len(lines) == 3 * len(presets())
    for (first, costs, source), name in zip(zip(lines[::3], lines[1::3], lines[2::3]), presets()):
        assert first.startswith(name)
        assert costs.strip().startswith("decode step ") and costs.endswith("(no attention term)")
        assert source.split()[0] == "datasheet:"
    shown = invoke(runner, "presets", "--file", preset_path)
    assert shown.exit_code == 0, shown.output
    first, costs, source = shown.stdout.splitlines()
    assert first.startswith("calibrated-test") and "KV pool 120,000 tokens" in first
    assert costs.strip() == ("decode step 25.0 ms + 110 ns/context token; "
                             "prefill 90 µs/prompt token + 5 ns/attention pair")
    assert source.strip() == ("measured: tests: a made-up engine; written by the test; "
                              "fit R² 0.970, max relative error 8.0%, 24 samples")
