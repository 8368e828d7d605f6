"""The frames relays and the policy process exchange (controller/relay_wire.py): cut anywhere
by the byte stream, bounded, and every ask decodes as what was sent."""

from __future__ import annotations

import msgspec
import pytest
from controller.admission import Admitted
from controller.conversations import AnswerKey
from controller.relay_wire import (
    HEAD_BYTES,
    Admit,
    AdmitAnswer,
    Answer,
    Ask,
    ContinueConversation,
    FrameReader,
    FrameTooLarge,
    HttpRequest,
    frame,
)
from hypothesis import given
from hypothesis import strategies as st
from scheduler.calls import CallHints, CallRequest
from scheduler.coordinates import mint_chain


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=20), st.data())
def test_frames_come_out_whole_and_in_order_however_the_stream_is_cut(payloads, data):
    stream = b"".join(frame(n + 1, payload) for n, payload in enumerate(payloads))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    reader = FrameReader(limit=300)
    out = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        out += reader.feed(stream[start:end])
    assert out == [(n + 1, payload) for n, payload in enumerate(payloads)]


def test_a_frame_past_the_bound_is_refused_before_its_payload_arrives():
    reader = FrameReader(limit=100)
    with pytest.raises(FrameTooLarge):
        reader.feed(frame(1, b"x" * 101)[:HEAD_BYTES])  # the head alone says too much


def test_every_ask_decodes_as_the_ask_that_was_sent():
    chain = mint_chain("m", None, None, [{"role": "user", "content": "hi"}])
    asks = [
        Admit(CallRequest("r1", "s", 12, "parent", chain, (4, 12), None, True, "g",
                          CallHints(priority=2, deadline_s=3.0), True)),
        ContinueConversation("g", AnswerKey("prefix", "fp"), "head", "key-a", "fresh"),
        HttpRequest("GET", "/sluice/programs", b"a=1", [(b"authorization", b"Bearer x")], b"",
                    ("127.0.0.1", 5000)),
    ]
    decode = msgspec.msgpack.Decoder(Ask).decode
    assert [decode(msgspec.msgpack.encode(ask)) for ask in asks] == asks
    answer = Answer(msgspec.Raw(msgspec.msgpack.encode(
        AdmitAnswer(Admitted("w0", 1.5, 2.0, 0.25), "http://127.0.0.1:1", 3))))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(answer), type=Answer)
    assert msgspec.msgpack.decode(back.value, type=AdmitAnswer).admitted == Admitted("w0", 1.5, 2.0, 0.25)
