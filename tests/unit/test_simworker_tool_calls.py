"""Tool-call replies (simworker/tool_calls.py): when a reply is a call, which tool, the
arguments a tool's JSON schema asks for, and vLLM's ids."""

from __future__ import annotations

import json
import re
from random import Random

import pytest

from simworker.tool_calls import (
    AUTO,
    NO_TOOL_CHOICE,
    ToolChoice,
    ToolSpec,
    plan_tool_call,
    synthesize_arguments,
)

BASH = ToolSpec("bash", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})
EDIT = ToolSpec("edit", {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 12},
        "mode": {"enum": ["replace", "append"]},
        "line": {"type": "integer", "minimum": 3, "maximum": 9},
        "ratio": {"type": "number", "minimum": 0.5, "maximum": 0.75},
        "dry_run": {"type": "boolean"},
        "options": {"type": "object", "properties": {"backup": {"type": ["boolean", "null"]},
                                                     "unused": {"type": "string"}},
                    "required": ["backup"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "target": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1, "maximum": 1}]},
        "kind": {"const": "patch"},
        "note": {"type": "string"},
    },
    "required": ["path", "mode", "line", "ratio", "dry_run", "options", "tags", "target", "kind"],
})


def test_required_properties_are_filled_by_their_schema_and_nothing_else():
    for seed in range(30):
        args = synthesize_arguments(EDIT.parameters, Random(seed))
        assert set(args) == set(EDIT.parameters["required"])  # "note" is optional
        assert isinstance(args["path"], str) and 0 < len(args["path"]) <= 12
        assert args["mode"] in ("replace", "append")
        assert isinstance(args["line"], int) and 3 <= args["line"] <= 9
        assert 0.5 <= args["ratio"] <= 0.75
        assert isinstance(args["dry_run"], bool)
        assert set(args["options"]) == {"backup"} and isinstance(args["options"]["backup"], bool)
        assert len(args["tags"]) == 2 and all(isinstance(tag, str) for tag in args["tags"])
        assert args["target"] == 1 and args["kind"] == "patch"


def test_recursive_or_odd_schemas_still_give_an_object():
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    nested = {"type": "object", "required": ["a"], "properties": {"a": recursive}}
    assert isinstance(synthesize_arguments(nested, Random(1)), dict)
    deep = {"type": "object", "required": ["x"], "properties": {}}
    for _ in range(10):
        deep = {"type": "object", "required": ["x"], "properties": {"x": deep}}
    value = synthesize_arguments(deep, Random(1))
    depth = 0
    while isinstance(value, dict) and value:
        value, depth = value["x"], depth + 1
    assert depth <= 6
    call = plan_tool_call([ToolSpec("odd", {"type": "string"})], AUTO, 0, 1, Random(1))
    assert call is not None and call.input == {} and call.arguments == "{}"


def test_strings_are_filler_that_starts_with_no_program_name():
    for seed in range(40):
        command = synthesize_arguments(BASH.parameters, Random(seed))["command"]
        assert command[0].isupper() and command.split()[0] not in ("sed", "ex")


@pytest.mark.parametrize("tools, choice, results, turns", [
    ([BASH], AUTO, 0, 0),                 # the setting is off
    ([], AUTO, 0, 3),                     # nothing offered
    ([BASH], NO_TOOL_CHOICE, 0, 3),       # tool_choice "none"
    ([BASH], AUTO, 3, 3),                 # K results in the conversation already
    ([BASH], ToolChoice("named", "edit"), 0, 3),  # the named tool is not offered
])
def test_no_tool_call_when(tools, choice, results, turns):
    assert plan_tool_call(tools, choice, results, turns, Random(0)) is None


def test_a_call_is_made_below_k_results_with_vllms_ids_each_unique():
    calls = [plan_tool_call([BASH, EDIT], AUTO, results, 3, Random(7)) for results in (0, 1, 2)]
    assert all(call is not None for call in calls)
    for call in calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call.call_id)
        assert re.fullmatch(r"fc_[0-9a-f]{16}", call.item_id)
        assert json.loads(call.arguments) == call.input and not call.named
    assert len({call.call_id for call in calls}) == 3  # the same seed, still fresh ids


def test_the_pick_follows_the_random_source_and_a_named_choice():
    picks = {plan_tool_call([BASH, EDIT], AUTO, 0, 1, Random(seed)).name for seed in range(40)}
    assert picks == {"bash", "edit"}
    same = [plan_tool_call([BASH, EDIT], AUTO, 0, 1, Random(5)) for _ in range(2)]
    assert same[0].name == same[1].name and same[0].arguments == same[1].arguments
    named = plan_tool_call([BASH, EDIT], ToolChoice("named", "edit"), 0, 1, Random(0))
    assert named.name == "edit" and named.named
    required = plan_tool_call([BASH], ToolChoice("required"), 0, 1, Random(0))
    assert required.name == "bash" and not required.named
