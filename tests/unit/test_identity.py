"""Request identity (architecture.md §5.2 "Identity", §2 "Coordinates"): session sources in order,
parents, the final flag, id validation, the body to forward, the minted chain and token
estimates, malformed shapes."""

from __future__ import annotations

import ast
import copy
import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers

import controller.identity as identity_module
import controller.prompt as prompt_module
import scheduler.coordinates as coordinates
from controller.conversations import Answer, AnswerKey, answer_fingerprint
from controller.identity import (
    Identity,
    IdentityError,
    resolve_identity,
)
from controller.prompt import estimate_tokens
from scheduler.calls import CallHints
from scheduler.coordinates import SessionId, canonical, mint_chain

from tests.support.chat_messages import ASSISTANT, SYSTEM, TOOL, TOOLS, USER

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
CONTENT_ID = re.compile(r"c-[0-9a-f]{32}")



def chat_body(*messages, **extra):
    body = {"model": "qwen3-8b", "messages": list(messages or (SYSTEM, USER))}
    body.update(extra)
    return body


def resolve(headers=None, body=None, route=CHAT, lookup=None):
    args = (route, headers or {}, chat_body() if body is None else body)
    if lookup is None:
        return resolve_identity(*args)
    return resolve_identity(*args, lookup_response=lookup)


# -- every source, in order ------------------------------------------------------------------

# (kind, name, value as carried, expected session id, expected source); a body name with dots
# is a path into nested objects. The order is identity.SOURCE_ORDER's.
SOURCES = [
    ("body", "vllm_xargs.agentic_context.program_id", "ac-1", "ac-1",
     "body.vllm_xargs.agentic_context"),
    ("body", "nvext.agent_context.trajectory_id", "traj-1", "traj-1", "body.nvext.agent_context"),
    ("body", "agent_hint.session_id", "hint-1", "hint-1", "body.agent_hint"),
    ("header", "x-dynamo-session-id", "dyn-1", "dyn-1", "x-dynamo-session-id"),
    ("header", "x-claude-code-session-id", "cc-1", "cc-1", "x-claude-code-session-id"),
    ("header", "session-id", "oc-1", "oc-1", "session-id"),
    ("header", "thread-id", "codex-1", "codex-1", "thread-id"),
    ("header", "x-session-id", "xs-1", "xs-1", "x-session-id"),
    ("body", "session_id", "bs-1", "bs-1", "body.session_id"),
    ("body", "program_id", "prog-1", "prog-1", "body.program_id"),
    ("body", "metadata.user_id", "user-1", "user-1", "body.metadata.user_id"),
    ("body", "prompt_cache_key", "pck-1", "pck-1", "body.prompt_cache_key"),
    ("body", "previous_response_id", "resp_1", "from-resp-1", "body.previous_response_id"),
    ("body", "conversation", "conv_1", "conv_1", "body.conversation"),
]
KNOWN_RESPONSES = {"resp_1": SessionId("from-resp-1")}
LOOKED_UP_AT = [s[1] for s in SOURCES].index("previous_response_id")


def put(body, path, value):
    """Set ``body``'s value at a dotted ``path``, copying the objects on the way."""
    head, _, rest = path.partition(".")
    if not rest:
        body[head] = value
        return
    inner = dict(body.get(head) or {})
    put(inner, rest, value)
    body[head] = inner


def request_with(sources, base_body=None):
    headers, body = {}, dict(base_body or chat_body())
    for kind, name, value, *_ in sources:
        if kind == "header":
            headers[name] = value
        else:
            put(body, name, value)
    return headers, body


def test_the_sources_here_are_the_modules_order():
    assert tuple(s[4] if s[0] == "body" else s[1] for s in SOURCES) + ("content",) == (
        identity_module.SOURCE_ORDER)


@pytest.mark.parametrize("kind, name, value, expected, source", SOURCES,
                         ids=[s[1] for s in SOURCES])
def test_each_source_alone_names_the_session_and_its_source(kind, name, value, expected, source):
    headers, body = request_with([(kind, name, value)])
    ident, _ = resolve(headers, body, lookup=KNOWN_RESPONSES.get)
    assert ident.session_id == expected
    assert ident.source == source
    assert ident.parent_session_id is None
    assert ident.final is False


@pytest.mark.parametrize("position", range(len(SOURCES)), ids=[s[1] for s in SOURCES])
def test_the_earliest_present_source_wins_over_every_later_one(position):
    # Later sources carry other (valid) ids; previous_response_id resolves to another session.
    later = [(k, n, v + "-later" if n != "previous_response_id" else "resp_2")
             for k, n, v, *_ in SOURCES[position + 1:]]
    kind, name, value, expected, source = SOURCES[position]
    headers, body = request_with([(kind, name, value), *later])
    lookup = {"resp_1": SessionId("from-resp-1"), "resp_2": SessionId("from-resp-2")}.get
    ident, _ = resolve(headers, body, lookup=lookup)
    assert (ident.session_id, ident.source) == (expected, source)


@pytest.mark.parametrize("position", range(len(SOURCES)), ids=[s[1] for s in SOURCES])
def test_invalid_later_sources_are_ignored_once_an_earlier_one_is_present(position):
    kind, name, value, expected, source = SOURCES[position]
    headers, body = request_with([(kind, name, value)])
    for later_kind, later_name, *_ in SOURCES[position + 1:]:
        if later_kind == "header":
            headers[later_name] = "bad\x00id"
        else:
            put(body, later_name, 12345)  # not a string
    calls = []
    def lookup(rid):
        calls.append(rid)
        return KNOWN_RESPONSES.get(rid)

    ident, _ = resolve(headers, body, lookup=lookup)
    assert (ident.session_id, ident.source) == (expected, source)
    if position < LOOKED_UP_AT:  # previous_response_id comes later: never looked up
        assert calls == []


def test_no_source_at_all_derives_the_session_from_content():
    ident, _ = resolve()
    assert ident.source == "content"
    assert CONTENT_ID.fullmatch(ident.session_id)


def test_null_body_fields_count_as_absent():
    body = chat_body(session_id=None, program_id=None, prompt_cache_key=None,
                     previous_response_id=None, conversation=None)
    ident, _ = resolve(body=body)
    assert ident.source == "content"


def test_headers_are_looked_up_case_insensitively_in_a_plain_dict_and_starlette_headers():
    a, _ = resolve({"X-Session-ID": "abc"})
    b, _ = resolve(Headers(raw=[(b"x-session-id", b"abc")]))
    c, _ = resolve(Headers(headers={"X-Claude-Code-Session-Id": "cc"}))
    assert (a.session_id, a.source) == ("abc", "x-session-id")
    assert (b.session_id, b.source) == ("abc", "x-session-id")
    assert (c.session_id, c.source) == ("cc", "x-claude-code-session-id")


# -- Claude Code children, parents, final ----------------------------------------------------


def test_claude_code_agent_id_is_a_child_session_whose_parent_is_the_claude_code_session():
    ident, _ = resolve({"x-claude-code-session-id": "cc-main", "x-claude-code-agent-id": "agent-7"})
    assert ident.session_id == "agent-7"
    assert ident.source == "x-claude-code-agent-id"
    assert ident.parent_session_id == "cc-main"


def test_claude_code_agent_wins_over_later_sources_but_not_over_dynamo():
    child, _ = resolve({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "ag",
                        "thread-id": "t", "x-session-id": "x"})
    assert (child.session_id, child.parent_session_id) == ("ag", "cc")
    dyn, _ = resolve({"x-dynamo-session-id": "d", "x-claude-code-session-id": "cc",
                      "x-claude-code-agent-id": "ag"})
    assert (dyn.session_id, dyn.source, dyn.parent_session_id) == ("d", "x-dynamo-session-id", None)


def test_claude_code_agent_id_without_a_session_id_names_a_session_without_parent():
    ident, _ = resolve({"x-claude-code-agent-id": "ag", "thread-id": "t"})
    assert (ident.session_id, ident.source, ident.parent_session_id) == (
        "ag", "x-claude-code-agent-id", None)


def test_an_explicit_parent_header_overrides_the_parent_implied_by_claude_code():
    ident, _ = resolve({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "grandchild",
                        "x-claude-code-parent-agent-id": "child"})
    assert ident.parent_session_id == "child"


def test_invalid_claude_code_session_id_is_rejected_even_for_a_child():
    with pytest.raises(IdentityError) as info:
        resolve({"x-claude-code-session-id": "", "x-claude-code-agent-id": "ag"})
    assert info.value.source == "x-claude-code-session-id"


PARENTS = ["x-dynamo-parent-session-id", "x-claude-code-parent-agent-id",
           "x-codex-parent-thread-id", "x-parent-session-id"]


@pytest.mark.parametrize("header", PARENTS)
def test_each_parent_header_names_the_parent(header):
    ident, _ = resolve({"x-session-id": "kid", header: "mom"})
    assert ident.session_id == "kid"
    assert ident.parent_session_id == "mom"


@pytest.mark.parametrize("position", range(len(PARENTS)), ids=PARENTS)
def test_the_earliest_parent_header_wins_and_later_ones_are_ignored(position):
    headers = {"x-session-id": "kid", PARENTS[position]: "first"}
    for later in PARENTS[position + 1:]:
        headers[later] = ""  # invalid, but never read
    ident, _ = resolve(headers)
    assert ident.parent_session_id == "first"


def test_parent_applies_to_a_content_derived_session_too():
    ident, _ = resolve({"x-parent-session-id": "mom"})
    assert ident.source == "content"
    assert ident.parent_session_id == "mom"


def test_a_session_is_never_its_own_parent():
    ident, _ = resolve({"x-session-id": "same", "x-parent-session-id": "same"})
    assert ident.parent_session_id is None


@pytest.mark.parametrize("header", PARENTS)
def test_invalid_parent_header_is_rejected_naming_it(header):
    with pytest.raises(IdentityError) as info:
        resolve({"x-session-id": "kid", header: "x" * 257})
    assert info.value.source == header


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1", " true "])
def test_session_final_header_true_or_1_sets_final(value):
    ident, _ = resolve({"x-session-id": "s", "x-dynamo-session-final": value})
    assert ident.final is True


@pytest.mark.parametrize("value", ["false", "0", "yes", "", "truthy"])
def test_session_final_header_other_values_leave_final_unset(value):
    ident, _ = resolve({"x-session-id": "s", "x-dynamo-session-final": value})
    assert ident.final is False


def test_final_is_false_without_the_header():
    ident, _ = resolve({"x-session-id": "s"})
    assert ident.final is False


# -- previous_response_id and conversation ---------------------------------------------------


def test_previous_response_id_is_resolved_through_the_callback():
    seen = []

    def lookup(rid):
        seen.append(rid)
        return SessionId("owner") if rid == "resp_9" else None

    ident, _ = resolve(body=chat_body(previous_response_id="resp_9"), lookup=lookup)
    assert seen == ["resp_9"]
    assert (ident.session_id, ident.source) == ("owner", "body.previous_response_id")


def test_unknown_previous_response_id_falls_through_to_conversation():
    body = chat_body(previous_response_id="resp_unknown", conversation="conv_5")
    ident, _ = resolve(body=body, lookup=lambda rid: None)
    assert (ident.session_id, ident.source) == ("conv_5", "body.conversation")


def test_unknown_previous_response_id_with_nothing_after_it_falls_back_to_content():
    ident, _ = resolve(body=chat_body(previous_response_id="resp_unknown"))
    assert ident.source == "content"


def test_previous_response_id_is_not_looked_up_when_an_earlier_source_is_present():
    calls = []
    body = chat_body(prompt_cache_key="pck", previous_response_id="resp_1")
    ident, _ = resolve(body=body, lookup=lambda rid: calls.append(rid))
    assert ident.session_id == "pck"
    assert calls == []


def test_conversation_as_an_object_with_an_id():
    ident, _ = resolve(body=chat_body(conversation={"id": "conv_obj"}))
    assert (ident.session_id, ident.source) == ("conv_obj", "body.conversation")


@pytest.mark.parametrize("conversation, source", [
    ({}, "body.conversation.id"),
    ({"id": 7}, "body.conversation.id"),
    ({"id": ""}, "body.conversation.id"),
    (7, "body.conversation"),
    (["conv"], "body.conversation"),
])
def test_malformed_conversation_is_rejected_naming_the_field(conversation, source):
    with pytest.raises(IdentityError) as info:
        resolve(body=chat_body(conversation=conversation))
    assert info.value.source == source


# -- invalid ids -----------------------------------------------------------------------------

BAD_STRINGS = [("", "empty"), ("x" * 257, "257"), ("a\x00b", "non-printable"),
               ("tab\there", "non-printable"), ("caf\u00e9", "non-printable")]
HEADER_SOURCES = ["x-dynamo-session-id", "x-claude-code-session-id", "x-claude-code-agent-id",
                  "thread-id", "x-session-id"]
BODY_SOURCES = ["session_id", "program_id", "prompt_cache_key", "previous_response_id",
                "conversation"]


@pytest.mark.parametrize("header", HEADER_SOURCES)
@pytest.mark.parametrize("value, fragment", BAD_STRINGS)
def test_invalid_header_id_raises_identity_error_naming_the_header(header, value, fragment):
    with pytest.raises(IdentityError) as info:
        resolve({header: value})
    assert info.value.source == header
    assert fragment in info.value.problem
    assert str(info.value).startswith(f"{header}: ")


NON_STRINGS = [(42, "int"), (True, "bool"), (["a"], "list"), (1.5, "float")]


@pytest.mark.parametrize("field, value, fragment", [
    (field, value, fragment)
    for field in BODY_SOURCES
    # a non-string conversation is covered by the malformed-conversation test
    for value, fragment in BAD_STRINGS + (NON_STRINGS if field != "conversation" else [])
])
def test_invalid_body_id_raises_identity_error_naming_the_field(field, value, fragment):
    with pytest.raises(IdentityError) as info:
        resolve(body=chat_body(**{field: value}))
    assert info.value.source == f"body.{field}"
    assert fragment in info.value.problem


def test_boundary_ids_of_1_and_256_printable_chars_are_accepted():
    assert resolve({"x-session-id": "a"})[0].session_id == "a"
    assert resolve({"x-session-id": "~" * 256})[0].session_id == "~" * 256


def test_identity_error_is_a_value_error_and_an_unknown_route_is_a_plain_value_error():
    assert issubclass(IdentityError, ValueError)
    with pytest.raises(ValueError) as info:
        resolve_identity("/v1/embeddings", {}, chat_body())
    assert not isinstance(info.value, IdentityError)


# -- the body to forward ---------------------------------------------------------------------


def test_program_id_is_removed_from_the_forwarded_body_even_when_a_header_named_the_session():
    body = chat_body(program_id="prog", temperature=0.2)
    ident, forward = resolve({"x-session-id": "hdr"}, body)
    assert ident.session_id == "hdr"
    assert "program_id" not in forward
    assert forward["temperature"] == 0.2


def test_client_continuation_ids_are_stripped_and_other_xargs_kept():
    body = chat_body(continuation_id="forged", vllm_xargs={"continuation_id": "forged", "k": 3})
    _, forward = resolve(body=body)
    assert "continuation_id" not in forward
    assert forward["vllm_xargs"] == {"k": 3}


@pytest.mark.parametrize("xargs", [{"continuation_id": "forged"}, None])
def test_emptied_or_null_vllm_xargs_is_dropped(xargs):
    _, forward = resolve(body=chat_body(vllm_xargs=xargs))
    assert "vllm_xargs" not in forward


def test_vllm_xargs_without_continuation_id_is_forwarded_as_is():
    xargs = {"kv_cache_report_mode": "full"}
    _, forward = resolve(body=chat_body(vllm_xargs=xargs))
    assert forward["vllm_xargs"] is xargs


def test_vllm_xargs_that_is_not_an_object_is_rejected():
    with pytest.raises(IdentityError) as info:
        resolve(body=chat_body(vllm_xargs="continuation_id=x"))
    assert info.value.source == "body.vllm_xargs"


def test_everything_else_is_forwarded_unchanged_and_the_input_body_is_not_mutated():
    body = chat_body(
        SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi",
                                              "cache_control": {"type": "ephemeral"}}]},
        program_id="p", continuation_id="c", stream=True, max_tokens=64, tools=TOOLS,
        vllm_xargs={"continuation_id": "c", "other": "x"}, session_id="s",
    )
    before = copy.deepcopy(body)
    _, forward = resolve(body=body)
    assert body == before
    assert forward is not body
    expected = {k: v for k, v in before.items() if k not in ("program_id", "continuation_id")}
    expected["vllm_xargs"] = {"other": "x"}
    assert forward == expected  # cache_control and messages reach the engine as sent


# -- the chain and token estimates -----------------------------------------------------------


def test_chat_chain_is_minted_over_messages_with_tools_model_and_cache_salt():
    body = chat_body(SYSTEM, USER, ASSISTANT, TOOL, tools=TOOLS, cache_salt="tenant-a")
    ident, _ = resolve(body=body)
    assert ident.chain == mint_chain("qwen3-8b", "tenant-a", TOOLS, [SYSTEM, USER, ASSISTANT, TOOL])
    assert ident.model == "qwen3-8b"
    other_salt, _ = resolve(body={**body, "cache_salt": "tenant-b"})
    assert other_salt.chain.root != ident.chain.root


def test_completions_chain_is_minted_over_the_prompt_as_one_element():
    ident, _ = resolve(body={"model": "m", "prompt": "Once upon a time"}, route=COMPLETIONS)
    assert ident.chain == mint_chain("m", None, None, ["Once upon a time"])
    assert ident.chain_tokens == (0, 4)


def test_completions_token_id_prompts_count_one_token_per_id():
    ident, _ = resolve(body={"model": "m", "prompt": [1, 2, 3, 4, 5]}, route=COMPLETIONS)
    assert ident.prompt_tokens == 5
    batch, _ = resolve(body={"model": "m", "prompt": [[1, 2], [3, 4, 5]]}, route=COMPLETIONS)
    assert batch.prompt_tokens == 5


def test_responses_chain_is_instructions_then_input():
    body = {"model": "m", "instructions": "Be brief.", "input": "Hello"}
    ident, _ = resolve(body=body, route=RESPONSES)
    assert ident.chain == mint_chain("m", None, None, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    items = [{"role": "user", "content": "Hello"}, {"type": "function_call_output",
                                                  "call_id": "c1", "output": "ok"}]
    listed, _ = resolve(body={**body, "input": items}, route=RESPONSES)
    assert listed.chain == mint_chain("m", None, None, [
        {"role": "system", "content": "Be brief."}, *items])
    assert listed.chain.extends(ident.chain)


def test_responses_string_and_list_input_give_the_same_content_session():
    a, _ = resolve(body={"model": "m", "input": "Hello"}, route=RESPONSES)
    b, _ = resolve(body={"model": "m", "input": [{"role": "user", "content": "Hello"},
                                                   {"role": "assistant", "content": "Hi"}]},
                   route=RESPONSES)
    assert a.session_id == b.session_id


def test_messages_chain_is_system_then_messages_with_cache_control_ignored():
    sys_blocks = [{"type": "text", "text": "You are Claude Code.",
                   "cache_control": {"type": "ephemeral"}}]
    turn1 = [{"role": "user", "content": [{"type": "text", "text": "fix it",
                                           "cache_control": {"type": "ephemeral"}}]}]
    turn2 = [{"role": "user", "content": [{"type": "text", "text": "fix it"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
             {"role": "user", "content": [{"type": "text", "text": "thanks",
                                           "cache_control": {"type": "ephemeral"}}]}]
    tools = [{"name": "bash", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    a, _ = resolve(body={"model": "claude", "system": sys_blocks, "messages": turn1,
                         "tools": tools}, route=MESSAGES)
    b, _ = resolve(body={"model": "claude", "system": sys_blocks, "messages": turn2,
                         "tools": tools}, route=MESSAGES)
    clean_system = {"role": "system", "content": [{"type": "text", "text": "You are Claude Code."}]}
    clean_tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    assert a.chain == mint_chain("claude", None, clean_tools, [clean_system, turn2[0]])
    assert b.chain.extends(a.chain)  # the cache marker moved, the content prefix did not
    assert a.session_id == b.session_id and a.source == "content"


def test_messages_string_system_is_the_first_chain_element():
    ident, _ = resolve(body={"model": "c", "system": "S", "messages": [USER]}, route=MESSAGES)
    assert ident.chain == mint_chain("c", None, None, [{"role": "system", "content": "S"}, USER])


def test_chain_tokens_are_cumulative_per_message_starting_with_the_tools():
    messages = [SYSTEM, USER, ASSISTANT, TOOL]
    ident, _ = resolve(body=chat_body(*messages, tools=TOOLS))
    assert len(ident.chain_tokens) == len(ident.chain.ids) == 5
    assert ident.chain_tokens[0] == estimate_tokens(TOOLS)
    steps = [b - a for a, b in zip(ident.chain_tokens, ident.chain_tokens[1:])]
    assert steps == [estimate_tokens(m) for m in messages]
    assert ident.prompt_tokens == ident.chain_tokens[-1] == sum(steps) + estimate_tokens(TOOLS)


def test_chain_tokens_start_at_zero_without_tools():
    ident, _ = resolve(body=chat_body(USER))
    assert ident.chain_tokens == (0, estimate_tokens(USER))


def test_later_turn_extends_the_earlier_turns_chain():
    early, _ = resolve(body=chat_body(SYSTEM, USER, tools=TOOLS))
    late, _ = resolve(body=chat_body(SYSTEM, USER, ASSISTANT, TOOL, tools=TOOLS))
    assert late.chain.extends(early.chain)
    assert late.chain_tokens[:3] == early.chain_tokens


def test_forks_sharing_the_first_k_messages_share_the_first_k_plus_1_chain_ids():
    a, _ = resolve(body=chat_body(SYSTEM, USER, {"role": "assistant", "content": "A"}))
    b, _ = resolve(body=chat_body(SYSTEM, USER, {"role": "assistant", "content": "B"}))
    assert a.chain.common_prefix_len(b.chain) == 3
    assert a.chain.head != b.chain.head


def test_identity_is_a_frozen_value():
    ident, _ = resolve()
    assert isinstance(ident, Identity)
    with pytest.raises(AttributeError):
        ident.session_id = "other"  # type: ignore[misc]


# -- estimate_tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("value, tokens", [
    (None, 0), ("", 0), ([], 0), ({}, 0),
    ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100),
    ("é" * 4, 2),  # 8 UTF-8 bytes
    (7, 1),
])
def test_estimate_tokens_is_about_a_quarter_of_the_text_length(value, tokens):
    assert estimate_tokens(value) == tokens


def test_estimate_tokens_of_structured_values_uses_their_canonical_json():
    msg = {"role": "user", "content": "hello there"}
    assert estimate_tokens(msg) == -(-len(canonical(msg)) // 4)
    assert estimate_tokens(msg) == estimate_tokens(json.loads(json.dumps(msg, indent=3)))


@given(st.text(min_size=1, max_size=50))
def test_estimate_tokens_is_at_least_1_for_non_empty_text(text):
    assert estimate_tokens(text) >= 1


# -- content-derived sessions ----------------------------------------------------------------


def test_content_session_is_stable_across_turns_of_one_conversation():
    t1, _ = resolve(body=chat_body(SYSTEM, USER))
    t2, _ = resolve(body=chat_body(SYSTEM, USER, ASSISTANT, TOOL))
    t3, _ = resolve(body=chat_body(SYSTEM, USER, ASSISTANT, TOOL,
                                   {"role": "user", "content": "and now the docs"}))
    assert t1.session_id == t2.session_id == t3.session_id
    assert t1.source == "content"


@pytest.mark.parametrize("change", ["first_user", "system", "model", "cache_salt"])
def test_content_session_differs_when_its_inputs_differ(change):
    base = chat_body(SYSTEM, USER)
    if change == "first_user":
        other = chat_body(SYSTEM, {"role": "user", "content": "Fix the other test"})
    elif change == "system":
        other = chat_body({"role": "system", "content": "You are terse."}, USER)
    elif change == "model":
        other = {**base, "model": "llama-3-8b"}
    else:
        other = {**base, "cache_salt": "tenant-b"}
    assert resolve(body=base)[0].session_id != resolve(body=other)[0].session_id


def test_content_session_ignores_tools_and_later_system_messages():
    a, _ = resolve(body=chat_body(SYSTEM, USER))
    b, _ = resolve(body=chat_body(SYSTEM, USER, {"role": "system", "content": "reminder"},
                                  tools=TOOLS))
    assert a.session_id == b.session_id


def test_content_session_for_completions_and_responses_is_a_c_hex_id():
    c, _ = resolve(body={"model": "m", "prompt": "hi"}, route=COMPLETIONS)
    r, _ = resolve(body={"model": "m", "instructions": "I", "input": "hi"}, route=RESPONSES)
    assert CONTENT_ID.fullmatch(c.session_id) and CONTENT_ID.fullmatch(r.session_id)
    assert c.session_id != r.session_id


json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
contents = st.text(min_size=1, max_size=40) | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)},
                          optional={"meta": json_values}), min_size=1, max_size=3)
roles = st.sampled_from(["system", "user", "assistant", "tool"])
messages_st = st.lists(
    st.fixed_dictionaries({"role": roles, "content": contents},
                          optional={"name": st.text(max_size=5)}),
    min_size=1, max_size=6)


def _reorder(value, rng):
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _reorder(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_reorder(v, rng) for v in value]
    return value


@settings(max_examples=80, deadline=None)
@given(messages=messages_st, tools=st.none() | st.lists(json_values, max_size=2),
       indent=st.sampled_from([None, 0, 2]), seed=st.integers(0, 2**32 - 1),
       route=st.sampled_from([CHAT, MESSAGES]))
def test_identity_is_stable_across_key_order_and_json_whitespace(
        messages, tools, indent, seed, route):
    body = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    text = json.dumps(_reorder(body, random.Random(seed)), indent=indent,
                      ensure_ascii=indent is None)
    a, _ = resolve_identity(route, {}, body)
    b, _ = resolve_identity(route, {}, json.loads(text))
    assert (a.session_id, a.chain, a.chain_tokens, a.prompt_tokens) == (
        b.session_id, b.chain, b.chain_tokens, b.prompt_tokens)


@settings(max_examples=60, deadline=None)
@given(prefix=messages_st, tail_a=messages_st, tail_b=messages_st)
def test_forks_share_exactly_the_common_prefix_and_keep_one_content_session(prefix, tail_a, tail_b):
    a, _ = resolve(body={"model": "m", "messages": prefix + tail_a})
    b, _ = resolve(body={"model": "m", "messages": prefix + tail_b})
    k = len(prefix)
    while k < min(len(prefix + tail_a), len(prefix + tail_b)) and canonical(
            (prefix + tail_a)[k]) == canonical((prefix + tail_b)[k]):
        k += 1
    assert a.chain.common_prefix_len(b.chain) == k + 1
    if any(m["role"] == "user" for m in prefix):
        assert a.session_id == b.session_id


# -- malformed shapes ------------------------------------------------------------------------


@pytest.mark.parametrize("body", [[1, 2], "text", None, 3])
def test_a_body_that_is_not_an_object_is_rejected(body):
    with pytest.raises(IdentityError) as info:
        resolve_identity(CHAT, {}, body)
    assert info.value.source == "body"


@pytest.mark.parametrize("route, body, source", [
    (CHAT, {"model": "m"}, "body.messages"),
    (CHAT, {"model": "m", "messages": {"role": "user"}}, "body.messages"),
    (CHAT, {"model": "m", "messages": "hi"}, "body.messages"),
    (CHAT, {"model": "m", "messages": [USER, "hi"]}, "body.messages[1]"),
    (CHAT, {"model": "m", "messages": [USER], "tools": {"name": "x"}}, "body.tools"),
    (CHAT, {"model": 7, "messages": [USER]}, "body.model"),
    (CHAT, {"model": "m", "messages": [USER], "cache_salt": 1}, "body.cache_salt"),
    (CHAT, {"model": "m", "messages": [USER, {"role": "user", "content": float("nan")}]},
     "body.messages[1]"),
    (CHAT, {"model": "m", "messages": [USER], "tools": [{"x": float("inf")}]}, "body.tools"),
    (COMPLETIONS, {"model": "m"}, "body.prompt"),
    (COMPLETIONS, {"model": "m", "prompt": {"text": "hi"}}, "body.prompt"),
    (COMPLETIONS, {"model": "m", "prompt": ["ok", 1.5]}, "body.prompt[1]"),
    (COMPLETIONS, {"model": "m", "prompt": [[1, "x"]]}, "body.prompt[0]"),
    (RESPONSES, {"model": "m", "input": 5}, "body.input"),
    (RESPONSES, {"model": "m", "input": ["hi"]}, "body.input[0]"),
    (RESPONSES, {"model": "m", "instructions": 5, "input": "hi"}, "body.instructions"),
    (MESSAGES, {"model": "m", "messages": [USER], "system": 5}, "body.system"),
    (MESSAGES, {"model": "m", "messages": [5]}, "body.messages[0]"),
    (MESSAGES, {"model": "m", "system": "s", "messages": [USER, {"role": "user",
                                                                 "content": float("nan")}]},
     "body.messages[1]"),
])
def test_malformed_shapes_are_rejected_naming_the_field(route, body, source):
    with pytest.raises(IdentityError) as info:
        resolve_identity(route, {"x-session-id": "s"}, body)
    assert info.value.source == source


def test_missing_model_is_allowed_and_reported_as_none():
    ident, _ = resolve(body={"messages": [USER]})
    assert ident.model is None
    assert ident.chain == mint_chain("", None, None, [USER])


# -- purity and cost -------------------------------------------------------------------------


@pytest.mark.parametrize("module", [identity_module, prompt_module], ids=lambda m: m.__name__)
def test_identity_module_does_no_io_and_reads_no_clock(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    forbidden = {"os", "time", "datetime", "socket", "random", "threading", "asyncio", "anyio",
                 "httpx", "starlette", "zmq", "structlog", "subprocess", "io", "pathlib", "uuid"}
    assert imported & forbidden == set()


def test_a_long_conversation_is_serialised_at_most_twice(monkeypatch):
    messages = [SYSTEM] + [
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "lorem ipsum " * 40}
        for i in range(300)
    ]
    body = chat_body(*messages, tools=TOOLS)
    body_bytes = len(canonical(body))
    serialised = []
    real_dumps = coordinates.json.dumps

    class CountingJson:
        @staticmethod
        def dumps(value, **kwargs):
            out = real_dumps(value, **kwargs)
            serialised.append(len(out))
            return out

    monkeypatch.setattr(coordinates, "json", CountingJson)
    ident, _ = resolve({}, body)  # the content-derived id too
    assert ident.source == "content"
    assert sum(serialised) <= 2 * body_bytes


# -- agent contexts: vllm-router's agentic_context, Dynamo's nvext, agent_hint ---------------


def test_agentic_context_names_program_parent_group_and_hints():
    context = {"program_id": "task-a:researcher", "session_id": "session-a", "task_id": "task-a",
               "parent_program_id": "task-a:lead", "root_program_id": "task-a:lead",
               "priority": 10, "deadline_seconds": 30, "expected_output_length": 2048,
               "kv_retention_ttl_seconds": 5.5}
    ident, forward = resolve(body=chat_body(vllm_xargs={"agentic_context": context, "other": 1}))
    assert (ident.session_id, ident.source) == ("task-a:researcher", "body.vllm_xargs.agentic_context")
    assert ident.parent_session_id == "task-a:lead"
    assert ident.group_id == "task-a"
    assert ident.hints == CallHints(priority=10, deadline_s=30.0, expected_output_tokens=2048,
                                    retention_ttl_s=5.5)
    # the engine gets neither the context (vLLM's xargs take flat values only) nor less
    assert forward["vllm_xargs"] == {"other": 1}


def test_agentic_context_without_program_id_uses_its_session_id_and_the_root_as_group():
    context = {"session_id": "s-1", "root_program_id": "root-1"}
    ident, forward = resolve(body=chat_body(vllm_xargs={"agentic_context": context}))
    assert (ident.session_id, ident.group_id, ident.hints) == ("s-1", "root-1", None)
    assert "vllm_xargs" not in forward


def test_a_group_that_is_the_program_itself_is_no_group():
    context = {"program_id": "lead", "root_program_id": "lead"}
    ident, _ = resolve(body=chat_body(vllm_xargs={"agentic_context": context}))
    assert ident.group_id is None


def test_dynamo_agent_context_trajectory_is_the_program_and_its_session_the_group():
    nvext = {"agent_context": {"session_type_id": "deep_research", "session_id": "run-42",
                               "trajectory_id": "run-42:researcher",
                               "parent_trajectory_id": "run-42:planner"},
             "agent_hints": {"priority": 5, "osl": 1024}, "other": True}
    ident, forward = resolve(body=chat_body(nvext=nvext))
    assert (ident.session_id, ident.source) == ("run-42:researcher", "body.nvext.agent_context")
    assert (ident.parent_session_id, ident.group_id) == ("run-42:planner", "run-42")
    assert ident.hints == CallHints(priority=5, expected_output_tokens=1024)
    assert forward["nvext"] == {"other": True}


def test_dynamo_workflow_schema_and_a_context_with_only_its_run():
    newer = {"agent_context": {"workflow_id": "wf", "program_id": "wf:p", "parent_program_id": "wf:q"}}
    ident, _ = resolve(body=chat_body(nvext=newer))
    assert (ident.session_id, ident.parent_session_id, ident.group_id) == ("wf:p", "wf:q", "wf")
    run_only, forward = resolve(body=chat_body(nvext={"agent_context": {"session_id": "run-7"}}))
    assert (run_only.session_id, run_only.group_id) == ("run-7", None)
    assert "nvext" not in forward


def test_agent_hint_names_the_program_and_its_parent():
    hint = {"session_id": "sub-1", "parent_session_id": "main-1", "blocks_parent": True}
    ident, forward = resolve(body=chat_body(agent_hint=hint))
    assert (ident.session_id, ident.source, ident.parent_session_id) == (
        "sub-1", "body.agent_hint", "main-1")
    assert "agent_hint" not in forward


def test_hints_come_from_the_agentic_context_before_dynamos_and_alone_name_no_program():
    body = chat_body(vllm_xargs={"agentic_context": {"priority": 3}},
                     nvext={"agent_hints": {"priority": 9, "osl": 64}})
    ident, _ = resolve({"x-session-id": "s"}, body)
    assert (ident.session_id, ident.source) == ("s", "x-session-id")
    assert ident.hints == CallHints(priority=3, expected_output_tokens=64)


@pytest.mark.parametrize("where, key, value, source", [
    ("agentic", "priority", "high", "body.vllm_xargs.agentic_context.priority"),
    ("agentic", "priority", True, "body.vllm_xargs.agentic_context.priority"),
    ("agentic", "priority", 2**31, "body.vllm_xargs.agentic_context.priority"),
    ("agentic", "deadline_seconds", -1, "body.vllm_xargs.agentic_context.deadline_seconds"),
    ("agentic", "deadline_seconds", "soon", "body.vllm_xargs.agentic_context.deadline_seconds"),
    ("agentic", "expected_output_length", -5,
     "body.vllm_xargs.agentic_context.expected_output_length"),
    ("agentic", "kv_retention_ttl_seconds", 1e300,
     "body.vllm_xargs.agentic_context.kv_retention_ttl_seconds"),
    ("agentic", "program_id", 7, "body.vllm_xargs.agentic_context.program_id"),
    ("dynamo", "osl", 1.5, "body.nvext.agent_hints.osl"),
])
def test_invalid_context_fields_are_refused_naming_them(where, key, value, source):
    if where == "agentic":
        body = chat_body(vllm_xargs={"agentic_context": {"program_id": "p", key: value}})
    else:
        body = chat_body(nvext={"agent_hints": {key: value}})
    with pytest.raises(IdentityError) as info:
        resolve(body=body)
    assert info.value.source == source


@pytest.mark.parametrize("body, source", [
    (chat_body(vllm_xargs={"agentic_context": "p"}), "body.vllm_xargs.agentic_context"),
    (chat_body(nvext=[1]), "body.nvext"),
    (chat_body(nvext={"agent_context": 3}), "body.nvext.agent_context"),
    (chat_body(agent_hint="x"), "body.agent_hint"),
])
def test_contexts_that_are_not_objects_are_refused(body, source):
    with pytest.raises(IdentityError) as info:
        resolve(body=body)
    assert info.value.source == source


# -- Anthropic metadata.user_id ----------------------------------------------------------------


def test_claude_codes_json_user_id_names_its_session():
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "0c6f-sess"})
    ident, forward = resolve(body={"model": "m", "max_tokens": 8, "metadata": {"user_id": user_id},
                                   "messages": [USER]}, route=MESSAGES)
    assert (ident.session_id, ident.source) == ("0c6f-sess", "body.metadata.user_id")
    assert forward["metadata"] == {"user_id": user_id}  # Anthropic's own field: forwarded


def test_legacy_claude_code_user_id_names_its_session_and_a_plain_one_is_taken_as_is():
    legacy = "user_" + "a" * 64 + "_account__session_3f2b1c9e-1111-4222-8333-944445555666"
    ident, _ = resolve(body=chat_body(metadata={"user_id": legacy}))
    assert ident.session_id == "3f2b1c9e-1111-4222-8333-944445555666"
    plain, _ = resolve(body=chat_body(metadata={"user_id": "run-17"}))
    assert plain.session_id == "run-17"


@pytest.mark.parametrize("user_id", [7, "", "x" * 300, json.dumps({"device_id": "d"}) + "x" * 300])
def test_a_user_id_that_is_no_valid_id_is_ignored_not_refused(user_id):
    ident, _ = resolve(body=chat_body(metadata={"user_id": user_id}))
    assert ident.source == "content"


# -- calls without identity: the answer a call carries on from -----------------------------------


def test_an_opening_call_continues_nothing_and_its_group_is_its_opening():
    ident, _ = resolve(body=chat_body(SYSTEM, USER))
    assert ident.continues is None
    assert ident.group_id == ident.session_id and CONTENT_ID.fullmatch(ident.group_id)


def test_a_chat_call_continues_its_last_assistant_turn_after_the_prompt_before_it():
    answer = {"role": "assistant", "content": "  Sure:\n  step one ",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "ls", "arguments": "{}"}}]}
    first, _ = resolve(body=chat_body(SYSTEM, USER))
    later, _ = resolve(body=chat_body(SYSTEM, USER, answer, TOOL))
    assert later.continues == AnswerKey(first.chain.head,
                                        answer_fingerprint(Answer(("  Sure:\n  step one ",), ("call_1",))))
    assert later.group_id == first.group_id


def test_a_final_assistant_message_is_a_prefill_not_an_answer_carried_back():
    reply = {"role": "assistant", "content": "one"}
    prefill = {"role": "assistant", "content": "Answer: "}
    with_prefill, _ = resolve(body=chat_body(SYSTEM, USER, reply, USER, prefill))
    without, _ = resolve(body=chat_body(SYSTEM, USER, reply, USER))
    assert with_prefill.continues == without.continues is not None
    only_prefill, _ = resolve(body=chat_body(SYSTEM, USER, prefill))
    assert only_prefill.continues is None


def test_a_responses_answer_is_the_run_of_output_items_before_the_tool_output():
    items = [{"role": "user", "content": "go"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "looking"}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "ls",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_9", "output": "a b"}]
    first, _ = resolve(body={"model": "m", "instructions": "be brief", "input": items[:1]},
                       route=RESPONSES)
    later, _ = resolve(body={"model": "m", "instructions": "be brief", "input": items},
                       route=RESPONSES)
    assert later.continues == AnswerKey(first.chain.head,
                                        answer_fingerprint(Answer(("looking",), ("call_9",))))


def test_a_messages_answer_is_its_text_and_tool_use_ids_not_its_thinking():
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_01", "name": "ls", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                           "content": "a b", "cache_control": {"type": "ephemeral"}}]}
    first, _ = resolve(body={"model": "m", "max_tokens": 9, "system": "sys",
                             "messages": [USER]}, route=MESSAGES)
    later, _ = resolve(body={"model": "m", "max_tokens": 9, "system": "sys",
                             "messages": [USER, turn, result]}, route=MESSAGES)
    assert later.continues == AnswerKey(first.chain.head,
                                        answer_fingerprint(Answer(("Let me look.",), ("toolu_01",))))


def test_an_answers_fingerprint_is_its_tool_ids_else_its_text_without_whitespace():
    assert answer_fingerprint(Answer(("a b\n",), ())) == answer_fingerprint(Answer(("ab",), ()))
    assert answer_fingerprint(Answer(("ab",), ())) != answer_fingerprint(Answer(("ac",), ()))
    assert answer_fingerprint(Answer(("x",), ("id1",))) == answer_fingerprint(Answer(("y",), ("id1",)))
    assert answer_fingerprint(Answer((), ("id1",))) != answer_fingerprint(Answer((), ("id2",)))
    # a text that happens to spell a tool id is not that tool call
    assert answer_fingerprint(Answer(("id1",), ())) != answer_fingerprint(Answer((), ("id1",)))
