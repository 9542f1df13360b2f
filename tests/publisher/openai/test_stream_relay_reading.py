"""What the streaming relay reads of an engine's reply, unit level (no sockets): which SSE event
is an engine's error, what a reply's usage says for its provenance row, and what the client is
sent of a stream, event by event.

The engine's reply here is an ``httpx.Response`` over a fixed list of byte chunks, cut where a
socket may cut them (inside an event, between its two newlines), in the shapes vLLM and SGLang
send (``data: {...}`` events, the usage chunk with ``"choices":[]``, ``data: [DONE]``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engines.contract import ErrorCode
from publisher.core.outcomes import Bound
from publisher.openai.admission import Ask, parse_ask
from publisher.openai.relay import (
    EngineRoute,
    UsageReader,
    _event_json,
    _headers_for,
    _refusal,
    _relay_stream,
    _stream_error,
)

pytestmark = pytest.mark.anyio

_CHUNK = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"policy@v1","choices":'
    b'[{"index":0,"delta":{"content":"hel"},"finish_reason":null}]}'
)
_FINISH = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"policy@v1","choices":'
    b'[{"index":0,"delta":{},"finish_reason":"length"}]}'
)
_USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"policy@v1","choices":[],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}'
)
_DONE = b"data: [DONE]"


def ask(*, usage: bool) -> Ask:
    options = ', "stream_options": {"include_usage": true}' if usage else ""
    body = '{"model": "policy", "stream": true' + options + "}"
    return parse_ask(
        body.encode(),
        {"x-session-id": "s1", "x-request-id": "rid-1"},
        chat=True,
        alias="policy",
        max_body_bytes=1 << 20,
        one_turn_prefix="gw",
    )


def reply(*chunks: bytes) -> httpx.Response:
    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return httpx.Response(200, content=stream())


async def relay(
    *chunks: bytes, usage: bool = False
) -> tuple[str | None, list[dict[str, Any]], UsageReader]:
    """The outcome of relaying ``chunks``, every ASGI message sent, and what was read."""
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    reader = UsageReader()
    outcome = await _relay_stream(ask(usage=usage), reply(*chunks), reader, send, "e1")
    return outcome, sent, reader


def events_of(sent: list[dict[str, Any]]) -> list[bytes]:
    body = b"".join(m["body"] for m in sent)
    return [e for e in body.split(b"\n\n") if e.strip()]


def test_an_event_is_an_engines_error_only_when_it_has_an_error_and_no_choices() -> None:
    """vLLM and SGLang fail mid-stream with ``data: {"error": ...}``: an error even when its
    error is null. A completion chunk is never one, whatever it says or carries besides."""
    assert _stream_error(b'data: {"error": {"message": "EngineCore died"}}') == {
        "message": "EngineCore died"
    }
    assert _stream_error(b'data: {"error": null}') is not None
    says_error = b'data: {"choices":[{"index":0,"delta":{"content":"error"}}]}'
    assert _stream_error(says_error) is None
    carries_error = b'data: {"error":null,"choices":[{"index":0,"delta":{"content":"a"}}]}'
    assert _stream_error(carries_error) is None
    assert _stream_error(b"data: [DONE]") is None


def test_the_usage_reader_keeps_the_engines_counts_its_finish_and_the_first_model() -> None:
    reader = UsageReader()
    reader.read(json.loads(_CHUNK[6:]))
    reader.read({"model": "another", "choices": [{"finish_reason": "length"}]})
    reader.read(json.loads(_USAGE[6:]))
    reader.read(["not", "a", "reply"])
    usage = reader.usage("length")
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (7, 3, 4)
    assert (usage.finish_reason, usage.served_name) == ("length", "policy@v1")
    assert reader.finish == "length"
    empty = UsageReader()
    empty.read(
        {
            "usage": {"prompt_tokens": None, "prompt_tokens_details": {"cached_tokens": None}},
            "choices": [{"finish_reason": None}, "x"],
        }
    )
    assert (empty.prompt, empty.completion, empty.cached, empty.finish) == (0, 0, 0, "")


def test_an_events_json_is_its_data_line_whatever_lines_come_before() -> None:
    assert _event_json(b'id: 7\nevent: chunk\ndata: {"a": 1}') == {"a": 1}
    assert _event_json(b"data: {broken") is None
    assert _event_json(b": a comment") is None


async def test_a_whole_stream_is_relayed_as_it_came_and_the_usage_chunk_only_when_asked() -> None:
    cut = _CHUNK + b"\n\n" + _FINISH[:20]  # an event cut by a read waits for its end
    chunks = (cut, _FINISH[20:] + b"\n", b"\n" + _USAGE + b"\n\n", _DONE + b"\n\n")
    outcome, sent, reader = await relay(*chunks)
    assert outcome is None
    assert events_of(sent) == [_CHUNK, _FINISH, _DONE]  # the usage chunk not asked for
    assert all(m["type"] == "http.response.body" for m in sent)
    assert sent[-1]["more_body"] is False and all(m["more_body"] for m in sent[:-1])
    assert (reader.prompt, reader.completion, reader.finish) == (7, 3, "length")
    outcome, sent, reader = await relay(*chunks, usage=True)
    assert outcome is None and events_of(sent) == [_CHUNK, _FINISH, _USAGE, _DONE]


async def test_events_of_one_read_are_all_relayed_past_a_dropped_usage_chunk() -> None:
    one_read = _CHUNK + b"\n\n" + _USAGE + b"\n\n" + _DONE + b"\n\n"
    outcome, sent, reader = await relay(one_read)
    assert outcome is None and events_of(sent) == [_CHUNK, _DONE]
    assert reader.completion == 3


async def test_done_without_its_blank_line_still_ends_the_stream() -> None:
    outcome, sent, _ = await relay(_CHUNK + b"\n\n", _FINISH + b"\n\n", _DONE)
    assert outcome is None
    assert events_of(sent) == [_CHUNK, _FINISH, _DONE]
    assert sent[-1] == {"type": "http.response.body", "body": _DONE, "more_body": False}


async def test_an_error_event_is_relayed_once_and_the_row_says_engine_error() -> None:
    error = b'data: {"error":{"message":"EngineCore died","code":500}}'
    outcome, sent, _ = await relay(_CHUNK + b"\n\n" + error + b"\n\n", _DONE + b"\n\n")
    assert outcome == "engine_error"
    assert events_of(sent) == [_CHUNK, error, _DONE]
    # the first error decides: a later chunk whose text is "error" does not undo it
    says_error = b'data: {"choices":[{"index":0,"delta":{"content":"error"}}]}'
    outcome, _, _ = await relay(error + b"\n\n", says_error + b"\n\n", _DONE + b"\n\n")
    assert outcome == "engine_error"


async def test_a_stream_cut_before_done_ends_with_an_ambiguous_error_event() -> None:
    outcome, sent, _ = await relay(_CHUNK + b"\n\n", _FINISH + b"\n\n")
    assert outcome == "ambiguous"
    *relayed, last = events_of(sent)
    assert relayed == [_CHUNK, _FINISH]
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "AMBIGUOUS_DISPATCH" and "rid-1" in error["message"]
    assert "e1" in error["message"] and "not resent" in error["message"]
    assert sent[-1].get("more_body", False) is False


async def test_a_stream_cut_inside_an_event_sends_the_client_whole_events_only() -> None:
    """A half event is no event (an SSE client dispatches an event at its blank line): the cut
    tail is dropped, so the error event is its own line, parsed by the client's SDK, never glued
    to half a JSON chunk."""
    outcome, sent, _ = await relay(_CHUNK + b"\n\n", _FINISH[:30])
    assert outcome == "ambiguous"
    relayed, last = events_of(sent)
    assert relayed == _CHUNK
    assert last.startswith(b"data: {")
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "AMBIGUOUS_DISPATCH"


async def test_the_served_name_is_read_from_the_first_event_that_has_one() -> None:
    first = b'data: {"id":"c1","model":"policy@v1","choices":[{"index":0,"delta":{}}]}'
    _, _, reader = await relay(first + b"\n\n", _DONE + b"\n\n")
    assert reader.served == "policy@v1"


async def test_an_engines_refusal_is_read_by_its_own_adapters_rule() -> None:
    """vLLM's 404 "The model `<name>` does not exist." is ``NOT_LOADED`` only for a vLLM
    engine and only for the adapter that was asked for; a body that is not JSON keeps the
    engine's status alone."""
    vllm = EngineRoute(engine_id="v1", kind="vllm", base_url="http://127.0.0.1:1")
    missing = {
        "error": {
            "message": "The model `policy@v1` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    refusal = await _refusal(httpx.Response(404, json=missing), vllm, "policy@v1")
    assert (refusal.code, refusal.status, refusal.engine_id) == (ErrorCode.NOT_LOADED, 404, "v1")
    other = await _refusal(httpx.Response(404, json=missing), vllm, "policy@v2")
    assert other.code == "404"
    local = EngineRoute(engine_id="e1", kind="local", base_url="http://127.0.0.1:1")
    assert (await _refusal(httpx.Response(404, json=missing), local, "policy@v1")).code == "404"
    garbled = await _refusal(httpx.Response(400, content=b"<html>"), vllm, "policy@v1")
    assert (garbled.code, garbled.message, garbled.status) == ("", "HTTP 400", 400)


def test_the_reply_carries_its_provenance_headers_before_the_first_byte() -> None:
    bound = Bound(
        session="s1", version_id=3, lora_name="policy@v3", digest="d3", revision=3, new=False
    )
    route = EngineRoute(engine_id="e1", kind="local", base_url="http://127.0.0.1:1")
    sse = httpx.Response(200, headers={"content-type": "text/event-stream"})
    assert _headers_for(ask(usage=False), bound, route, 2, sse) == [
        (b"content-type", b"text/event-stream"),
        (b"x-loraledger-version", b"3"),
        (b"x-loraledger-digest", b"d3"),
        (b"x-loraledger-engine", b"e1"),
        (b"x-loraledger-staleness", b"2"),
        (b"x-request-id", b"rid-1"),
        (b"x-session-id", b"s1"),
        (b"cache-control", b"no-cache"),
    ]
    one_turn = parse_ask(
        b'{"model": "policy"}',
        {"x-request-id": "rid-2"},
        chat=False,
        alias="policy",
        max_body_bytes=1 << 20,
        one_turn_prefix="gw",
    )
    assert _headers_for(one_turn, bound, route, 0, httpx.Response(200)) == [
        (b"content-type", b"application/json"),  # the engine said nothing: JSON
        (b"x-loraledger-version", b"3"),
        (b"x-loraledger-digest", b"d3"),
        (b"x-loraledger-engine", b"e1"),
        (b"x-loraledger-staleness", b"0"),
        (b"x-request-id", b"rid-2"),
    ]
