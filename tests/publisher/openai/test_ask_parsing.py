"""A client's OpenAI body is read for the fields the face needs (``model``, the session,
``stream``, ``stream_options``) and nothing else: the conversation stays the client's bytes
and reaches the engine as sent. Before: the whole body was parsed into Python objects (a
64 MiB body of tiny values made tens of millions of them, over a gigabyte) before ``model``
was even looked at. Unit level, no I/O: :func:`parse_ask` and the engine body it feeds."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import msgspec
import pytest

from engines.openai_http import engine_body
from publisher.openai.admission import MAX_STREAM_OPTIONS_BYTES, BadRequest, parse_ask

MiB = 1024 * 1024


def ask_of(body: bytes, headers: dict[str, str] | None = None) -> Any:
    return parse_ask(
        body,
        headers or {},
        chat=True,
        alias="policy",
        max_body_bytes=64 * MiB,
        one_turn_prefix="gw",
    )


def test_the_conversation_is_never_built_as_python_objects() -> None:
    """8 MiB of empty objects in one message: parsed in a few KiB of Python allocations (the
    old parse made ~2.8 million dicts here, hundreds of MiB)."""
    content = b",".join([b"{}"] * (8 * MiB // 3))
    body = b'{"model": "nope", "messages": [{"role": "user", "content": [' + content + b"]}]}"
    tracemalloc.start()
    try:
        ask = ask_of(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ask.model == "nope"
    assert peak < 64 * 1024, peak
    assert isinstance(ask.fields["messages"], msgspec.Raw)


def test_the_engine_gets_the_clients_bytes_of_every_field_it_does_not_own() -> None:
    """Every field the gateway does not own reaches the engine byte for byte (spacing, key
    order and number spelling included); ``session_id`` never does; ``model`` and the
    engine's own fields are the gateway's; a stream asks for usage, keeping the client's
    other stream options."""
    messages = '[{"content": "1.50e2 \\u00e9", "role": "user",   "n": 1.0}]'
    body = (
        '{"model": "policy", "session_id": "s1", "messages": ' + messages + ', "temperature": '
        '0.70, "stream": true, "stream_options": {"continuous_usage_stats": true}, "rid": "x"}'
    )
    ask = ask_of(body.encode())
    assert (ask.session, ask.one_turn, ask.stream, ask.wants_usage) == ("s1", False, True, False)
    sent = msgspec.json.encode(
        engine_body(
            ask.fields,
            kind="sglang",
            lora_name="policy@v1",
            request_id="r1",
            cache_salt="salt",
            stream=ask.stream,
            include_usage=True,
        )
    )
    assert b'"messages":' + messages.encode() in sent
    assert b'"temperature":0.70' in sent
    decoded = json.loads(sent)
    assert "session_id" not in decoded
    assert decoded["model"] == decoded["lora_path"] == "policy@v1" and decoded["rid"] == "r1"
    assert decoded["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[1, 2]", "JSON object"),
        (b'{"model": "policy", ', "not JSON"),
        (b'{"model": "policy", "messages": [NaN]}', "JSON"),
        ('{"model": "policy", "messages": "\u00e9"}'.encode("latin-1"), "not UTF-8"),
        (b'{"messages": []}', "model is required"),
        (b'{"model": ["policy"]}', "model"),
        (b'{"model": "policy", "session_id": 5}', "session id"),
        (b'{"model": "policy", "stream": "yes"}', "stream"),
        (b'{"model": "policy", "stream_options": {"include_usage": 1}}', "include_usage"),
        (
            b'{"model": "policy", "stream_options": {"a": "'
            + b"x" * MAX_STREAM_OPTIONS_BYTES
            + b'"}}',
            "stream_options",
        ),
    ],
)
def test_the_fields_the_face_reads_are_refused_by_name(body: bytes, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        ask_of(body)


def test_text_in_utf_8_passes_whole_and_split_across_chunks() -> None:
    """The UTF-8 check reads non-ASCII bodies a chunk at a time: a character cut by a chunk's
    end is still one character."""
    text = "é" * (1024 * 1024 // 2 + 1) + "中"
    body = json.dumps({"model": "policy", "prompt": text}, ensure_ascii=False).encode()
    assert not body.isascii()
    assert json.loads(bytes(ask_of(body).fields["prompt"])) == text


def test_a_session_header_wins_over_the_body_and_an_empty_one_is_none() -> None:
    body = b'{"model": "policy", "session_id": "from-body"}'
    assert ask_of(body, {"x-session-id": "from-header"}).session == "from-header"
    one_turn = ask_of(b'{"model": "policy", "session_id": null}', {"x-session-id": ""})
    assert one_turn.one_turn and one_turn.session.startswith("gw-once-")
