"""The simulator's commands (entry/sim_commands.py) through the real ``sluice`` typer app: ``sim``,
``replay``, ``sweep``, ``presets``, and ``check-config``'s threshold check.

Runs are short (60 simulated seconds, a handful of programs) so the whole file takes a few
seconds. Every trace and YAML file is written into ``tmp_path`` by the test itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.step_time import presets
from tests.support.cli import assert_error, invoke

SUMMARY_KEYS = {"policy", "output_tokens_per_s", "steps_per_min", "hit_rate", "reprefill_tokens",
                "p50_call_s", "p99_call_s", "pauses", "resumes"}
TABLE_TITLES = ["policy", "out tok/s", "steps/min", "hit rate", "re-prefill tok", "p50 call s",
                "p99 call s", "pauses", "resumes"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()



def assert_table(stdout: str, policies: list[str]) -> None:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("policy"))
    for title in TABLE_TITLES:
        assert title in lines[header]
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    rows = lines[header + 2: header + 2 + len(policies)]
    assert [row.split()[0] for row in rows] == policies


def assert_results(path: Path, policies: list[str]) -> dict:
    doc = json.loads(path.read_text())
    assert set(doc) == {"results", "config"}
    assert [row["policy"] for row in doc["results"]] == policies
    for row in doc["results"]:
        assert SUMMARY_KEYS <= set(row)
        assert row["output_tokens_per_s"] > 0 and row["steps_per_min"] > 0
        assert 0.0 <= row["hit_rate"] <= 1.0
    return doc



# -- sim --------------------------------------------------------------------------------


def test_sim_prints_the_table_and_writes_the_json_report(runner, tmp_path):
    out = tmp_path / "reports" / "sim.json"
    result = invoke(runner, "sim", "--concurrency", 8, "--workers", 2, "--duration", 60,
                    "--json", out)
    assert result.exit_code == 0, result.output
    policies = ["program_aware", "kv_aware", "least_loaded"]
    assert_table(result.stdout, policies + ["ceiling"])
    assert "of ceiling" in result.stdout
    assert f"wrote {out}" in result.stdout
    doc = assert_results(out, policies + ["ceiling"])
    ceiling = doc["results"][-1]
    assert ceiling["of_ceiling"] == 1.0
    for row in doc["results"]:
        assert row["of_ceiling"] == round(row["output_tokens_per_s"] / ceiling["output_tokens_per_s"], 4)
    config = doc["config"]
    assert {k: config[k] for k in ("workload", "concurrency", "workers", "preset", "duration_s",
                                   "seed", "block_size", "policies")} == {
        "workload": "swebench", "concurrency": 8, "workers": 2, "preset": "llama3.1-8b-h100",
        "duration_s": 60.0, "seed": 7, "block_size": 64, "policies": policies}
    assert config["command"].startswith("sluice ")
    # the table shows the same numbers as the JSON
    for row in doc["results"]:
        line = next(x for x in result.stdout.splitlines() if x.startswith(row["policy"]))
        assert f"{row['hit_rate']:.1%}" in line
        assert f"{row['reprefill_tokens']:,}" in line


def test_sim_rl_rollout_with_chosen_policies(runner, tmp_path):
    out = tmp_path / "rl.json"
    result = invoke(runner, "sim", "--workload", "rl_rollout", "--concurrency", 8, "--workers", 2,
                    "--duration", 60, "--policy", "round_robin, continuum", "--seed", 3,
                    "--no-ceiling", "--json", out)
    assert result.exit_code == 0, result.output
    assert_table(result.stdout, ["round_robin", "continuum"])
    assert "of ceiling" not in result.stdout
    doc = assert_results(out, ["round_robin", "continuum"])
    assert all("of_ceiling" not in row for row in doc["results"])
    assert doc["config"]["workload"] == "rl_rollout" and doc["config"]["seed"] == 3


def test_sim_burst_runs_until_its_programs_end_and_shows_start_waits_by_size(runner, tmp_path):
    out = tmp_path / "burst.json"
    result = invoke(runner, "sim", "--workload", "burst", "--concurrency", 10, "--workers", 1,
                    "--duration", 100000, "--policy", "thunderagent", "--no-ceiling", "--json", out)
    assert result.exit_code == 0, result.output
    assert "p99 start largest 10% s" in result.stdout
    [row] = json.loads(out.read_text())["results"]
    assert {"p99_start_wait_s", "p99_start_wait_smallest_tenth_s",
            "p99_start_wait_largest_tenth_s"} <= set(row)
    assert json.loads(out.read_text())["config"]["workload"] == "burst"


def test_sim_without_json_writes_no_file(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(runner, "sim", "--concurrency", 2, "--workers", 1, "--duration", 30,
                    "--policy", "least_loaded")
    assert result.exit_code == 0, result.output
    assert_table(result.stdout, ["least_loaded", "ceiling"])
    assert "wrote" not in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_sim_scheduling_policy_reaches_every_engine_and_the_report(runner, tmp_path, monkeypatch):
    import sim.runs

    given: list[str] = []

    class Recorded(sim.runs.Simulation):
        def __init__(self, *args, scheduling_policy: str, **kwargs):
            given.append(scheduling_policy)
            super().__init__(*args, scheduling_policy=scheduling_policy, **kwargs)

    monkeypatch.setattr(sim.runs, "Simulation", Recorded)
    for flag, expected in (([], "priority"), (["--scheduling-policy", "fcfs"], "fcfs")):
        given.clear()
        out = tmp_path / f"{expected}.json"
        result = invoke(runner, "sim", "--concurrency", 2, "--workers", 1, "--duration", 20,
                        "--policy", "least_loaded,autellix", *flag, "--json", out)
        assert result.exit_code == 0, result.output
        assert given == [expected] * 3  # both policies and the ceiling
        assert json.loads(out.read_text())["config"]["scheduling_policy"] == expected


@pytest.mark.parametrize("option,value,fragment", [
    ("--policy", "program_aware,nope", "unknown policy nope"),
    ("--policy", " , ", "--policy needs at least one policy name"),
    ("--preset", "gpt-9-tpu", "unknown preset 'gpt-9-tpu'"),
    ("--workload", "chatbot", "unknown workload 'chatbot'"),
    ("--scheduling-policy", "lifo", "--scheduling-policy must be one of fcfs, priority, got 'lifo'"),
])
def test_sim_rejects_unknown_names_with_status_2(runner, tmp_path, option, value, fragment):
    out = tmp_path / "never.json"
    result = invoke(runner, "sim", "--duration", 10, option, value, "--json", out)
    assert_error(result, fragment)
    assert not out.exists()
    assert "Traceback" not in result.output


def test_sim_shards_runs_the_split_fleet_and_records_k(runner, tmp_path):
    out = tmp_path / "shards.json"
    result = invoke(runner, "sim", "--concurrency", 8, "--workers", 4, "--duration", 60,
                    "--policy", "program_aware", "--shards", 2, "--json", out)
    assert result.exit_code == 0, result.output
    doc = assert_results(out, ["program_aware", "ceiling"])
    assert doc["config"]["shards"] == 2
    refused = invoke(runner, "sim", "--duration", 10, "--workers", 2, "--shards", 3)
    assert_error(refused, "--shards 3 needs at least as many --workers, got 2")


# -- replay -----------------------------------------------------------------------------


def mooncake_rows() -> list[dict]:
    """Two conversations over a shared system-prompt block (512-token blocks)."""
    def row(ts, n_in, n_out, hashes):
        return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": hashes}

    return [
        row(0, 1300, 100, [0, 1, 2]),
        row(500, 1800, 50, [0, 10, 11, 12]),
        row(4000, 2400, 80, [0, 1, 3, 4, 5]),
        row(6000, 2300, 60, [0, 10, 11, 13, 14]),
        row(9000, 2900, 70, [0, 1, 3, 4, 6, 7]),
        row(9500, 3000, 20, [0, 10, 11, 13, 15, 16]),
    ]


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_replay_mooncake_trace(runner, tmp_path):
    trace = write_lines(tmp_path / "mc.jsonl", mooncake_rows())
    out = tmp_path / "replay.json"
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace, "--workers", 2,
                    "--drain", 60, "--json", out)
    assert result.exit_code == 0, result.output
    assert "6 calls in 2 sessions" in result.stderr and "block size 512" in result.stderr
    assert_table(result.stdout, ["program_aware", "kv_aware", "ceiling"])
    doc = assert_results(out, ["program_aware", "kv_aware", "ceiling"])
    config = doc["config"]
    assert (config["format"], config["trace"], config["block_size"], config["workers"]) == \
        ("mooncake", str(trace), 512, 2)
    # each conversation re-sends its earlier blocks: some of the prompt is served from cache
    assert all(row["hit_rate"] > 0 for row in doc["results"])
    # 6 calls over a run that ends with the last of them (a few seconds past 9.5 s)
    for row in doc["results"]:
        assert 6 / (10 + 60) * 60 < row["steps_per_min"]


def test_replay_time_scale_compresses_the_trace(runner, tmp_path):
    trace = write_lines(tmp_path / "mc.jsonl", mooncake_rows())
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace, "--workers", 1,
                    "--policy", "least_loaded", "--time-scale", 0.5, "--drain", 30)
    assert result.exit_code == 0, result.output
    assert "over 5 s" in result.stderr  # 9.5 s of arrivals at half speed
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace,
                    "--time-scale", 0)
    assert_error(result, "--time-scale must be > 0")


@pytest.mark.parametrize("line,bad,fragment", [
    (3, "{not json", ""),
    (2, {"timestamp": 500, "input_length": 1800, "output_length": 50}, "hash_ids"),
    (4, {"timestamp": 4000, "input_length": -5, "output_length": 80, "hash_ids": [0]}, "input_length"),
])
def test_replay_malformed_trace_line_names_the_line(runner, tmp_path, line, bad, fragment):
    rows = mooncake_rows()
    rows[line - 1] = bad
    trace = write_lines(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "never.json"
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace, "--json", out)
    assert_error(result, f"{trace}:{line}:", fragment)
    assert not out.exists()
    assert "Traceback" not in result.output


def test_replay_missing_trace_and_unknown_format_exit_2(runner, tmp_path):
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", tmp_path / "nope.jsonl")
    assert_error(result, "nope.jsonl")
    trace = write_lines(tmp_path / "mc.jsonl", mooncake_rows())
    result = invoke(runner, "replay", "--format", "parquet", "--trace", trace)
    assert_error(result, "parquet")
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace, "--policy", "fifo")
    assert_error(result, "unknown policy fifo")


def test_replay_call_larger_than_a_worker_pool_exits_2(runner, tmp_path):
    # llama3.1-8b-h100 holds 426,483 tokens of KV (425,984 in whole 512-token blocks)
    rows = mooncake_rows()
    rows[1] = {"timestamp": 500, "input_length": 500_000, "output_length": 10, "hash_ids": [0, 99]}
    trace = write_lines(tmp_path / "big.jsonl", rows)
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace,
                    "--policy", "least_loaded")
    assert_error(result, str(trace), "500,010 tokens", "425,984", "llama3.1-8b-h100")
    # the same trace fits the larger H200 pool
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace, "--workers", 1,
                    "--policy", "least_loaded", "--preset", "llama3.1-8b-h200", "--drain", 30)
    assert result.exit_code == 0, result.output


def kvtester_conversation() -> dict:
    return {
        "id": "conv1",
        "block_size": 64,
        "requests": [
            {"t": 0.0, "type": "n", "in": 200, "out": 50, "hash_ids": [1, 2, 3, 4], "api_time": 2.0},
            {"t": 5.0, "type": "n", "in": 300, "out": 20, "hash_ids": [1, 2, 3, 5, 6],
             "think_time": 1.5},
            {"type": "subagent", "id": "agentX", "requests": [
                {"t": 6.0, "type": "n", "in": 150, "out": 30, "hash_ids": [1, 2, 7]},
                {"t": 9.0, "type": "s", "in": 260, "out": 10, "hash_ids": [1, 2, 7, 8, 9],
                 "think_time": 0.5},
            ]},
            {"t": 12.0, "type": "s", "in": 400, "out": 40,
             "hash_ids": [1, 2, 3, 5, 10, 11, 12], "think_time": 2.0, "ttft": 0.3},
        ],
    }


def test_replay_kvtester_conversation(runner, tmp_path):
    trace = tmp_path / "conv.json"
    trace.write_text(json.dumps(kvtester_conversation()))
    out = tmp_path / "kv.json"
    result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace, "--workers", 2,
                    "--policy", "program_aware,least_loaded", "--drain", 60, "--json", out)
    assert result.exit_code == 0, result.output
    assert "5 calls in 2 sessions" in result.stderr and "block size 64" in result.stderr
    assert_table(result.stdout, ["program_aware", "least_loaded", "ceiling"])
    doc = assert_results(out, ["program_aware", "least_loaded", "ceiling"])
    assert doc["config"]["format"] == "kvtester" and doc["config"]["block_size"] == 64
    assert doc["results"][-1]["of_ceiling"] == 1.0


def test_replay_kvtester_error_names_the_json_path(runner, tmp_path):
    doc = kvtester_conversation()
    doc["requests"][1]["in"] = -5
    trace = tmp_path / "conv.json"
    trace.write_text(json.dumps(doc))
    result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace)
    assert_error(result, "requests[1].in")


# -- replay: kv-cache-tester semantics and the closed loop ----------------------------------


def agent_conversation(cid: str, base_hash: int, *, turns: int = 2, first_t: float = 0.0,
                       gap_s: float = 1.0, think_s: float = 0.5, **extra) -> dict:
    """A kv-cache-tester conversation: ``turns`` requests, a sub-agent started after the
    first (its times count from its entry's ``t``) that the second waits for."""
    def request(t: float, n_in: int, hashes: list[int], **fields) -> dict:
        return {"t": t, "type": "s", "in": n_in, "out": 16, "hash_ids": hashes, **fields}

    own = [base_hash + i for i in range(turns + 4)]
    requests = [request(first_t, 200, own[:4])]
    requests.append({"type": "subagent", "agent_id": "explore", "t": first_t + 0.5, "requests": [
        request(0.0, 150, [base_hash + 100, base_hash + 101, base_hash + 102]),
        request(gap_s, 220, [base_hash + 100, base_hash + 101, base_hash + 102, base_hash + 103],
                think_time=think_s)]})
    for k in range(1, turns):
        requests.append(request(first_t + k * gap_s, 200 + 64 * k, own[:4 + k], think_time=think_s))
    return {"id": cid, "block_size": 64, **extra, "requests": requests}


def write_conversations(directory: Path, docs: list[dict]) -> Path:
    directory.mkdir()
    for n, doc in enumerate(docs):
        (directory / f"{n:03d}.json").write_text(json.dumps(doc))
    return directory


def test_replay_concurrency_keeps_n_conversations_in_flight_and_starts_the_next_when_one_ends(
        runner, tmp_path, monkeypatch):
    from sim.feeds import ConversationLoop

    starts: list[tuple[float, int]] = []  # (time, conversation) as each one starts
    ends: dict[str, float] = {}
    start_next, on_end = ConversationLoop._start_next, ConversationLoop.on_program_end

    def record_start(self, now):
        starts.append((now, self._next))
        return start_next(self, now)

    def record_end(self, spec, now):
        ends[spec.session_id] = now
        return on_end(self, spec, now)

    monkeypatch.setattr(ConversationLoop, "_start_next", record_start)
    monkeypatch.setattr(ConversationLoop, "on_program_end", record_end)
    # recorded 10 minutes apart: an open-loop replay would take an hour
    docs = [agent_conversation(f"c{n}", 1000 * n, turns=2 + n % 3, first_t=600.0 * n)
            for n in range(6)]
    trace = write_conversations(tmp_path / "convs", docs)
    out = tmp_path / "closed.json"
    result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace, "--workers", 1,
                    "--policy", "least_loaded", "--concurrency", 2, "--no-ceiling", "--json", out)
    assert result.exit_code == 0, result.output
    assert "6 conversations, 2 in flight at a time" in result.stderr
    assert_results(out, ["least_loaded"])
    assert json.loads(out.read_text())["config"]["concurrency"] == 2
    # every conversation ran, in trace order, and every program of it ended
    assert [n for _, n in starts] == list(range(6))
    assert len(ends) == 12  # 6 conversations of a top-level session and a sub-agent
    begin = [t for t, _ in starts]
    finish = [max(t for sid, t in ends.items() if sid.split("/")[0] == f"c{n}") for n in range(6)]
    assert begin[:2] == [0.0, 0.0]
    for n in range(2, 6):
        assert begin[n] in finish[:n], n  # the moment an earlier conversation ended
        assert sum(1 for j in range(6) if begin[j] <= begin[n] < finish[j]) == 2
    assert max(finish) < 600.0  # recorded start times are not waited for


def test_replay_kvtester_think_timing_does_not_wait_out_recorded_gaps(runner, tmp_path):
    # recorded 120 s apart, but the client thought for 0.5 s: the rest was the old server
    trace = tmp_path / "conv.json"
    trace.write_text(json.dumps(agent_conversation("c", 0, turns=4, gap_s=120.0)))
    rows = {}
    for timing in ("think", "recorded"):
        out = tmp_path / f"{timing}.json"
        result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace,
                        "--workers", 1, "--policy", "least_loaded", "--timing", timing,
                        "--json", out)
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert doc["config"]["timing"] == timing
        rows[timing] = doc["results"][0]
    # the same 6 calls; recorded timing spreads them over 6 minutes, think over seconds
    assert rows["recorded"]["steps_per_min"] < 2.0
    assert rows["think"]["steps_per_min"] > 20 * rows["recorded"]["steps_per_min"]


def test_replay_warm_prefix_lets_conversations_share_the_tool_prefix(runner, tmp_path):
    # two conversations with nothing in common but the declared tool + system prefix
    # (192 tokens: 3 blocks); the second starts once the first's first call is done
    docs = [agent_conversation("a", 0, tool_tokens=128, system_tokens=64),
            agent_conversation("b", 5000, first_t=5.0, tool_tokens=128, system_tokens=64)]
    trace = write_conversations(tmp_path / "convs", docs)
    hit_rate = {}
    for warm in (0, 1):
        out = tmp_path / f"warm{warm}.json"
        result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace,
                        "--workers", 1, "--policy", "least_loaded", "--warm-prefix", warm,
                        "--json", out)
        assert result.exit_code == 0, result.output
        hit_rate[warm] = json.loads(out.read_text())["results"][0]["hit_rate"]
    assert hit_rate[1] > hit_rate[0]


def test_replay_timing_and_warm_prefix_apply_only_to_kvtester(runner, tmp_path):
    trace = write_lines(tmp_path / "mc.jsonl", mooncake_rows())
    result = invoke(runner, "replay", "--format", "mooncake", "--trace", trace,
                    "--timing", "think")
    assert_error(result, "--timing apply only to --format kvtester")
    kv = tmp_path / "conv.json"
    kv.write_text(json.dumps(agent_conversation("c", 0)))
    result = invoke(runner, "replay", "--format", "kvtester", "--trace", kv, "--timing", "original")
    assert_error(result, "--timing must be one of think, recorded")


def test_replay_reports_every_call_that_cannot_fit(runner, tmp_path):
    # llama3.1-8b-h100 holds 426,432 tokens of KV in whole 64-token blocks; 25 calls in 3
    # sessions (two conversations and a sub-agent) need more
    def huge(t: float) -> dict:
        return {"t": t, "type": "s", "in": 500_000, "out": 10, "hash_ids": []}

    first = agent_conversation("big", 0)
    first["requests"] += [huge(10.0 + k) for k in range(10)]
    first["requests"][1]["requests"] += [huge(5.0 + k) for k in range(5)]
    second = agent_conversation("huge", 9000)
    second["requests"] += [huge(10.0 + k) for k in range(10)]
    trace = write_conversations(tmp_path / "convs", [first, second])
    result = invoke(runner, "replay", "--format", "kvtester", "--trace", trace)
    assert_error(result, "25 calls in 3 sessions need more KV than a worker's whole pool "
                 "(426,432 tokens under preset 'llama3.1-8b-h100'):",
                 "  session big call 2: 500,010 tokens", "  session huge call 11: 500,010 tokens",
                 "  and 5 more")  # the sub-agent's, whose session starts last
    listed = [line for line in result.stderr.splitlines() if line.startswith("  session ")]
    assert len(listed) == len(set(listed)) == 20


# -- sweep ------------------------------------------------------------------------------


def write_sweep(path: Path, output_dir: Path, **overrides) -> Path:
    lines = {
        "name": "tiny_sweep",
        "workload": "swebench",
        "workers": 2,
        "duration_s": 60,
        "concurrency": "[2, 4]",
        "policies": "[least_loaded, round_robin]",
        "output_dir": str(output_dir),
        "jobs": 1,
    }
    lines.update(overrides)
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items() if v is not None))
    return path


def test_sweep_writes_table_json_and_plots(runner, tmp_path):
    out_dir = tmp_path / "results" / "tiny"
    config = write_sweep(tmp_path / "sweep.yaml", out_dir)
    result = invoke(runner, "sweep", config)
    assert result.exit_code == 0, result.output
    for name in ("results.md", "results.json", "throughput.png", "hit_rate.png", "p99_latency.png"):
        assert (out_dir / name).is_file() and (out_dir / name).stat().st_size > 0, name
    for name in ("throughput.png", "hit_rate.png", "p99_latency.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out_dir / "results.json").read_text())
    assert set(doc) == {"results", "config"}
    grid = [(row["concurrency"], row["policy"]) for row in doc["results"]]
    assert grid == [(2, "least_loaded"), (2, "round_robin"), (2, "ceiling"),
                    (4, "least_loaded"), (4, "round_robin"), (4, "ceiling")]
    ceilings = {row["concurrency"]: row["output_tokens_per_s"] for row in doc["results"]
                if row["policy"] == "ceiling"}
    for row in doc["results"]:
        assert SUMMARY_KEYS <= set(row)
        assert row["calls"] > 0
        # each row is read against the ceiling of its own concurrency
        assert row["of_ceiling"] == round(row["output_tokens_per_s"] / ceilings[row["concurrency"]], 4)
    assert doc["config"]["concurrency"] == [2, 4] and doc["config"]["duration_s"] == 60
    markdown = (out_dir / "results.md").read_text()
    assert markdown.startswith("# tiny_sweep")
    table_rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table_rows) == 1 + 6  # header and one row per run, ceilings included
    assert "| concurrency | policy |" in table_rows[0]
    # the command prints the table and where it wrote
    assert "| concurrency | policy |" in result.stdout
    assert f"wrote {out_dir}/results.md" in result.stdout


def test_sweep_scheduling_policy_key_reaches_each_run_and_the_report(runner, tmp_path, monkeypatch):
    import sim.sweep
    from sim.sweep import load_sweep

    config = write_sweep(tmp_path / "sweep.yaml", tmp_path / "out", scheduling_policy="fcfs")
    spec, policy_config = load_sweep(config.read_text(), str(config))
    assert spec.scheduling_policy == "fcfs"
    assert load_sweep(write_sweep(tmp_path / "default.yaml", tmp_path / "d").read_text(),
                      "default.yaml")[0].scheduling_policy == "priority"
    given: list[str] = []
    run_policies = sim.sweep.run_policies

    def recorded(*args, scheduling_policy: str, **kwargs):
        given.append(scheduling_policy)
        return run_policies(*args, scheduling_policy=scheduling_policy, **kwargs)

    monkeypatch.setattr(sim.sweep, "run_policies", recorded)
    sim.sweep._one((spec, policy_config, 2, "least_loaded", spec.seed))
    assert given == ["fcfs"]
    # through the command: the report says which it ran under
    result = invoke(runner, "sweep", write_sweep(tmp_path / "one.yaml", tmp_path / "one",
                                                 concurrency="[2]", policies="[least_loaded]",
                                                 ceiling="false", scheduling_policy="fcfs"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "one" / "results.json").read_text())["config"][
        "scheduling_policy"] == "fcfs"
    assert "engines' scheduling policy fcfs" in (tmp_path / "one" / "results.md").read_text()


def test_sweep_held_back_seeds_run_the_same_grid_in_a_table_of_their_own(runner, tmp_path):
    out_dir = tmp_path / "held"
    config = write_sweep(tmp_path / "sweep.yaml", out_dir, concurrency="[3]",
                         policies="[least_loaded]", held_back_seeds="[8, 9]")
    result = invoke(runner, "sweep", config)
    assert result.exit_code == 0, result.output
    rows = json.loads((out_dir / "results.json").read_text())["results"]
    assert [(r["seed"], r["policy"]) for r in rows] == [
        (7, "least_loaded"), (7, "ceiling"), (8, "least_loaded"), (8, "ceiling"),
        (9, "least_loaded"), (9, "ceiling")]
    # a seed is its own programs: the results differ, and each is read against its own ceiling
    assert len({r["output_tokens_per_s"] for r in rows if r["policy"] == "least_loaded"}) == 3
    for row in rows:
        ceiling = next(c for c in rows if c["policy"] == "ceiling" and c["seed"] == row["seed"])
        assert row["of_ceiling"] == round(row["output_tokens_per_s"] / ceiling["output_tokens_per_s"], 4)
    markdown = (out_dir / "results.md").read_text()
    main, held = markdown.split("Held-back seeds (8, 9)")
    assert len([line for line in main.splitlines() if line.startswith("| 3 |")]) == 2
    assert "| seed | concurrency | policy |" in held
    assert len([line for line in held.splitlines() if line.startswith("| 8 | 3 |")]) == 2
    # one seed alone still writes a single table
    single = write_sweep(tmp_path / "one.yaml", tmp_path / "one", concurrency="[3]",
                         policies="[least_loaded]", ceiling="false")
    assert invoke(runner, "sweep", single).exit_code == 0
    assert "Held-back" not in (tmp_path / "one" / "results.md").read_text()


def test_sweep_jobs_do_not_change_the_results(runner, tmp_path):
    one = write_sweep(tmp_path / "one.yaml", tmp_path / "one", concurrency="[3]")
    two = write_sweep(tmp_path / "two.yaml", tmp_path / "two", concurrency="[3]", jobs=2)
    assert invoke(runner, "sweep", one).exit_code == 0
    assert invoke(runner, "sweep", two).exit_code == 0
    first = json.loads((tmp_path / "one" / "results.json").read_text())["results"]
    second = json.loads((tmp_path / "two" / "results.json").read_text())["results"]
    assert first == second


@pytest.mark.parametrize("overrides,fragments", [
    ({"concurrencies": "[2, 4]"}, ["concurrencies"]),
    ({"policies": "[least_loaded, nope]"}, ["policies", "unknown policy 'nope'"]),
    ({"preset": "tpu-v9"}, ["preset", "unknown preset 'tpu-v9'"]),
    ({"concurrency": "[0, 4]"}, ["concurrency.0"]),
    ({"policy": "{pause_target: 0.99, pause_threshold: 0.95}"}, ["pause_target", "pause_threshold"]),
    ({"scheduling_policy": "lifo"}, ["scheduling_policy", "'fcfs' or 'priority'"]),
])
def test_sweep_bad_config_exits_2_naming_the_key(runner, tmp_path, overrides, fragments):
    out_dir = tmp_path / "never"
    config = write_sweep(tmp_path / "sweep.yaml", out_dir, **overrides)
    result = invoke(runner, "sweep", config)
    assert_error(result, str(config), *fragments)
    assert not out_dir.exists()


def test_sweep_unreadable_or_invalid_yaml_exits_2(runner, tmp_path):
    result = invoke(runner, "sweep", tmp_path / "missing.yaml")
    assert_error(result, "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert_error(invoke(runner, "sweep", bad), "not valid YAML")


# -- check-config and presets -----------------------------------------------------------


def test_check_config_rejects_pause_target_above_pause_threshold(runner, tmp_path):
    config = tmp_path / "sluice.yaml"
    config.write_text("policy:\n  pause_target: 0.99\n  pause_threshold: 0.95\n")
    result = invoke(runner, "check-config", config)
    assert_error(result, str(config), "pause_target", "pause_threshold", "0.99", "0.95")
    config.write_text("policy:\n  pause_target: 0.9\n  pause_threshold: 0.95\n")
    result = invoke(runner, "check-config", config)
    assert result.exit_code == 0 and result.stdout.startswith("ok: policy program_aware")



def test_check_config_validates_the_whole_file_as_serve_does(runner, tmp_path):
    config = tmp_path / "sluice.yaml"
    # A good policy: section used to be enough for "ok" although serve refuses this file.
    config.write_text("workers:\n  - name: w0\n    url: ftp://nowhere\n"
                      "listen: {port: 70000}\npolicy:\n  pause_threshold: 0.9\n")
    assert_error(invoke(runner, "check-config", config), str(config), "workers.0.url", "listen.port")
    config.write_text("workers: []\npolicy:\n  pause_threshold: 0.9\n")
    assert_error(invoke(runner, "check-config", config), "workers")
    config.write_text("workers:\n  - name: w0\n    url: http://127.0.0.1:8000\n"
                      "  - name: w1\n    url: http://127.0.0.1:8001\n"
                      "    kv_events: ipc:///tmp/sluice-w1-kv.sock\n"
                      "policy:\n  pause_threshold: 0.9\n")
    result = invoke(runner, "check-config", config)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok: policy program_aware; serve config with 2 worker(s) (w0, w1)")
    # The shipped example is a whole serve config too.
    result = invoke(runner, "check-config", Path(__file__).resolve().parents[2] / "configs" / "example.yaml")
    assert result.exit_code == 0 and "2 worker(s)" in result.stdout, result.output


def test_check_config_says_a_policy_only_file_is_not_enough_for_serve(runner, tmp_path):
    config = tmp_path / "policy.yaml"
    config.write_text("policy:\n  pause_threshold: 0.9\n")
    result = invoke(runner, "check-config", config)
    assert result.exit_code == 0 and result.stdout.startswith("ok: policy program_aware")
    assert "sluice serve` also needs workers:" in result.stdout


def test_check_config_reports_deeply_nested_yaml_as_an_error(runner, tmp_path):
    config = tmp_path / "deep.yaml"
    config.write_text("policy: " + "[" * 1000 + "]" * 1000 + "\n")
    assert_error(invoke(runner, "check-config", config), str(config), "nested too deeply")
    config.write_text("workers: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n")
    assert_error(invoke(runner, "check-config", config), str(config), "nested too deeply")

def test_presets_lists_every_preset(runner):
    result = invoke(runner, "presets")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()[::3]  # each preset's next two: its costs, its provenance
    table = presets()
    assert len(lines) == len(table)
    for line, (name, model) in zip(lines, table.items()):
        assert line.startswith(name)
        assert model.description in line
        assert f"{model.kv_capacity_tokens:,} tokens" in line


def test_simulator_commands_are_registered_on_the_main_app(runner):
    result = invoke(runner, "--help")
    assert result.exit_code == 0
    for command in ("sim", "replay", "sweep", "presets", "check-config"):
        assert command in result.stdout


def test_sim_config_file_sets_the_policy_thresholds(runner, tmp_path):
    config = tmp_path / "sluice.yaml"
    config.write_text("workers: []\npolicy:\n  pause_threshold: 0.05\n  pause_target: 0.01\n")
    args = ["sim", "--concurrency", 8, "--workers", 1, "--duration", 60, "--policy", "program_aware",
            "--no-ceiling"]
    defaults = json.loads(_sim_json(runner, tmp_path / "a.json", *args))["results"][0]
    tight = json.loads(_sim_json(runner, tmp_path / "b.json", *args, "--config", config))["results"][0]
    assert defaults["pauses"] == 0 and tight["pauses"] > 0


def test_sim_config_file_with_a_bad_key_exits_2_naming_it(runner, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("policy:\n  max_wait_s: -3\n")
    result = invoke(runner, "sim", "--concurrency", 2, "--workers", 1, "--duration", 10,
                    "--config", config)
    assert_error(result, f"{config}: policy.max_wait_s")


def _sim_json(runner, out, *args) -> str:
    result = invoke(runner, *args, "--json", out)
    assert result.exit_code == 0, result.output
    return out.read_text()


def test_check_config_names_a_deprecated_key_once_and_still_accepts_the_file(runner, tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("policy:\n  soft_band_penalty: -2.0\n")
    result = invoke(runner, "check-config", config)
    assert result.exit_code == 0 and result.stdout.startswith("ok: policy program_aware")
    assert result.stderr.count("soft_band_penalty is deprecated") == 1
    assert "soft_band_delay_s: 2.0" in result.stderr
