"""Request bodies checked as vLLM 0.32 checks them (simworker/validation.py) and the checks
vLLM's handlers make (simworker/calls.py), without a server. The real-vLLM comparison is
tests/e2e/test_simworker_conformance.py."""

from __future__ import annotations

import pytest

from simworker.calls import BadRequest, check_openai_preconditions, parse_params
from simworker.validation import InvalidRequest, check_media_type, parse_json, validate_body

USER = [{"role": "user", "content": "hi"}]


def test_lax_coercions_are_vllms():
    body = validate_body("chat", {"messages": USER, "max_tokens": "5", "stream": "yes", "temperature": 1,
                                  "seed": 3.0})
    assert body["max_tokens"] == 5 and body["stream"] is True and body["seed"] == 3
    assert isinstance(body["temperature"], float)


@pytest.mark.parametrize("kind, body, param, first", [
    ("chat", {"messages": USER, "max_tokens": 3.5}, "body.max_tokens", "int_from_float"),
    ("chat", {"messages": {}}, "body.messages", "list_type"),
    ("chat", {"messages": USER, "priority": 2**63}, "body.priority", "less_than_equal"),
    ("messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
     "body.messages.0.role", "literal_error"),
    ("messages", {"model": "m", "messages": USER}, "body.max_tokens", "missing"),
    ("messages", {"model": "", "max_tokens": 5, "messages": USER}, "body.model", "value_error"),
    ("responses", {"input": [{"type": "bogus"}]}, "body.input", "value_error"),
])
def test_bodies_vllm_refuses_are_named_as_vllm_names_them(kind, body, param, first):
    with pytest.raises(InvalidRequest) as caught:
        validate_body(kind, body)
    err = caught.value
    assert err.param == param
    assert str(err).startswith("1 validation error:\n  {'type': '" + first + "', 'loc': '" + param + "'")


def test_an_anthropic_system_role_anywhere_and_unknown_fields_pass():
    body = {"model": "m", "max_tokens": 5, "speed": "fast",
            "messages": [*USER, {"role": "system", "content": "reminder"}, {"role": "assistant", "content": "ok"}]}
    assert validate_body("messages", body)["speed"] == "fast"


def test_a_long_error_list_is_cut_at_ten_and_inputs_summarised():
    with pytest.raises(InvalidRequest) as caught:
        validate_body("chat", {"messages": [{"role": 5, "content": 6, "name": 7, "tool_call_id": 8}] * 3})
    text = str(caught.value)  # content 6 fails twice: neither a string nor a list
    assert text.startswith("15 validation errors:") and text.endswith("...and 5 more errors")
    assert text.count("\n  {'type'") == 10 and "'input': '6'" in text


def test_json_and_media_type_refusals():
    with pytest.raises(InvalidRequest) as caught:
        parse_json(b'{"a": }')
    assert caught.value.param == "body.6" and "json_invalid" in str(caught.value)
    check_media_type("application/json; charset=utf-8")
    with pytest.raises(InvalidRequest, match="Unsupported Media Type"):
        check_media_type("text/plain")


@pytest.mark.parametrize("body, message, param", [
    ({"messages": USER, "stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options"),
    ({"messages": USER, "tools": []},
     "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. "
     "(parameter=tools)", "tools"),
    ({"messages": USER, "tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set. "
     "(parameter=tool_choice)", "tool_choice"),
    ({"messages": USER, "cache_salt": ""},
     "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)", "cache_salt"),
])
def test_what_vllm_checks_before_the_fields(body, message, param):
    with pytest.raises(BadRequest) as caught:
        check_openai_preconditions("chat", body)
    assert (str(caught.value), caught.value.param, caught.value.error_type) == (message, param, "BadRequestError")


@pytest.mark.parametrize("kind, body, message", [
    ("chat", {"max_tokens": 0}, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    ("responses", {"max_output_tokens": 0}, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    ("chat", {"temperature": -1.0}, "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
    ("chat", {"temperature": 2.5}, "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"),
    ("chat", {"top_p": 0.0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ("chat", {"n": 0}, "n must be at least 1, got 0."),
])
def test_what_vllms_sampling_parameters_refuse(kind, body, message):
    with pytest.raises(BadRequest) as caught:
        parse_params(kind, body, {})
    assert str(caught.value) == message


def test_params_read_priority_except_on_the_anthropic_route_and_name_vllms_limit_field():
    assert parse_params("chat", {"priority": -4}, {}).priority == -4
    assert parse_params("responses", {"priority": 9}, {}).priority == 9
    messages = parse_params("messages", {"priority": 9, "max_tokens": 40}, {})
    assert messages.priority == 0 and messages.max_tokens_param == "max_completion_tokens"
    assert parse_params("chat", {"max_completion_tokens": 3}, {}).max_tokens_param == "max_completion_tokens"
    assert parse_params("completion", {}, {}).max_tokens == 16  # vLLM's completions default
    chat = parse_params("chat", {"seed": 3}, {})
    assert chat.reproducible and parse_params("chat", {"temperature": 0.0}, {}).reproducible
    assert not parse_params("chat", {"temperature": 0.7}, {}).reproducible
