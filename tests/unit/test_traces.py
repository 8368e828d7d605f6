"""Trace loaders (sim/traces/): valid fixtures, session inference, exact error locations.

Every fixture is written by the test into ``tmp_path``; nothing here reads data from outside the repository.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sim.programs import ProgramSpec
from sim.traces import (
    TraceError,
    load_dynamo,
    load_kvtester,
    load_mooncake,
    load_sluice,
    load_trace,
)


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def by_id(programs: list[ProgramSpec]) -> dict[str, ProgramSpec]:
    return {p.session_id: p for p in programs}


def mc(ts: int, n_in: int, n_out: int, hashes: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": hashes}


# -- TraceError ----------------------------------------------------------------------------


def test_trace_error_is_a_value_error_naming_path_line_and_problem():
    e = TraceError("/x/t.jsonl", 7, "bad thing")
    assert isinstance(e, ValueError)
    assert str(e) == "/x/t.jsonl:7: bad thing"
    assert (e.path, e.line, e.problem) == ("/x/t.jsonl", 7, "bad thing")


# -- Mooncake ------------------------------------------------------------------------------

# Block 0 is a system prompt followed by ≥ 4 different next blocks (common). Two
# conversations A and B interleave; C and D share only the system prompt; E rewrites the
# tail of its history (3 of 4 full blocks kept).
A1 = mc(0, 1300, 100, [0, 1, 2])  # full blocks 0, 1; block 2 partial
B1 = mc(0, 1800, 50, [0, 10, 11, 12])
C1 = mc(1000, 1500, 30, [0, 20, 21])
A2 = mc(5000, 2400, 80, [0, 1, 3, 4, 5])  # extends A1: 0, 1, then the filled block 3
B2 = mc(6000, 2300, 60, [0, 10, 11, 13, 14])
D1 = mc(7000, 600, 0, [0, 30])  # output 0 → replayed as 1
A3 = mc(9000, 2900, 70, [0, 1, 3, 4, 6, 7])
B3 = mc(9500, 3000, 20, [0, 10, 11, 13, 15, 16])
E1 = mc(10000, 2100, 10, [0, 40, 41, 42, 43])
E2 = mc(12000, 2600, 10, [0, 40, 41, 44, 45, 46])  # diverges after 3 of E1's 4 full blocks


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "mc.jsonl", [A1, B1, C1, A2, B2, D1, A3, B3, E1, E2])


def _inputs(p: ProgramSpec) -> list[int]:
    return [c.prompt_tokens for c in p.calls]


def test_mooncake_infers_two_interleaved_conversations(mooncake_file):
    programs, block_size = load_mooncake(mooncake_file)
    assert block_size == 512
    assert [_inputs(p) for p in programs] == [
        [1300, 2400, 2900],  # A
        [1800, 2300, 3000],  # B
        [1500],  # C: only the system prompt in common
        [600],  # D
        [2100, 2600],  # E: a rewritten tail still continues the conversation
    ]
    assert [p.session_id for p in programs] == [f"mooncake-{i}" for i in range(5)]
    assert [p.index for p in programs] == list(range(5))
    a, b = programs[0], programs[1]
    assert [c.at for c in a.calls] == [0.0, 5.0, 9.0]
    assert [c.at for c in b.calls] == [0.0, 6.0, 9.5]
    assert all(c.think_s == 0.0 for p in programs for c in p.calls)
    assert programs[2].start_at == 1.0 and programs[4].start_at == 10.0
    # explicit hashes: the prompt's full blocks only (the partial last id is dropped)
    assert [c.hashes for c in a.calls] == [(0, 1), (0, 1, 3, 4), (0, 1, 3, 4, 6)]
    assert programs[3].calls[0].output_tokens == 1
    assert programs[3].calls[0].hashes == (0,)


def test_mooncake_min_overlap_one_splits_a_rewritten_history(mooncake_file):
    programs, _ = load_mooncake(mooncake_file, min_overlap=1.0)
    assert [_inputs(p) for p in programs][-2:] == [[2100], [2600]]


def test_mooncake_without_a_common_prefix_chains_on_the_first_block(tmp_path):
    # with only two branches after block 0, block 0 is not common: sharing it links B to A
    # only if B extends A's whole prompt — here it does not, so they stay apart
    path = write_jsonl(tmp_path / "t.jsonl", [A1, B1, A2])
    programs, _ = load_mooncake(path)
    assert [_inputs(p) for p in programs] == [[1300, 2400], [1800]]


def test_mooncake_max_gap_ends_idle_sessions(mooncake_file):
    programs, _ = load_mooncake(mooncake_file, max_gap_s=4.0)
    # A2 comes 5 s after A1, B2 6 s after B1: both start new sessions; A3 is 4 s after A2
    assert [_inputs(p) for p in programs][:4] == [[1300], [1800], [1500], [2400, 2900]]


def test_mooncake_picks_the_session_whose_prompt_it_extends_over_a_longer_partial_match(
        tmp_path):
    rows = [
        mc(0, 600, 1, [0, 90]), mc(0, 600, 1, [0, 91]), mc(0, 600, 1, [0, 92]),  # 0 common
        mc(0, 5000, 10, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # X: 9 full blocks
        mc(1000, 1600, 10, [0, 1, 2, 50]),  # Y: shares 3 blocks with X, 3 full: a branch
        mc(2000, 2100, 10, [0, 1, 2, 51, 52]),  # extends Y (0,1,2 — Y's full blocks)
    ]
    programs, _ = load_mooncake(write_jsonl(tmp_path / "t.jsonl", rows))
    sizes = sorted(_inputs(p) for p in programs)
    assert [5000] in sizes and [1600, 2100] in sizes


def test_mooncake_skips_blank_lines_and_accepts_integral_floats(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(mc(0, 1300, 1, [0, 1, 2])) + "\n\n   \n"
                    + json.dumps({"timestamp": 10.0, "input_length": 600.0,
                                  "output_length": 3, "hash_ids": [5, 6]}) + "\n")
    programs, _ = load_mooncake(path)
    assert sum(len(p.calls) for p in programs) == 2


@pytest.mark.parametrize(
    ("rows", "line", "fragment"),
    [
        ([mc(0, 100, 1, [0]), mc(1, 100, 1, [1]), '{"timestamp": 2, "input_'], 3,
         "invalid JSON"),
        ([mc(0, 100, 1, [0]), {"timestamp": 1, "input_length": 5, "output_length": 1}], 2,
         "missing key 'hash_ids'"),
        ([mc(0, 100, -3, [0])], 1, "output_length must be ≥ 0, got -3"),
        ([mc(0, 100, 1, [0]), mc(0, -100, 1, [0])], 2, "input_length must be > 0, got -100"),
        ([mc(0, 0, 1, [])], 1, "input_length must be > 0, got 0"),
        ([mc(0, 100, 1, [0]), mc(5, 100, 1, [0, "x"])], 2,
         "hash_ids[1] must be an integer, got 'x'"),
        ([mc(0, 100, 1, [0]), mc(5, 100, 1, [0, True])], 2, "hash_ids[1] must be an integer"),
        ([mc(0, 100, 1, 7)], 1, "hash_ids must be a list of integers, got int"),
        ([mc(0, 1024, 1, [0, 1, 2])], 1,
         "input_length 1024 is smaller than what hash_ids cover"),
        ([mc(0, 100, 1, [0]), mc(0, 100, 1.5, [0])], 2, "output_length must be an integer"),
        ([mc(0, 100, 1, [0]), mc(0, True, 1, [0])], 2, "input_length must be an integer"),
        ([mc(0, 100, 1, [0]), "[1, 2]"], 2, "expected a JSON object, got list"),
        ([mc(-5, 100, 1, [0])], 1, "timestamp must be ≥ 0"),
        ([mc(0, 100, 1, [0]), mc("soon", 100, 1, [0])], 2, "timestamp must be a finite number"),
        ([mc(10, 100, 1, [0]), mc(20, 100, 1, [1]), mc(15, 100, 1, [2])], 3,
         "earlier than the previous request's 20"),
    ],
)
def test_mooncake_rejects_malformed_lines_with_the_exact_line(tmp_path, rows, line, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    assert info.value.line == line
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert fragment in str(info.value)


def test_mooncake_line_numbers_count_blank_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(mc(0, 100, 1, [0])) + "\n\n" + "{oops\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:3: invalid JSON"):
        load_mooncake(path)


def test_mooncake_hash_ids_may_cover_fewer_blocks_than_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [mc(0, 3000, 1, [0, 1])])
    (p,), _ = load_mooncake(path)
    assert p.calls[0].hashes == (0, 1)
    assert len(p.call_hashes(0, 512)) == 3000 // 512  # the rest are the call's own


def test_mooncake_twelve_thousand_interleaved_lines_load_as_three_thousand_conversations(tmp_path):
    rows = []
    for conv in range(3000):  # 3,000 conversations × 4 turns, interleaved in time
        base = 1 + conv * 100
        for turn in range(4):
            full = 4 + 3 * turn
            hashes = [0] + [base + j for j in range(full)] + [base + 90 + turn]
            rows.append((turn * 60_000 + conv, mc(turn * 60_000 + conv,
                                                  (full + 1) * 512 + 100, 200, hashes)))
    rows.sort(key=lambda r: r[0])
    path = write_jsonl(tmp_path / "big.jsonl", [r for _, r in rows])
    programs, _ = load_mooncake(path)  # its speed: `make bench` (sim_mooncake_conversation_s)
    assert len(programs) == 3000 and all(len(p.calls) == 4 for p in programs)


# -- kv-cache-tester -----------------------------------------------------------------------


def conversation(cid: str = "conv1", **extra) -> dict:
    doc = {
        "id": cid,
        "models": ["m"],
        "block_size": 64,
        "tool_tokens": 120,
        "system_tokens": 40,
        "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 200, "out": 50, "hash_ids": [1, 2, 3, 4],
             "input_types": ["text"], "output_types": ["text"], "stop": "tool_use",
             "api_time": 2.0, "think_time": 0.0},
            # no api_time / ttft: optional
            {"t": 5.0, "type": "n", "in": 300, "out": 20, "hash_ids": [1, 2, 3, 5, 6],
             "think_time": 1.5, "stop": "tool_use"},
            {"type": "subagent", "id": "agentX", "requests": [
                {"t": 6.0, "type": "n", "in": 150, "out": 30, "hash_ids": [1, 2, 7],
                 "think_time": 0.0},
                {"t": 9.0, "type": "s", "in": 260, "out": 10, "hash_ids": [1, 2, 7, 8, 9],
                 "think_time": 0.5},
            ]},
            {"type": "subagent", "requests": [
                {"t": 7.0, "type": "n", "in": 64, "out": 0, "hash_ids": [1]},
            ]},
            {"t": 12.0, "type": "s", "in": 400, "out": 40, "hash_ids": [1, 2, 3, 5, 10, 11, 12],
             "think_time": 2.0, "ttft": 0.3, "stop": "end_turn"},
        ],
    }
    doc.update(extra)
    return doc


def write_json(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_kvtester_loads_a_conversation_with_subagents(tmp_path):
    programs, block_size = load_kvtester(write_json(tmp_path / "c.json", conversation()),
                                         timing="recorded", warm_prefix_fraction=0.0)
    assert block_size == 64
    assert [p.session_id for p in programs] == ["conv1", "conv1/agentX", "conv1/sa2"]
    assert [p.index for p in programs] == [0, 1, 2]
    main, sub, sub2 = programs
    assert main.parent_session_id is None
    assert sub.parent_session_id == "conv1" and sub2.parent_session_id == "conv1"
    assert [(c.prompt_tokens, c.output_tokens, c.at, c.think_s) for c in main.calls] == [
        (200, 50, 0.0, 0.0), (300, 20, 5.0, 1.5), (400, 40, 12.0, 2.0)]
    assert [c.hashes for c in main.calls] == [(1, 2, 3), (1, 2, 3, 5), (1, 2, 3, 5, 10, 11)]
    assert sub.start_at == 6.0
    assert [(c.prompt_tokens, c.at, c.think_s, c.hashes) for c in sub.calls] == [
        (150, 6.0, 0.0, (1, 2)), (260, 9.0, 0.5, (1, 2, 7, 8))]
    assert sub2.calls[0].output_tokens == 1 and sub2.calls[0].think_s == 0.0
    assert sub2.calls[0].hashes == (1,)


def test_kvtester_nested_subagents_get_their_enclosing_session_as_parent(tmp_path):
    doc = conversation()
    doc["requests"][2]["requests"].append(
        {"type": "subagent", "agent_id": "deep", "requests": [
            {"t": 9.5, "in": 100, "out": 5, "hash_ids": [1, 2]}]})
    programs, _ = load_kvtester(write_json(tmp_path / "c.json", doc))
    assert by_id(programs)["conv1/agentX/deep"].parent_session_id == "conv1/agentX"


def test_kvtester_directory_and_local_scope_namespaces(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    for name, extra in (("a", {"hash_id_scope": "local"}), ("b", {"hash_id_scope": "local"}),
                        ("c", {})):  # c: global scope (the default), ids kept
        doc = conversation(name, **extra)
        doc["requests"] = doc["requests"][:2]
        write_json(d / f"{name}.json", doc)
    (d / "notes.txt").write_text("not a trace")
    programs, block_size = load_kvtester(d, warm_prefix_fraction=0.0)
    assert block_size == 64
    progs = by_id(programs)
    assert set(progs) == {"a", "b", "c"}
    ha, hb, hc = (progs[n].calls[1].hashes for n in "abc")
    assert hc == (1, 2, 3, 5)
    assert len(ha) == len(hb) == 4
    assert not set(ha) & set(hb)  # local ids of different files never collide
    assert not set(ha) & set(hc)
    assert ha[:3] == progs["a"].calls[0].hashes  # within a file the prefix is still shared


def test_kvtester_subagent_ids_are_scoped_by_conversation_but_conversation_ids_must_be_unique(
        tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    write_json(d / "a.json", conversation("a"))
    write_json(d / "b.json", conversation("b"))  # both hold a sub-agent "agentX"
    programs, _ = load_kvtester(d)
    assert {"a/agentX", "b/agentX"} <= set(by_id(programs))
    write_json(d / "c.json", conversation("a"))
    with pytest.raises(TraceError, match=r"c\.json:id: session id 'a' is used"):
        load_kvtester(d)


def test_kvtester_json_list_of_conversations(tmp_path):
    first = conversation("one")
    second = conversation("two")
    second["requests"] = second["requests"][:2]
    programs, _ = load_kvtester(write_json(tmp_path / "many.json", [second, first]))
    assert [p.session_id for p in programs][:2] == ["two", "one"]  # both start at t = 0
    assert by_id(programs)["one/agentX"].parent_session_id == "one"


def test_kvtester_conversation_id_defaults_to_the_file_name(tmp_path):
    doc = conversation()
    del doc["id"]
    doc["requests"] = doc["requests"][:2]
    programs, _ = load_kvtester(write_json(tmp_path / "trace_0042.json", doc))
    assert [p.session_id for p in programs] == ["trace_0042"]


def test_kvtester_block_sizes_must_agree_across_files(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    write_json(d / "a.json", conversation("a"))
    other = conversation("b", block_size=32)
    other["requests"] = other["requests"][:1]
    write_json(d / "b.json", other)
    with pytest.raises(TraceError, match=r"b\.json:block_size: block_size 32 differs from 64"):
        load_kvtester(d)


def _kv_error(tmp_path: Path, doc) -> TraceError:
    path = write_json(tmp_path / "bad.json", doc)
    with pytest.raises(TraceError) as info:
        load_kvtester(path)
    assert str(info.value).startswith(f"{path}:")
    return info.value


def test_kvtester_errors_name_the_json_path(tmp_path):
    doc = conversation()
    doc["requests"][1]["in"] = -5
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[1].in" and "in must be > 0, got -5" in e.problem

    doc = conversation()
    del doc["requests"][0]["hash_ids"]
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[0].hash_ids" and e.problem == "missing key 'hash_ids'"

    doc = conversation()
    doc["requests"][2]["requests"][1]["out"] = "many"
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[2].requests[1].out"

    doc = conversation()
    doc["requests"][0]["hash_ids"] = [1, 2.5, 3]
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[0].hash_ids[1]"

    doc = conversation()
    doc["requests"][1]["t"] = -1.0
    assert _kv_error(tmp_path, doc).line == "requests[1].t"

    doc = conversation()
    doc["requests"][4]["t"] = 1.0  # before the previous request at t = 5
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[4].t" and "earlier than the previous" in e.problem

    doc = conversation()
    doc["requests"][0]["in"] = 64  # 4 hash ids need more than 3 × 64 tokens
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[0].in" and "smaller than what hash_ids cover" in e.problem

    doc = conversation()
    del doc["block_size"]
    assert _kv_error(tmp_path, doc).line == "block_size"

    doc = conversation()
    del doc["requests"][2]["requests"]
    e = _kv_error(tmp_path, doc)
    assert e.line == "requests[2]" and "subagent" in e.problem

    doc = conversation()
    doc["requests"][3] = "oops"
    assert _kv_error(tmp_path, doc).line == "requests[3]"

    doc = conversation(hash_id_scope="galactic")
    assert _kv_error(tmp_path, doc).line == "hash_id_scope"

    e = _kv_error(tmp_path, [conversation("x"), {"block_size": 64, "requests": [
        {"t": 0, "in": 10, "out": 1, "hash_ids": [1], "think_time": -2}]}])
    assert e.line == "[1].requests[0].think_time"


def test_kvtester_invalid_json_reports_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "block_size": 64,\n  "requests": [,]\n}\n')
    with pytest.raises(TraceError) as info:
        load_kvtester(path)
    assert info.value.line == 3 and "invalid JSON" in info.value.problem


def test_kvtester_empty_directory_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="no \\*.json files"):
        load_kvtester(tmp_path)


# -- Dynamo / Sluice request records -------------------------------------------------------

T0 = 1_700_000_000_000


def dyn(session: str | None, received: int, total: float | None, n_in: int, n_out: int,
        hashes: list[int] | None = None, parent: str | None = None, block: int = 64,
        schema: str = "dynamo.request.trace.v1", rid: str = "r") -> dict:
    request: dict = {"request_id": rid, "model": "m", "input_tokens": n_in,
                     "output_tokens": n_out, "request_received_ms": received}
    if total is not None:
        request["total_time_ms"] = total
    if hashes is not None:
        request["replay"] = {"trace_block_size": block, "input_length": n_in,
                             "input_sequence_hashes": hashes}
    rec: dict = {"schema": schema, "event_type": "request_end",
                 "event_time_unix_ms": received + (total or 0), "request": request}
    if session is not None:
        rec["agent_context"] = {"session_id": session, "trajectory_id": session}
        if parent is not None:
            rec["agent_context"]["parent_session_id"] = parent
    return rec


def dynamo_rows() -> list:
    return [
        {"event_type": "request_payload", "request_id": "ignored"},  # not request_end
        # end order: s2's request ended before s1's second one
        dyn("s2", T0 + 1500, 500.0, 64, 5, [11], parent="s1", rid="b"),
        dyn("s1", T0 + 4000, 1000.0, 200, 8, [11, 22, 33], rid="c"),
        dyn("s1", T0, 2000.0, 128, 10, [11, 22], rid="a"),
    ]


def test_dynamo_loads_sessions_with_their_own_timing(tmp_path):
    programs, block_size = load_dynamo(write_jsonl(tmp_path / "d.jsonl", dynamo_rows()))
    assert block_size == 64
    assert [p.session_id for p in programs] == ["s1", "s2"]
    s1, s2 = programs
    assert [(c.prompt_tokens, c.output_tokens, c.at, c.think_s, c.hashes) for c in s1.calls] == [
        (128, 10, 0.0, 0.0, (11, 22)), (200, 8, 4.0, 2.0, (11, 22, 33))]
    assert s2.parent_session_id == "s1" and s2.start_at == 1.5
    assert s2.calls[0].hashes == (11,)


def test_dynamo_reads_gzip(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for r in dynamo_rows():
            f.write(json.dumps(r) + "\n")
    programs, _ = load_dynamo(path)
    assert [len(p.calls) for p in programs] == [2, 1]


def test_sluice_records_use_the_same_parser_and_both_schemas(tmp_path):
    rows = [dyn("s", T0, 100.0, 128, 4, [1, 2], schema="sluice.request.v1"),
            dyn("s", T0 + 1000, 100.0, 192, 4, [1, 2, 3])]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    for loader in (load_sluice, load_dynamo):
        programs, bs = loader(path)
        assert bs == 64 and [len(p.calls) for p in programs] == [2]
        assert programs[0].calls[1].think_s == pytest.approx(0.9)


def test_dynamo_without_replay_hashes_synthesizes_an_append_only_context(tmp_path):
    rows = [dyn("a", T0, 100.0, 100, 4), dyn("a", T0 + 1000, 100.0, 180, 4),
            dyn("b", T0 + 10, None, 50, 2), dyn(None, T0 + 20, 5.0, 40, 1, rid="lonely")]
    programs, bs = load_dynamo(write_jsonl(tmp_path / "d.jsonl", rows))
    assert bs == 16  # the default: no record names a block size
    progs = by_id(programs)
    a = progs["a"]
    assert len(a.calls[0].hashes) == 100 // 16 and len(a.calls[1].hashes) == 180 // 16
    assert a.calls[1].hashes[: len(a.calls[0].hashes)] == a.calls[0].hashes
    assert not set(progs["b"].calls[0].hashes) & set(a.calls[1].hashes)
    assert "request:lonely" in progs
    # without total_time_ms the end comes from event_time_unix_ms
    assert progs["b"].calls[0].think_s == 0.0


def test_dynamo_default_block_size_option(tmp_path):
    rows = [dyn("a", T0, 100.0, 100, 4)]
    _, bs = load_dynamo(write_jsonl(tmp_path / "d.jsonl", rows), default_block_size=32)
    assert bs == 32


@pytest.mark.parametrize(
    ("rows", "line", "fragment"),
    [
        ([dyn("s", T0, 1.0, 10, 1), dyn("s", T0 + 1, 1.0, 10, 1, schema="other.v9")], 2,
         "schema 'other.v9' is not one of"),
        ([{"event_type": "request_end", "request": {}}], 1, "missing key 'schema'"),
        ([dyn("s", T0, 1.0, 10, 1), dyn("s", T0, 1.0, 10, 1), "{not json"], 3, "invalid JSON"),
        ([{"schema": "dynamo.request.trace.v1", "event_type": "request_end",
           "request": {"input_tokens": 5, "request_received_ms": T0}}], 1,
         "missing key 'request.output_tokens'"),
        ([{"schema": "dynamo.request.trace.v1", "event_type": "request_end",
           "request": {"output_tokens": 5, "request_received_ms": T0}}], 1,
         "missing key 'request.input_tokens'"),
        ([dyn("s", T0, 1.0, 10, 1), dyn("s", T0, 1.0, -10, 1)], 2,
         "request.input_tokens must be > 0, got -10"),
        ([dyn("s", T0, 1.0, 10, -1)], 1, "request.output_tokens must be ≥ 0"),
        ([dyn("s", T0, -1.0, 10, 1)], 1, "request.total_time_ms must be ≥ 0"),
        ([dyn("s", T0, 1.0, 128, 1, [1, 2]), dyn("s", T0, 1.0, 128, 1, [1, 2], block=32)], 2,
         "request.replay.trace_block_size 32 differs from 64 (line 1)"),
        ([dyn("s", T0, 1.0, 128, 1, [1, "2"])], 1,
         "request.replay.input_sequence_hashes[1] must be an integer"),
        ([dyn("s", T0, 1.0, 64, 1, [1, 2, 3])], 1, "smaller than what"),
        ([dyn(None, T0, 1.0, 10, 1) | {"agent_context": {"session_id": 5}}], 1,
         "agent_context.session_id must be a non-empty string"),
        ([dyn("s", T0, 1.0, 10, 1, parent="p"), dyn("s", T0 + 5, 1.0, 10, 1, parent="q")], 2,
         "session 's' has parent 'q' here but 'p' before"),
        (["[]"], 1, "expected a JSON object, got list"),
    ],
)
def test_dynamo_rejects_malformed_records_with_the_exact_line(tmp_path, rows, line, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as info:
        load_dynamo(path)
    assert info.value.line == line
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert fragment in info.value.problem


# -- dispatch ------------------------------------------------------------------------------


def test_load_trace_dispatches_on_the_format(tmp_path, mooncake_file):
    programs, bs = load_trace("mooncake", mooncake_file)
    assert bs == 512 and len(programs) == 5
    kv = write_json(tmp_path / "c.json", conversation())
    assert load_trace("kvtester", kv)[1] == 64
    d = write_jsonl(tmp_path / "d.jsonl", dynamo_rows())
    assert [p.session_id for p in load_trace("dynamo", d)[0]] == ["s1", "s2"]
    assert [p.session_id for p in load_trace("sluice", d)[0]] == ["s1", "s2"]
    assert load_trace("mooncake", mooncake_file, min_overlap=1.0)[0][-1].calls[0].prompt_tokens \
        == 2600
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        load_trace("csv", mooncake_file)


def test_kvtester_missing_think_time_falls_back_to_the_recorded_gap(tmp_path):
    # trace_replay_tester.md, "Timing Strategies": every strategy falls back to
    # `original` (t[N] − t[N−1]) when the timing fields are absent; api_time is not used
    doc = {"id": "c", "block_size": 64, "requests": [
        {"t": 0.0, "in": 100, "out": 5, "hash_ids": [1, 2], "api_time": 2.0},
        {"t": 5.0, "in": 150, "out": 5, "hash_ids": [1, 3, 4]},  # 5 − 0
        {"t": 9.0, "in": 200, "out": 5, "hash_ids": [1, 3, 5, 6], "think_time": None},  # 9 − 5
        {"t": 12.0, "in": 250, "out": 5, "hash_ids": [1, 3, 5, 7], "think_time": 0.25},
    ]}
    (p,), _ = load_kvtester(write_json(tmp_path / "c.json", doc))
    assert [c.think_s for c in p.calls] == [0.0, 5.0, 4.0, 0.25]


# kv-cache-tester semantics (docs/trace_replay_tester.md: "Trace Format", "Timing
# Strategies", "Sub-Agent Handling", "Cross-Conversation Cache Sharing"; trace_replay_tester.py
# counts a sub-agent's nested `t` from the sub-agent entry's `t`).


def kv_request(t: float, n_in: int, hashes: list[int], **extra) -> dict:
    return {"t": t, "type": "s", "in": n_in, "out": 4, "hash_ids": hashes, **extra}


def agent_conversation(**extra) -> dict:
    """A parent that starts two sub-agents at once (one of which starts its own), then
    resumes; a last sub-agent nobody waits for."""
    return {"id": "p", "block_size": 4, **extra, "requests": [
        kv_request(0.0, 9, [1, 2, 3], think_time=0.0),
        kv_request(2.0, 13, [1, 2, 3, 4], think_time=0.5),
        {"type": "subagent", "agent_id": "a", "t": 10.0, "requests": [
            kv_request(0.0, 9, [20, 21, 22]),
            {"type": "subagent", "agent_id": "deep", "t": 1.0, "requests": [
                kv_request(0.5, 9, [30, 31, 32])]},
            kv_request(3.0, 13, [20, 21, 22, 23], think_time=0.25),
        ]},
        {"type": "subagent", "agent_id": "b", "t": 10.5, "requests": [
            kv_request(1.0, 9, [40, 41, 42])]},
        kv_request(30.0, 17, [1, 2, 3, 4, 5], think_time=2.0),
        {"type": "subagent", "agent_id": "last", "t": 31.0, "requests": [
            kv_request(0.0, 9, [50, 51, 52])]},
    ]}


def test_kvtester_subagent_times_count_from_the_entrys_t(tmp_path):
    programs, _ = load_kvtester(write_json(tmp_path / "c.json", agent_conversation()),
                                timing="recorded")
    progs = by_id(programs)
    assert [c.at for c in progs["p"].calls] == [0.0, 2.0, 30.0]
    assert [c.at for c in progs["p/a"].calls] == [10.0, 13.0]  # 10 + 0, 10 + 3
    assert [c.at for c in progs["p/a/deep"].calls] == [11.5]  # 10 + 1 + 0.5
    assert [c.at for c in progs["p/b"].calls] == [11.5]  # 10.5 + 1
    assert progs["p/a"].start_at == 10.0 and progs["p/a/deep"].start_at == 11.5
    assert [p.session_id for p in programs] == ["p", "p/a", "p/a/deep", "p/b", "p/last"]


def test_kvtester_parent_waits_for_the_subagents_it_started(tmp_path):
    programs, _ = load_kvtester(write_json(tmp_path / "c.json", agent_conversation()))
    progs = by_id(programs)
    # a and b are started together once the parent's first two calls have completed, and
    # its third call waits for both; `last` comes after its last call: nobody waits for it
    assert progs["p"].waits_for == {2: ("p/a", "p/b")}
    assert [(progs[s].parent_session_id, progs[s].spawn_after_calls)
            for s in ("p/a", "p/b", "p/last")] == [("p", 2), ("p", 2), ("p", 3)]
    # nested: a starts deep after its own first call and waits for it before its second
    assert progs["p/a"].waits_for == {1: ("p/a/deep",)}
    assert (progs["p/a/deep"].parent_session_id, progs["p/a/deep"].spawn_after_calls) == ("p/a", 1)
    assert progs["p"].spawn_after_calls is None and progs["p/b"].waits_for == {}


def test_kvtester_subagent_entry_without_requests_of_its_own_is_transparent(tmp_path):
    doc = {"id": "p", "block_size": 4, "requests": [
        kv_request(0.0, 9, [1, 2, 3]),
        {"type": "subagent", "agent_id": "hub", "t": 1.0, "requests": [
            {"type": "subagent", "agent_id": "x", "requests": [kv_request(0.0, 9, [5, 6, 7])]},
            {"type": "subagent", "agent_id": "y", "requests": [kv_request(0.0, 9, [8, 9, 10])]},
        ]},
        kv_request(5.0, 13, [1, 2, 3, 4]),
    ]}
    programs, _ = load_kvtester(write_json(tmp_path / "c.json", doc))
    progs = by_id(programs)
    assert "p/hub" not in progs
    assert progs["p"].waits_for == {1: ("p/hub/x", "p/hub/y")}
    assert all((progs[s].parent_session_id, progs[s].spawn_after_calls) == ("p", 1)
               for s in ("p/hub/x", "p/hub/y"))


def test_kvtester_think_timing_sends_requests_think_time_after_the_previous_response(tmp_path):
    path = write_json(tmp_path / "c.json", agent_conversation())
    think = by_id(load_kvtester(path)[0])  # the default, as in kv-cache-tester
    recorded = by_id(load_kvtester(path, timing="recorded")[0])
    # think: no arrival times; a session's first request goes as it starts, later ones
    # think_time after the previous response — or, without one, the gap since the previous
    # entry's t (the parent's third request: 30 − 10.5, the last sub-agent entry's t)
    assert all(c.at is None for p in think.values() for c in p.calls)
    assert [c.think_s for c in think["p"].calls] == [0.0, 0.5, 2.0]
    assert [c.think_s for c in think["p/a"].calls] == [0.0, 0.25]
    doc = agent_conversation()
    del doc["requests"][4]["think_time"]
    fallback = by_id(load_kvtester(write_json(tmp_path / "c2.json", doc))[0])
    assert [c.think_s for c in fallback["p"].calls] == [0.0, 0.5, 19.5]
    # recorded: the same calls, with their recorded arrival times
    assert [c.at for c in recorded["p"].calls] == [0.0, 2.0, 30.0]
    assert [c.think_s for c in recorded["p"].calls] == [0.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="timing must be one of think, recorded"):
        load_kvtester(path, timing="original")


def test_kvtester_warm_prefix_is_shared_by_every_session(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    # the largest tool + system prefix is 20 tokens: half of it, 10 tokens, is warm, i.e.
    # the first 2 blocks of 4 tokens of every session's prompts
    write_json(d / "a.json", agent_conversation(tool_tokens=12, system_tokens=8))
    other = {"id": "q", "block_size": 4, "tool_tokens": 6, "requests": [
        kv_request(0.0, 13, [90, 91, 92, 93]),
        kv_request(1.0, 17, [90, 91, 92, 93, 94]),
        kv_request(2.0, 17, [95, 96, 97, 98, 99]),  # rewrote its history from block 0
    ]}
    write_json(d / "b.json", other)
    progs = by_id(load_kvtester(d)[0])
    warm = progs["p"].calls[0].hashes[:2]
    assert len(set(warm)) == 2 and not set(warm) & {1, 2, 3, 90, 91}
    for session in ("p", "p/a", "p/a/deep", "p/b", "p/last", "q"):
        spec = progs[session]
        assert spec.calls[0].hashes[:2] == warm, session
        assert (spec.family, spec.shared_prefix_tokens) == (0, 8)
    # later prompts keep it while they keep the first prompt's leading blocks
    assert progs["p"].calls[2].hashes == (*warm, 3, 4)
    assert progs["q"].calls[1].hashes == (*warm, 92, 93)
    assert progs["q"].calls[2].hashes == (95, 96, 97, 98)
    # 0 turns it off; without tool_tokens / system_tokens there is nothing to share
    assert by_id(load_kvtester(d, warm_prefix_fraction=0.0)[0])["q"].calls[0].hashes == \
        (90, 91, 92)
    alone = by_id(load_kvtester(d / "a.json", warm_prefix_fraction=1.0)[0])
    assert alone["p/b"].calls[0].hashes[:2] == alone["p"].calls[0].hashes[:2]
    plain = agent_conversation()
    assert by_id(load_kvtester(write_json(tmp_path / "plain.json", plain))[0])["p/b"] \
        .calls[0].hashes == (40, 41)
    with pytest.raises(ValueError, match="warm_prefix_fraction"):
        load_kvtester(d, warm_prefix_fraction=1.5)


def test_kvtester_rejects_a_negative_tool_or_system_token_count(tmp_path):
    e = _kv_error(tmp_path, agent_conversation(tool_tokens=-1))
    assert e.line == "tool_tokens" and "must be ≥ 0" in e.problem
