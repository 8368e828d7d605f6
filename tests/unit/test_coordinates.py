"""Coordinates (architecture.md §2): session-id validation, canonical bytes, continuation chains."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.coordinates import (
    CONTINUATION_NAMESPACE,
    SESSION_ID_MAX_LEN,
    ContinuationChain,
    InvalidIdentifier,
    canonical,
    mint_chain,
    next_continuation,
    root_continuation,
    validate_session_id,
)

from tests.support.chat_messages import ASSISTANT, SYSTEM, TOOL, TOOLS, USER

HEX32 = re.compile(r"[0-9a-f]{32}")


# -- session ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a", "x" * SESSION_ID_MAX_LEN, "sess 1/abc~!", " ", "~" * 3])
def test_session_id_of_1_to_256_printable_ascii_chars_is_accepted_unchanged(value):
    assert validate_session_id(value) == value


def test_session_id_max_len_is_256():
    assert SESSION_ID_MAX_LEN == 256


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("", "empty"),
        ("x" * 257, "257"),
        ("abc\x00", "non-printable"),
        ("tab\there", "non-printable"),
        ("line\nbreak", "non-printable"),
        ("cr\r", "non-printable"),
        ("del\x7f", "non-printable"),
        ("esc\x1b[0m", "non-printable"),
        ("caf\u00e9", "non-printable"),
    ],
)
def test_bad_session_id_raises_invalid_identifier_naming_the_source(value, fragment):
    with pytest.raises(InvalidIdentifier) as info:
        validate_session_id(value, source="x-session-id")
    err = info.value
    assert err.source == "x-session-id"
    assert str(err).startswith("x-session-id: ")
    assert fragment in err.problem


@pytest.mark.parametrize("value", [None, 42, b"bytes-id", ["a"], 1.5])
def test_non_string_session_id_is_rejected_naming_the_source_and_type(value):
    with pytest.raises(InvalidIdentifier) as info:
        validate_session_id(value, source="body.session_id")
    assert info.value.source == "body.session_id"
    assert type(value).__name__ in str(info.value)


def test_invalid_identifier_is_a_value_error_with_default_source():
    with pytest.raises(ValueError, match=r"^session_id: "):
        validate_session_id("")


# -- canonical serialisation -------------------------------------------------------------


def test_canonical_is_independent_of_dict_key_order():
    a = {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"}
    b = {"name": "u", "content": [{"text": "hi", "type": "text"}], "role": "user"}
    assert canonical(a) == canonical(b)


def test_two_differently_formatted_json_texts_give_the_same_canonical_bytes():
    compact = '{"role":"user","content":[{"type":"text","text":"héllo ✓"}],"n":[1,2.5,null,true]}'
    pretty = """
    {
        "n" : [ 1 , 2.5 , null , true ],
        "content": [
            { "text": "h\\u00e9llo \\u2713",   "type": "text" }
        ],
        "role" :   "user"
    }
    """
    assert compact != pretty
    assert canonical(json.loads(compact)) == canonical(json.loads(pretty))


def test_canonical_bytes_are_compact_sorted_utf8():
    out = canonical({"b": 1, "a": ["é", None]})
    assert out == '{"a":["é",null],"b":1}'.encode("utf-8")
    assert isinstance(out, bytes)


def test_canonical_reads_tuples_as_lists():
    assert canonical({"x": (1, 2)}) == canonical({"x": [1, 2]})


def test_canonical_keeps_whole_floats_distinct_from_ints():
    assert canonical({"t": 1.0}) != canonical({"t": 1})


def test_canonical_distinguishes_array_order_and_values():
    assert canonical([1, 2]) != canonical([2, 1])
    assert canonical({"a": "1"}) != canonical({"a": 1})


def test_canonical_rejects_nan():
    with pytest.raises(ValueError):
        canonical({"x": float("nan")})


json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 1, 4]), shuffle_seed=st.randoms())
def test_canonical_is_stable_across_json_formatting_and_key_order(value, indent, shuffle_seed):
    def reorder(v):
        if isinstance(v, dict):
            items = list(v.items())
            shuffle_seed.shuffle(items)
            return {k: reorder(x) for k, x in items}
        if isinstance(v, list):
            return [reorder(x) for x in v]
        return v

    text = json.dumps(reorder(value), indent=indent, ensure_ascii=indent is None)
    assert canonical(json.loads(text)) == canonical(value)


# -- continuation ids --------------------------------------------------------------------


def test_ids_are_32_lowercase_hex_chars():
    chain = mint_chain("qwen3-8b", None, TOOLS, [SYSTEM, USER])
    assert len(chain.ids) == 3
    for cid in chain.ids:
        assert HEX32.fullmatch(cid), cid


def test_ids_are_128_bit_blake2b_of_length_prefixed_parts():
    # Recompute independently from architecture.md §2: blake2b(digest_size=16) over the parts, each
    # preceded by its 8-byte big-endian length.
    def h(*parts: bytes) -> str:
        d = hashlib.blake2b(digest_size=16)
        for p in parts:
            d.update(len(p).to_bytes(8, "big") + p)
        return d.hexdigest()

    c0 = h(CONTINUATION_NAMESPACE, b"m", b"salt", canonical(TOOLS))
    assert root_continuation("m", "salt", TOOLS) == c0
    c1 = h(c0.encode(), canonical(USER))
    assert next_continuation(c0, USER) == c1
    assert mint_chain("m", "salt", TOOLS, [USER]).ids == (c0, c1)


def test_same_content_prefix_same_model_and_salt_gives_equal_chains():
    a = mint_chain("m", "s", TOOLS, [SYSTEM, USER, ASSISTANT, TOOL])
    # the same content, built from JSON with another key order
    msgs = [json.loads(json.dumps(m, sort_keys=True)) for m in (SYSTEM, USER, ASSISTANT, TOOL)]
    tools = json.loads(json.dumps(TOOLS, indent=2, sort_keys=True))
    b = mint_chain("m", "s", tools, msgs)
    assert a == b
    assert a.head == b.head


def test_minting_is_deterministic():
    assert mint_chain("m", None, None, [USER]) == mint_chain("m", None, None, [USER])


@pytest.mark.parametrize(
    "other",
    [
        dict(model="m2", salt="s", tools=TOOLS),
        dict(model="m", salt="s2", tools=TOOLS),
        dict(model="m", salt=None, tools=TOOLS),
        dict(model="m", salt="s", tools=[]),
        dict(model="m", salt="s", tools=TOOLS + TOOLS),
    ],
    ids=["model", "salt", "no-salt", "no-tools", "more-tools"],
)
def test_different_model_salt_or_tools_give_a_different_root_and_no_shared_ids(other):
    base = mint_chain("m", "s", TOOLS, [SYSTEM, USER])
    changed = mint_chain(other["model"], other["salt"], other["tools"], [SYSTEM, USER])
    assert changed.root != base.root
    assert set(changed.ids).isdisjoint(base.ids)
    assert changed.common_prefix_len(base) == 0


def test_length_prefixing_keeps_model_and_salt_boundaries_apart():
    assert root_continuation("ab", "c", None) != root_continuation("a", "bc", None)
    assert root_continuation("a", "", None) != root_continuation("", "a", None)


def test_absent_salt_and_tools_read_as_empty():
    assert root_continuation("m", None, None) == root_continuation("m", "", [])


def test_a_changed_message_changes_its_id_and_every_later_one_but_not_earlier_ones():
    a = mint_chain("m", None, TOOLS, [SYSTEM, USER, ASSISTANT, TOOL])
    edited_user = dict(USER, content=USER["content"] + ".")
    b = mint_chain("m", None, TOOLS, [SYSTEM, edited_user, ASSISTANT, TOOL])
    assert a.ids[:2] == b.ids[:2]
    assert all(x != y for x, y in zip(a.ids[2:], b.ids[2:]))
    assert a.common_prefix_len(b) == 2


def test_message_order_matters():
    a = mint_chain("m", None, None, [USER, TOOL])
    b = mint_chain("m", None, None, [TOOL, USER])
    assert a.head != b.head
    assert a.common_prefix_len(b) == 1


def test_forks_share_their_ancestors():
    trunk = [SYSTEM, USER, ASSISTANT]
    left = mint_chain("m", None, TOOLS, trunk + [TOOL])
    right = mint_chain("m", None, TOOLS, trunk + [{"role": "tool", "tool_call_id": "t1",
                                                    "content": "0 failed"}])
    prefix = mint_chain("m", None, TOOLS, trunk)
    assert left.head != right.head
    assert left.common_prefix_len(right) == 4  # c0 + three shared messages
    assert right.common_prefix_len(left) == 4
    assert left.ids[:4] == right.ids[:4] == prefix.ids
    assert left.extends(prefix) and right.extends(prefix)
    assert not left.extends(right) and not right.extends(left)


def test_extends_holds_for_later_turns_and_itself_only():
    first = mint_chain("m", None, None, [SYSTEM, USER])
    later = mint_chain("m", None, None, [SYSTEM, USER, ASSISTANT, TOOL])
    assert later.extends(first)
    assert not first.extends(later)
    assert later.extends(later)
    assert later.common_prefix_len(later) == len(later.ids) == 5


def test_chain_root_and_head():
    chain = mint_chain("m", None, None, [USER, ASSISTANT])
    assert chain.root == root_continuation("m", None, None) == chain.ids[0]
    assert chain.head == chain.ids[-1] == next_continuation(next_continuation(chain.root, USER),
                                                            ASSISTANT)


def test_chain_without_messages_is_just_the_root():
    chain = mint_chain("m", "s", TOOLS, [])
    assert chain.ids == (root_continuation("m", "s", TOOLS),)
    assert chain.head == chain.root


def test_chain_is_immutable_value():
    chain = mint_chain("m", None, None, [USER])
    assert chain == ContinuationChain(tuple(chain.ids))
    assert hash(chain) == hash(ContinuationChain(tuple(chain.ids)))
    with pytest.raises(AttributeError):
        chain.ids = ()  # type: ignore[misc]


messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                           "content": st.sampled_from(["a", "b", "c", ""])}),
    max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(a=messages, b=messages)
def test_ids_are_equal_exactly_when_canonical_prefixes_are_equal(a, b):
    ca = mint_chain("m", "s", TOOLS, a)
    cb = mint_chain("m", "s", TOOLS, b)
    shared = 0
    for x, y in zip(a, b):
        if canonical(x) != canonical(y):
            break
        shared += 1
    assert ca.common_prefix_len(cb) == 1 + shared
    for i in range(min(len(ca.ids), len(cb.ids))):
        assert (ca.ids[i] == cb.ids[i]) == (i <= shared)
    assert cb.extends(ca) == (shared == len(a))
