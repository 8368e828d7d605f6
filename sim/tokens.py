"""The simworker's pseudo-tokenizer: requests to token ids and vLLM-style block hashes.

There is no model, so there is no real tokenizer; what matters is that token counts are
plausible and that the prefix cache behaves as it would: identical prefixes give identical
tokens, hence identical block hashes.

Text is cut into *pieces* by a regular expression in the spirit of byte-level BPE
pre-tokenizers: a run of letters (with one leading space) is cut every 4 letters, digits go
in threes, punctuation runs in fours, and whitespace before a word attaches to it. That
gives ~3.5 characters per token on English and code, and cuts re-synchronise at every word,
so text appended after a word boundary leaves the earlier pieces unchanged. Each distinct
piece maps to a token id by a keyed hash (ids ≥ 256; ids below are the special tokens).

Chat requests are rendered like a chat template, each part tokenized on its own (special
tokens end the pieces, as in a real template): ``<bos>``, then the tools (canonical JSON)
if any, then per message ``<start:role>`` + header text (name, tool_call_id, if any) +
content + tool calls + ``<end>``, then ``<start:assistant>`` (the generation prompt) unless
the last message is continued. Tool calls render as :func:`tool_calls_text`: the canonical
JSON of each call's function name and arguments string only, as templates such as Qwen's
render them (no call id, no ``type``), so the rendering does not depend on how a client
re-serialises the rest of the call. A completion prompt is ``<bos>`` + its text (or the
client's token ids as they are).

Output is filler from a fixed word cycle, cut into exactly the pieces the tokenizer makes of
it, so *the text is the tokens*; a tool-call reply's tokens are its :func:`tool_calls_text`.
Where the filler starts is sampled (simworker/worker.py draws it as vLLM samples: from the
worker's random source, or from :func:`prompt_seed` under ``seed`` or greedy decoding).
Hence what hits the prefix cache on a later turn:
- chat: a client that sends the assistant's reply back verbatim as the next turn's
  assistant message (its text, or its tool calls' names and arguments) gets hits through
  the whole reply (prompt, then ``<start:assistant>``, then the reply's tokens: the same
  sequence the engine cached while generating);
- completions: a prompt that is the previous prompt + the generated text verbatim hits
  through it too (the filler starts with a space, so the previous prompt's last piece is
  unchanged unless it ends in a space, in which case that one piece differs);
- not hit: a reply the client edits, trims or re-serialises (hits stop at the first block
  that differs), and the final output token (never computed, as in vLLM).

Block hashes chain like vLLM's: ``h_i = H(h_{i-1}, tokens of block i)`` with a fixed seed
before block 0 (and ``cache_salt`` mixed into block 0 only, like vLLM's extra keys), H a
64-bit BLAKE2b, sent as unsigned 64-bit ints (vLLM's default wire form).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from collections.abc import Sequence
from random import Random
from typing import Any

VOCAB_SIZE = 128_000
FIRST_TEXT_ID = 256

BOS = 1
END = 2
_ROLE_IDS = {"system": 3, "developer": 4, "user": 5, "assistant": 6, "tool": 7, "function": 8}
TOOLS = 9

# One letter run cut every 4 letters with its leading space; digits by threes; punctuation
# runs by fours; whitespace that precedes a non-space leaves its last character to it.
_PIECE = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\s\w]{1,4}|\s+(?!\S)|\s+|_{1,4}|[\s\S]")

FILLER_WORDS = (
    "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat."
).split()

_NONE_HASH = hashlib.blake2b(b"sluice-simworker-none-hash", digest_size=8).digest()


class PromptError(ValueError):
    """A request whose prompt cannot be rendered; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def role_token(role: str) -> int:
    known = _ROLE_IDS.get(role)
    if known is not None:
        return known
    digest = hashlib.blake2b(role.encode("utf-8"), digest_size=4).digest()
    return 16 + int.from_bytes(digest, "big") % (FIRST_TEXT_ID - 16)


class PseudoTokenizer:
    """Deterministic across processes (no use of Python's salted ``hash``). Keeps a memo of
    piece → id; cleared when it grows past ``max_memo`` entries."""

    def __init__(self, max_memo: int = 1 << 18) -> None:
        self._ids: dict[str, int] = {}
        self._max_memo = max_memo
        self._word_pieces: dict[str, list[str]] = {}

    # -- text ------------------------------------------------------------------------

    @staticmethod
    def pieces(text: str) -> list[str]:
        return _PIECE.findall(text)

    def piece_id(self, piece: str) -> int:
        token = self._ids.get(piece)
        if token is None:
            digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            token = FIRST_TEXT_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_TEXT_ID)
            if len(self._ids) >= self._max_memo:
                self._ids.clear()
            self._ids[piece] = token
        return token

    def encode(self, text: str) -> list[int]:
        piece_id = self.piece_id
        return [piece_id(piece) for piece in _PIECE.findall(text)]

    # -- prompts ---------------------------------------------------------------------

    def render_chat(self, messages: Any, tools: Any = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, opening: bool = True,
                    param: str = "messages") -> list[int]:
        """``opening`` False renders turns that continue a conversation already rendered
        (a Responses API follow-up): no ``<bos>``, no tools. ``param`` names the field in
        errors."""
        if not isinstance(messages, list) or not messages:
            raise PromptError(f"'{param}' must be a non-empty list of message objects", param)
        tokens = [BOS] if opening else []
        if tools and opening:
            tokens.append(TOOLS)
            tokens += self.encode(canonical_json(tools))
            tokens.append(END)
        last = len(messages) - 1
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise PromptError(f"{param}[{index}] must be an object", f"{param}[{index}]")
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise PromptError(f"{param}[{index}].role must be a non-empty string",
                                  f"{param}[{index}].role")
            tokens.append(role_token(role))
            header = [f"{key}={message[key]}" for key in ("name", "tool_call_id")
                      if isinstance(message.get(key), str)]
            if header:
                tokens += self.encode(" ".join(header) + "\n")
            tokens += self._content(message.get("content"), f"{param}[{index}].content")
            if message.get("tool_calls"):
                tokens += self.encode(tool_calls_text(message["tool_calls"]))
            if message.get("function_call"):
                tokens += self.encode(canonical_json(message["function_call"]))
            if not (continue_final_message and index == last):
                tokens.append(END)
        if add_generation_prompt and not continue_final_message:
            tokens.append(role_token("assistant"))
        return tokens

    def _content(self, content: Any, param: str) -> list[int]:
        if content is None:
            return []
        if isinstance(content, str):
            return self.encode(content)
        if isinstance(content, list):
            tokens: list[int] = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    tokens += self.encode(part["text"])
                elif isinstance(part, str):
                    tokens += self.encode(part)
                else:  # images, audio, files: their JSON stands in for them
                    tokens += self.encode(canonical_json(part))
            return tokens
        raise PromptError(f"{param} must be a string, a list of parts or null", param)

    def render_completion(self, prompt: Any) -> list[int]:
        """``prompt``: a string, a list of token ids, or a one-element list of either
        (batched prompts are not served)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("'prompt' must not be empty", "prompt")
            return [BOS] + self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < VOCAB_SIZE), None)
            if bad is not None:
                raise PromptError(f"token id {bad} is out of vocabulary (0..{VOCAB_SIZE - 1})", "prompt")
            return list(prompt)
        raise PromptError("'prompt' must be a string or a list of token ids "
                          "(batched prompts are not served by the simworker)", "prompt")

    # -- output ----------------------------------------------------------------------

    def filler(self, n: int, start_word: int, *, leading_space: bool) -> tuple[list[int], list[str]]:
        """``n`` output tokens and their text pieces, from the word cycle at ``start_word``.
        ``"".join(pieces)`` tokenizes back to exactly these pieces."""
        out: list[str] = []
        words = FILLER_WORDS
        i = 0
        while len(out) < n:
            word = words[(start_word + i) % len(words)]
            text = word if i == 0 and not leading_space else " " + word
            cut = self._word_pieces.get(text)
            if cut is None:
                cut = self._word_pieces[text] = self.pieces(text)
            out += cut
            i += 1
        del out[n:]
        return [self.piece_id(piece) for piece in out], out


def tool_calls_text(tool_calls: Any) -> str:
    """How a message's ``tool_calls`` render: ``[{"arguments": ..., "name": ...}, ...]`` as
    canonical JSON, the arguments as the string the client sent (or whatever value it sent
    there). A call that is not an object renders as itself."""
    rendered = []
    for call in tool_calls if isinstance(tool_calls, list) else [tool_calls]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            rendered.append({"name": function.get("name"), "arguments": function.get("arguments")})
        else:
            rendered.append(call)
    return canonical_json(rendered)


def prompt_seed(prompt_tokens: Sequence[int], seed: int | None) -> int:
    """A 64-bit seed fixed by the prompt's last 64 tokens and the request's ``seed``: what a
    reproducible reply (``seed`` given, or greedy decoding) is drawn from."""
    data = array("I", prompt_tokens[-64:])
    if sys.byteorder != "little":
        data.byteswap()
    h = hashlib.blake2b(data.tobytes(), digest_size=8)
    if seed is not None:
        h.update(str(seed).encode())
    return int.from_bytes(h.digest(), "big")


def filler_sentence(rng: Random, words: int) -> str:
    """``words`` filler words from a point of the cycle drawn from ``rng``, the first one
    capitalised (a tool argument that a client runs as a shell command then names no
    program: the cycle holds ``sed`` and ``ex``)."""
    start = rng.randrange(len(FILLER_WORDS))
    picked = [FILLER_WORDS[(start + i) % len(FILLER_WORDS)] for i in range(max(1, words))]
    picked[0] = picked[0].capitalize()
    return " ".join(picked)


def block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained 64-bit hashes of every full block of ``tokens``."""
    data = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if sys.byteorder != "little":
        data = array("I", data)
        data.byteswap()
    raw = data.tobytes()
    width = block_size * data.itemsize
    parent = _NONE_HASH
    out: list[int] = []
    blake2b = hashlib.blake2b
    for i in range(len(tokens) // block_size):
        h = blake2b(parent, digest_size=8)
        h.update(raw[i * width:(i + 1) * width])
        if i == 0 and cache_salt is not None:
            h.update(b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))
        parent = h.digest()
        out.append(int.from_bytes(parent, "big"))
    return out
