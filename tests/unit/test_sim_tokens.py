"""The simworker's pseudo-tokenizer (sim/tokens.py): prefix stability, filler that is its own
tokenization, and vLLM-style chained block hashes."""

from __future__ import annotations

import json
from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.tokens import (
    BOS,
    FILLER_WORDS,
    PromptError,
    PseudoTokenizer,
    block_hashes,
    filler_sentence,
    prompt_seed,
    role_token,
    tool_calls_text,
)

BS = 16


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_pieces_cover_the_text_exactly(text):
    assert "".join(PseudoTokenizer.pieces(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text(alphabet=st.characters(blacklist_categories=("Zs", "Cc")), min_size=1))
def test_text_appended_after_a_word_boundary_keeps_the_earlier_pieces(head, word):
    tok = PseudoTokenizer()
    # a space then a non-space character starts a new piece whatever came before
    first = tok.pieces(head)
    joined = tok.pieces(head + " " + word)
    if head and not head[-1].isspace():
        assert joined[:len(first)] == first


def test_about_four_characters_per_token_on_english():
    tok = PseudoTokenizer()
    text = "The quick brown fox jumps over the lazy dog, then reads the documentation twice. " * 20
    assert 3.0 <= len(text) / len(tok.encode(text)) <= 5.0


def test_token_ids_are_the_same_in_every_tokenizer_instance():
    assert PseudoTokenizer().encode("hello world 42") == PseudoTokenizer().encode("hello world 42")


def test_every_prefix_of_the_filler_tokenizes_back_to_itself():
    tok = PseudoTokenizer()
    for leading_space in (False, True):
        for start in range(len(FILLER_WORDS)):
            ids, pieces = tok.filler(120, start, leading_space=leading_space)
            assert len(ids) == len(pieces) == 120
            for k in range(1, 121):
                assert tok.pieces("".join(pieces[:k])) == pieces[:k]
            assert tok.encode("".join(pieces)) == ids


def test_a_chat_reply_sent_back_verbatim_continues_the_cached_sequence():
    tok = PseudoTokenizer()
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Fix the bug."}]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    prompt = tok.render_chat(first, tools)
    out_ids, pieces = tok.filler(50, 7, leading_space=False)
    second = first + [{"role": "assistant", "content": "".join(pieces)},
                      {"role": "user", "content": "Thanks, now run the tests."}]
    assert tok.render_chat(second, tools)[:len(prompt) + 50] == prompt + out_ids


def test_a_tool_call_reply_sent_back_continues_the_cached_sequence_whatever_else_the_client_echoes():
    tok = PseudoTokenizer()
    first = [{"role": "user", "content": "List the files."}]
    prompt = tok.render_chat(first)
    call = {"id": "chatcmpl-tool-0123456789abcdef", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": "ls -la"})}}
    reply = tok.pieces(tool_calls_text([call]))
    out_ids = [tok.piece_id(piece) for piece in reply]
    # the client's copy: another id, an index, no type, content null: none of it is rendered
    echoed = {"id": "call_9", "index": 0, "function": dict(call["function"])}
    second = first + [{"role": "assistant", "content": None, "tool_calls": [echoed]},
                      {"role": "tool", "tool_call_id": "call_9", "content": "a.py"}]
    assert tok.render_chat(second)[:len(prompt) + len(out_ids)] == prompt + out_ids
    assert json.loads(tool_calls_text([call])) == [{"name": "bash", "arguments": call["function"]["arguments"]}]


def test_prompt_seeds_follow_the_prompt_tail_and_the_seed():
    assert prompt_seed([5, 6, 7], None) == prompt_seed([5, 6, 7], None)
    assert prompt_seed([5, 6, 7], None) != prompt_seed([5, 6, 8], None)
    assert prompt_seed([5, 6, 7], 1) != prompt_seed([5, 6, 7], 2)
    assert prompt_seed([1] * 10 + [5, 6, 7], 3) != prompt_seed([5, 6, 7], 3)
    assert prompt_seed([9] + [1] * 64, 3) == prompt_seed([8] + [1] * 64, 3)  # the last 64 tokens only


def test_filler_sentences_are_filler_words_whose_first_names_no_program():
    for seed in range(50):
        words = filler_sentence(Random(seed), 4).split()
        assert len(words) == 4 and words[0][0].isupper()
        assert all(word.lower() in FILLER_WORDS for word in words)


def test_a_completion_prompt_extended_by_its_output_continues_the_cached_sequence():
    tok = PseudoTokenizer()
    for text in ("Once upon a time", "Q: 12 + 30 =", "Answer:\n", "ends with a space "):
        prompt = tok.render_completion(text)
        out_ids, pieces = tok.filler(40, 11, leading_space=True)
        again = tok.render_completion(text + "".join(pieces))
        if text.endswith(" "):
            # the trailing space joins the first output word: one piece differs
            assert again[:len(prompt) - 1] == prompt[:-1]
        else:
            assert again[:len(prompt) + 40] == prompt + out_ids


def test_chat_rendering_includes_roles_names_tools_and_parts():
    tok = PseudoTokenizer()
    base = [{"role": "user", "content": "hi"}]
    plain = tok.render_chat(base)
    assert plain[0] == BOS and plain[1] == role_token("user") and plain[-1] == role_token("assistant")
    assert tok.render_chat(base, [{"name": "x"}]) != plain
    assert tok.render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == plain
    assert tok.render_chat([{"role": "user", "name": "bob", "content": "hi"}]) != plain
    assert tok.render_chat(base, add_generation_prompt=False) == plain[:-1]
    assert role_token("narrator") not in (role_token("user"), role_token("assistant"))


def test_malformed_prompts_name_the_field():
    tok = PseudoTokenizer()
    for messages, param in (([], "messages"), ([1], "messages[0]"), ([{"content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content")):
        try:
            tok.render_chat(messages)
        except PromptError as err:
            assert err.param == param
        else:
            raise AssertionError(f"{messages!r} accepted")
    for prompt in ("", ["a", "b"], [1, -2], {"x": 1}):
        try:
            tok.render_completion(prompt)
        except PromptError as err:
            assert err.param == "prompt"
        else:
            raise AssertionError(f"{prompt!r} accepted")
    assert tok.render_completion([5, 6, 7]) == [5, 6, 7]


def test_block_hashes_chain_over_full_blocks_and_the_salt_changes_them_all():
    tokens = list(range(300, 300 + 5 * BS + 3))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 5 and all(0 <= h < 2**64 for h in hashes)
    assert block_hashes(tokens[:3 * BS], BS) == hashes[:3]
    changed = tokens[:]
    changed[BS + 1] += 1
    other = block_hashes(changed, BS)
    assert other[0] == hashes[0] and all(a != b for a, b in zip(other[1:], hashes[1:]))
    salted = block_hashes(tokens, BS, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(salted, hashes))
    assert block_hashes(tokens, BS, cache_salt="tenant-a") == salted
