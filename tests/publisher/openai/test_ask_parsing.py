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


def test_the_bounds_of_a_body_a_session_id_and_a_request_id_are_inclusive() -> None:
    body = b'{"model": "policy"}'
    assert parse_ask(
        body, {}, chat=True, alias="policy", max_body_bytes=len(body), one_turn_prefix="gw"
    )
    with pytest.raises(BadRequest, match=f"over {len(body) - 1} bytes"):
        parse_ask(
            body, {}, chat=True, alias="policy", max_body_bytes=len(body) - 1, one_turn_prefix="gw"
        )
    assert ask_of(body, {"x-session-id": "s" * 256}).session == "s" * 256
    for session in ("s" * 257, "tab\there"):
        with pytest.raises(BadRequest, match="1-256 printable"):
            ask_of(body, {"x-session-id": session})
    assert ask_of(body, {"x-request-id": "r" * 128}).request_id == "r" * 128
    assert ask_of(body, {"x-request-id": "r"}).request_id == "r"
    for rid in ("r" * 129, "run-é", "line\nbreak"):
        with pytest.raises(BadRequest, match="x-request-id must be 1-128 printable ASCII"):
            ask_of(body, {"x-request-id": rid})


def test_a_body_that_is_not_utf_8_anywhere_is_refused_as_such() -> None:
    """At its first byte, at its last (a character cut at the end) or in a later chunk."""
    for raw in (
        b'\xff{"model": "policy"}',
        b'{"model": "policy"}\xc3',
        b'{"model": "policy", "prompt": "' + "é".encode() * (1024 * 1024) + b'\xff"}',
    ):
        with pytest.raises(BadRequest, match="not UTF-8"):
            ask_of(raw)


def test_the_ids_a_request_is_answered_and_sent_under() -> None:
    """The client's ``x-request-id`` is echoed; the engine gets it with a 12-character suffix
    of its own (two running requests of one id are two requests to it); without one, a new
    id serves both. A one-turn session is named after the gateway and a new uuid."""
    body = b'{"model": "policy"}'
    given = ask_of(body, {"x-request-id": "trace-1"})
    assert given.request_id == "trace-1"
    prefix, _, suffix = given.engine_request_id.rpartition("-")
    assert prefix == "trace-1" and len(suffix) == 12 and int(suffix, 16) >= 0
    assert ask_of(body, {"x-request-id": "trace-1"}).engine_request_id != given.engine_request_id
    made = ask_of(body)
    assert len(made.request_id) == 32 and made.engine_request_id == made.request_id
    assert ask_of(body, {"x-request-id": ""}).request_id != ""
    assert made.one_turn and made.session.startswith("gw-once-")
    assert len(made.session) == len("gw-once-") + 32
    assert ask_of(body).session != made.session and not ask_of(body, {"x-session-id": "s"}).one_turn


def test_stream_and_its_options_are_read_and_a_null_option_is_not_sent() -> None:
    plain = ask_of(b'{"model": "policy"}')
    assert (plain.stream, plain.wants_usage, plain.chat) == (False, False, True)
    assert set(plain.fields) == {"model"}
    null = ask_of(b'{"model": "policy", "stream": true, "stream_options": null}')
    assert (null.stream, null.wants_usage) == (True, False) and "stream_options" not in null.fields
    usage = ask_of(
        b'{"model": "policy", "stream": true, "stream_options": {"include_usage": true}}'
    )
    assert usage.wants_usage and set(usage.fields["stream_options"]) == {"include_usage"}
    off = ask_of(b'{"model": "policy", "stream_options": {"include_usage": false}}')
    assert not off.wants_usage and "stream_options" in off.fields
    completions = parse_ask(
        b'{"model": "v"}', {}, chat=False, alias="policy", max_body_bytes=99, one_turn_prefix="g"
    )
    assert not completions.chat and completions.model == "v"
