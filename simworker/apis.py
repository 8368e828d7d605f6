"""What the simworker's APIs share. Each API is its own module, in vLLM 0.32's shapes:
simworker/openai_completions.py (OpenAI chat completions and completions),
simworker/anthropic_messages.py (Anthropic Messages) and simworker/openai_responses.py (OpenAI
Responses); this module holds the refusals they word alike (an empty conversation, media on a
text-only model), the count of a conversation's tool results and the framing of a named
server-sent event.

Messages and Responses drive the same engine model as chat completions (simworker/worker.py):
the request is turned into chat messages as vLLM 0.32 turns it
(``vllm/entrypoints/anthropic/serving.py`` ``to_chat_completion_request``,
``vllm/entrypoints/openai/responses/utils.py`` ``construct_chat_messages_with_tool_call``) and
rendered by the same pseudo-tokenizer, so a reply sent back verbatim hits the prefix cache
through the reply, exactly as in chat.

Output length, Messages and Responses: the reply's own length is the worker's
``default_max_tokens``; ``max_tokens`` / ``max_output_tokens`` cut it (Anthropic ``stop_reason`` "max_tokens",
Responses ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens"),
otherwise it ends by itself ("end_turn", "completed"). A tool-call reply (simworker/
tool_calls.py) is a ``tool_use`` block with ``stop_reason`` "tool_use", or a ``function_call``
output item; streamed as vLLM streams them (``content_block_start`` with the ``tool_use``
block, then ``input_json_delta``\\ s; ``response.output_item.added``, then
``response.function_call_arguments.delta``\\ s and ``.done``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from simworker.calls import BadRequest

_encode = msgspec.json.Encoder().encode

EMPTY_CONVERSATION = ("Cannot apply chat template to an empty conversation. Provide at least one "
                      "message.")
# Content parts a text-only model refuses (vLLM's chat parser would hand them to a
# multimodal processor the model does not have).
MEDIA_PART_TYPES = frozenset({"image_url", "image", "input_image", "image_pil", "image_embeds",
                              "input_audio", "audio_url", "audio_embeds", "video_url", "input_file",
                              "file"})


def sse_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` line, as Messages and Responses send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def refuse_media(messages: list[dict[str, Any]], model: str) -> None:
    """vLLM's answer to an image (or audio, video, file) part on a text-only model."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES
                                             for part in content):
            raise BadRequest(f"{model} is not a multimodal model")


def count_tool_results(messages: list[dict[str, Any]]) -> int:
    return sum(1 for message in messages if message.get("role") == "tool")
