"""The guard's rules, each stated on the guard itself (in process, no server): how a token file
is read, which tokens a header can carry, how a refusal is answered, which requests are refused
before a handler runs, and the connection limits handed to uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import locale
import logging
import resource
import socket
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn
import uvicorn.server
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engines import guard
from engines.guard import (
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
    BodyTooLarge,
    Guard,
    check_token,
    connection_cap,
    exception_handlers,
    guarded_protocol,
    is_loopback,
    read_token,
    token_lines,
    uvicorn_limits,
)
from tests.engines.test_guard_drain import _Quiet, _to_close


def test_a_token_file_gives_the_first_field_of_its_first_line_that_is_not_blank_or_a_comment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rest of the line (a note) and later lines (a rotated token kept for the record) are
    never sent; the file wins over the environment."""
    path = tmp_path / "token"
    path.write_text("\n   \n# the operator's token\n  s3cret-1 rotated 2026-12-01\nold-token\n")
    monkeypatch.setenv("SOME_TOKEN", "from-env")
    assert read_token("SOME_TOKEN", path) == "s3cret-1"
    assert list(token_lines(path.read_text())) == [
        (4, ["s3cret-1", "rotated", "2026-12-01"]),
        (5, ["old-token"]),
    ]


def test_a_token_file_that_holds_no_token_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("\n# a comment only\n   \n")
    with pytest.raises(ValueError, match="holds no token") as caught:
        read_token("SOME_TOKEN", path)
    assert str(caught.value) == (
        f"token file {path} is empty: it holds no token (only blanks or # comments)"
    )


@pytest.mark.parametrize("token", ["!", "~", "a!b~c", "0Az-._~+/="])
def test_every_visible_ascii_character_may_be_in_a_token(token: str) -> None:
    check_token(token, "here")


@pytest.mark.parametrize("token", ["a b", "tab\there", "del\x7f", "nul\x00", "caf\u00e9", "\x01"])
def test_a_token_a_header_cannot_carry_is_refused_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    with pytest.raises(ValueError, match="an HTTP header cannot carry it") as caught:
        check_token(token, "the source")
    message = str(caught.value)
    assert message == (
        f"the source: the token holds a space, a control character or non-ASCII "
        f"({len(token)} characters, not shown): an HTTP header cannot carry it"
    )
    if "\x00" not in token:  # no environment variable holds a NUL
        monkeypatch.setenv("SOME_TOKEN", token)
        with pytest.raises(ValueError, match=r"^\$SOME_TOKEN: the token holds"):
            read_token("SOME_TOKEN", None)
    if token.split() == [token]:  # a blank splits a file's line into fields
        path = tmp_path / "token"
        path.write_text(token + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=f"^token file {path}: the token holds"):
            read_token("SOME_TOKEN", path)


def test_without_a_file_the_token_comes_from_the_environment_and_an_empty_one_is_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SOME_TOKEN", "from-env")
    assert read_token("SOME_TOKEN", None) == "from-env"
    monkeypatch.setenv("SOME_TOKEN", "")
    assert read_token("SOME_TOKEN", None) is None
    monkeypatch.delenv("SOME_TOKEN")
    assert read_token("SOME_TOKEN", None) is None


def test_a_token_file_is_read_as_utf_8(tmp_path: Path) -> None:
    """A non-ASCII token is refused as such (not as an undecodable file), whatever the locale."""
    path = tmp_path / "token"
    path.write_bytes("caf\u00e9\n".encode())
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # the locale's encoding is now ASCII
    try:
        with pytest.raises(ValueError, match="4 characters"):
            read_token("SOME_TOKEN", path)
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)


def test_token_lines_number_every_line_from_one_and_skip_blanks_and_comments() -> None:
    text = "# head\nalpha 1\n\n  #indented comment\nbeta#not-a-comment\n \t \ngamma"
    assert list(token_lines(text)) == [
        (2, ["alpha", "1"]),
        (5, ["beta#not-a-comment"]),
        (7, ["gamma"]),
    ]


# --- the connection limits ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("soft", "wanted", "cap"),
    [(100_000, 1000, 1000), (1064, 1000, 1000), (1063, 1000, 999), (100, 1000, 36), (72, 1000, 8),
     (10, 1000, 8), (10, 5, 5)],
)  # fmt: skip
def test_the_connection_cap_keeps_64_descriptors_free_and_at_least_8_connections(
    monkeypatch: pytest.MonkeyPatch, soft: int, wanted: int, cap: int
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    assert connection_cap(wanted) == cap


def test_the_connection_cap_is_the_wanted_one_without_a_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = []

    def getrlimit(which: int) -> tuple[int, int]:
        asked.append(which)
        return (resource.RLIM_INFINITY, resource.RLIM_INFINITY)

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    assert connection_cap() == MAX_CONNECTIONS == 1000
    assert asked == [resource.RLIMIT_NOFILE]

    def unknown(which: int) -> tuple[int, int]:
        raise OSError("no limit here")

    monkeypatch.setattr(resource, "getrlimit", unknown)
    assert connection_cap(123) == 123


def test_uvicorn_is_given_the_guarded_protocol_and_the_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1000, resource.RLIM_INFINITY))
    made = []

    def protocol(**limits: Any) -> type[Any]:
        made.append(limits)
        return guarded_protocol(**limits)

    monkeypatch.setattr(guard, "guarded_protocol", protocol)
    limits = uvicorn_limits(max_connections=5000, header_timeout_s=3.5)
    assert made == [{"max_connections": 936, "header_timeout_s": 3.5}]  # 1000 - 64 descriptors
    assert limits["timeout_keep_alive"] == KEEP_ALIVE_S == 5
    assert limits["h11_max_incomplete_event_size"] == MAX_HEADER_BYTES == 64 * 1024
    assert issubclass(limits["http"], H11Protocol)
    assert HEADER_TIMEOUT_S == 10.0


# --- the checks before a handler, on the ASGI middleware itself ---------------------------------

CAP = 10
TOKEN = "s3cret"


def _shape(code: str, message: str) -> Any:
    return {"code": code, "message": message}


def _other_shape(code: str, message: str) -> Any:
    return {"error": {"code": code, "message": message}}


class _Exchange:
    """One request through a :class:`Guard` around a handler that reads its body and answers
    200 with its length: the body's parts as the client sends them, every ``receive`` the guard
    or the handler made, everything sent back."""

    def __init__(
        self, parts: list[bytes], *, then_disconnect: bool = False, then_silence: bool = False
    ) -> None:
        """``then_disconnect``: the client goes after its parts; ``then_silence``: it says
        more is coming and never sends it. Otherwise the last part ends the body, as ASGI
        allows, by leaving ``more_body`` out."""
        self.messages: list[Message] = [
            {"type": "http.request", "body": part, "more_body": True} for part in parts
        ]
        if then_disconnect:
            self.messages.append({"type": "http.disconnect"})
        elif not then_silence:
            del self.messages[-1]["more_body"]
        self.silent = then_silence
        self.received = 0  # messages handed out
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        if self.received >= len(self.messages) and self.silent:
            await anyio.sleep_forever()
        if self.received >= len(self.messages):
            raise AssertionError("read past the end of the client's body")
        self.received += 1
        return self.messages[self.received - 1]

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


async def _handler(scope: Scope, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": json.dumps(len(body)).encode()})


def _guard(app: ASGIApp = _handler, **options: Any) -> Guard:
    settings: dict[str, Any] = {
        "token": TOKEN,
        "protected": lambda path: path.startswith("/private"),
        "cap": lambda path: CAP,
        "error_body": _shape,
    }
    return Guard(app, **(settings | options))


def _scope(path: str = "/open", **headers: str) -> Scope:
    raw = [
        (name.replace("_", "-").title().encode(), value.encode()) for name, value in headers.items()
    ]
    return {"type": "http", "path": path, "headers": raw}


async def _through(guard: Guard, scope: Scope, exchange: _Exchange) -> _Exchange:
    await guard(scope, exchange.receive, exchange.send)
    return exchange


REFUSAL_HEADERS = {
    b"content-type": b"application/json",
    b"connection": b"close",
    b"x-should-retry": b"false",
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "authorization", [None, "", "Bearer", "Bearer ", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
                      f"Bearer{TOKEN}", f"Token {TOKEN}"],
)  # fmt: skip
async def test_a_protected_path_without_the_bearer_token_is_refused_401_before_the_handler(
    authorization: str | None,
) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    done = await _through(_guard(), _scope("/private/x", **headers), _Exchange([b"{}"]))
    assert done.received == 0
    assert done.status == 401
    assert done.headers == REFUSAL_HEADERS | {b"www-authenticate": b'Bearer realm="loraledger"'}
    assert [m["type"] for m in done.sent] == ["http.response.start", "http.response.body"]
    assert done.body == {
        "code": "UNAUTHORIZED",
        "message": "a valid bearer token is required for this route",
    }


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_bearer_scheme_is_read_in_any_case(scheme: str) -> None:
    scope = _scope("/private/x", authorization=f"{scheme} {TOKEN}")
    done = await _through(_guard(), scope, _Exchange([b"abc"]))
    assert (done.status, done.body) == (200, 3)


@pytest.mark.anyio
async def test_only_protected_paths_need_the_token_and_none_when_the_server_has_none() -> None:
    done = await _through(_guard(), _scope("/open"), _Exchange([b"abc"]))
    assert (done.status, done.body) == (200, 3)
    for token in (None, ""):
        done = await _through(_guard(token=token), _scope("/private/x"), _Exchange([b"ab"]))
        assert (done.status, done.body) == (200, 2)


@pytest.mark.anyio
async def test_a_scope_other_than_http_passes_untouched() -> None:
    seen: list[tuple[Scope, Message]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope, await receive()))
        await send({"type": "lifespan.startup.complete"})

    scope = {"type": "lifespan", "path": "/private/x", "headers": []}
    done = await _through(_guard(app), scope, _Exchange([b"as sent"]))
    assert seen == [(scope, {"type": "http.request", "body": b"as sent"})]
    assert done.sent == [{"type": "lifespan.startup.complete"}]


@pytest.mark.anyio
async def test_the_handler_gets_the_request_s_scope() -> None:
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)
        await _handler(scope, receive, send)

    scope = _scope("/private/x", authorization=f"Bearer {TOKEN}")
    done = await _through(_guard(app), scope, _Exchange([b"ab"]))
    assert (done.status, seen) == (200, [scope])


@pytest.mark.anyio
@pytest.mark.parametrize("declared", ["abc", "-1", "1.0", " 5", "0" * 19, "9" * 19])
async def test_a_content_length_that_is_not_a_byte_count_is_refused_400(declared: str) -> None:
    done = await _through(_guard(), _scope(content_length=declared), _Exchange([b"{}"]))
    assert done.received == 0
    assert done.status == 400
    assert done.headers == REFUSAL_HEADERS
    assert done.body == {"code": "BAD_JSON", "message": "Content-Length is not a byte count"}


@pytest.mark.anyio
async def test_a_declared_length_of_18_digits_up_to_the_cap_is_read() -> None:
    done = await _through(_guard(), _scope(content_length="0" * 17 + "3"), _Exchange([b"abc"]))
    assert (done.status, done.body) == (200, 3)
    done = await _through(_guard(), _scope(content_length=str(CAP)), _Exchange([b"x" * CAP]))
    assert (done.status, done.body) == (200, CAP)


@pytest.mark.anyio
async def test_a_body_declared_over_the_cap_is_refused_413_unread_on_a_plain_path() -> None:
    done = await _through(_guard(), _scope(content_length=str(CAP + 1)), _Exchange([b"x" * 11]))
    assert done.received == 0
    assert done.status == 413
    assert done.headers == REFUSAL_HEADERS
    assert done.body == {
        "code": "BODY_TOO_LARGE",
        "message": f"request body over {CAP} bytes for /open",
    }
    assert [m.get("more_body", False) for m in done.sent[1:]] == [False]


def _draining(**options: Any) -> Guard:
    return _guard(drains=lambda path: path == "/drain", **options)


@pytest.mark.anyio
async def test_a_body_declared_over_the_cap_on_a_draining_path_is_read_after_the_413() -> None:
    parts = [b"x" * 8, b"x" * 8, b"x" * 4]  # 20 bytes: twice the cap, the most drained
    done = await _through(_draining(), _scope("/drain", content_length="20"), _Exchange(parts))
    assert done.status == 413
    assert done.received == 3
    assert [m.get("more_body", False) for m in done.sent[1:]] == [True, False]
    assert done.sent[-1]["body"] == b""
    assert done.body["code"] == "BODY_TOO_LARGE"


@pytest.mark.anyio
async def test_a_drain_ends_with_the_body() -> None:
    parts = [b"x" * 8, b"x" * 7]  # 15 bytes declared and sent: less than the budget
    done = await _through(_draining(), _scope("/drain", content_length="15"), _Exchange(parts))
    assert (done.status, done.received) == (413, 2)


@pytest.mark.anyio
async def test_a_body_declared_over_twice_the_cap_is_not_drained() -> None:
    parts = [b"x" * 8, b"x" * 8, b"x" * 5]
    done = await _through(_draining(), _scope("/drain", content_length="21"), _Exchange(parts))
    assert (done.status, done.received) == (413, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("expect", ["100-continue", "100-Continue"])
async def test_a_client_waiting_for_100_continue_is_refused_on_its_length_unread(
    expect: str,
) -> None:
    scope = _scope("/drain", content_length="20", expect=expect)
    done = await _through(_draining(), scope, _Exchange([b"x" * 20]))
    assert (done.status, done.received) == (413, 0)


@pytest.mark.anyio
async def test_a_drain_stops_when_the_client_goes() -> None:
    scope = _scope("/drain", content_length="20")
    done = await _through(_draining(), scope, _Exchange([b"x" * 4], then_disconnect=True))
    assert (done.status, done.received) == (413, 2)
    assert done.sent[-1] == {"type": "http.response.body", "body": b""}


@pytest.mark.anyio
async def test_a_drain_reads_no_more_than_its_budget_of_a_body_longer_than_declared() -> None:
    """Once twice the cap is read the drain stops, though the client says more is coming."""
    parts = [b"x" * 10, b"x" * 10, b"x" * 1, b"x"]  # a client that lies about its length
    done = await _through(_draining(), _scope("/drain", content_length="20"), _Exchange(parts))
    assert (done.status, done.received) == (413, 2)


@pytest.mark.anyio
async def test_an_undeclared_body_is_cut_off_at_the_cap_and_refused_413() -> None:
    done = await _through(_guard(), _scope(), _Exchange([b"x" * 6, b"x" * 5, b"x" * 5]))
    assert done.status == 413
    assert done.received == 2  # the part that passed the cap, no more on a plain path
    assert done.body == {
        "code": "BODY_TOO_LARGE",
        "message": f"request body over {CAP} bytes for /open",
    }
    exact = await _through(_guard(), _scope(), _Exchange([b"x" * 6, b"x" * 4]))
    assert (exact.status, exact.body) == (200, CAP)


@pytest.mark.anyio
async def test_an_undeclared_body_over_the_cap_on_a_draining_path_is_read_up_to_twice_the_cap() -> (
    None
):
    parts = [b"x" * 6, b"x" * 5, b"x" * 5, b"x" * 4, b"x"]
    done = await _through(_draining(), _scope("/drain"), _Exchange(parts))
    assert done.status == 413
    assert done.received == 4  # 6 + 5 went over; 5 + 4 more drained: 20 bytes, the budget
    assert [m.get("more_body", False) for m in done.sent[1:]] == [True, False]


@pytest.mark.anyio
async def test_a_drain_reads_its_last_byte_of_budget() -> None:
    """19 bytes read when the body passed the cap: the drain may read 1 more, so it reads."""
    parts = [b"x" * 6, b"x" * 13, b"x", b"x"]
    done = await _through(_draining(), _scope("/drain"), _Exchange(parts))
    assert (done.status, done.received) == (413, 3)
    assert [m["type"] for m in done.sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.body",
    ]
    assert [m.get("more_body", False) for m in done.sent[1:]] == [True, False]


@pytest.mark.anyio
@pytest.mark.parametrize("declared", [None, "20"])
async def test_a_drain_ends_after_its_seconds_when_the_client_stops_sending(
    declared: str | None,
) -> None:
    """A client that says more is coming and sends nothing holds the server ``drain_s``, not
    for ever."""
    scope = _scope("/drain") if declared is None else _scope("/drain", content_length=declared)
    parts = [b"x" * 6, b"x" * 5] if declared is None else [b"x" * 5]
    with anyio.fail_after(30):
        done = await _through(_draining(drain_s=0.05), scope, _Exchange(parts, then_silence=True))
    assert done.status == 413
    assert done.sent[-1] == {"type": "http.response.body", "body": b""}


@pytest.mark.anyio
async def test_a_body_that_ended_as_it_passed_the_cap_is_not_drained() -> None:
    done = await _through(_draining(), _scope("/drain"), _Exchange([b"x" * 6, b"x" * 5]))
    assert (done.status, done.received) == (413, 2)
    assert [m.get("more_body", False) for m in done.sent[1:]] == [False]


@pytest.mark.anyio
async def test_a_body_over_the_cap_after_the_answer_started_is_the_handler_s_error() -> None:
    async def streams_first(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await receive()
        await receive()

    with pytest.raises(BodyTooLarge) as caught:
        await _through(_guard(streams_first), _scope(), _Exchange([b"x" * 6, b"x" * 5]))
    assert caught.value.limit == CAP
    assert str(caught.value) == f"request body over {CAP} bytes"


@pytest.mark.anyio
async def test_the_handler_s_own_413_on_a_draining_path_is_held_open_while_the_rest_is_read() -> (
    None
):
    """The app answers the cut-off body itself (``exception_handlers``): the guard keeps that
    answer open until the rest of the body is read (twice the cap in all)."""

    async def own_413(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _handler(scope, receive, send)
        except BodyTooLarge:
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b'"own"'})

    parts = [b"x" * 6, b"x" * 5, b"x" * 5, b"x" * 4, b"x"]
    done = await _through(_draining(app=own_413), _scope("/drain"), _Exchange(parts))
    assert done.status == 413
    assert done.received == 4
    assert done.sent[1:] == [
        {"type": "http.response.body", "body": b'"own"', "more_body": True},
        {"type": "http.response.body", "body": b""},
    ]
    plain = await _through(_guard(own_413), _scope("/drain"), _Exchange(parts))
    assert plain.received == 2
    assert plain.sent[1:] == [{"type": "http.response.body", "body": b'"own"'}]
    ended = await _through(_draining(app=own_413), _scope("/drain"), _Exchange(parts[:2]))
    assert ended.sent[1:] == [{"type": "http.response.body", "body": b'"own"'}]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "parts", "code"),
    [
        ({}, [b""], "UNAUTHORIZED"),
        ({"authorization": f"Bearer {TOKEN}", "content_length": "x"}, [b""], "BAD_JSON"),
        ({"authorization": f"Bearer {TOKEN}", "content_length": "11"}, [b""], "BODY_TOO_LARGE"),
        ({"authorization": f"Bearer {TOKEN}"}, [b"x" * 6, b"x" * 5], "BODY_TOO_LARGE"),
    ],
)
async def test_each_refusal_is_in_its_path_s_own_shape(
    headers: dict[str, str], parts: list[bytes], code: str
) -> None:
    guard = _guard(error_body_for=lambda path: _other_shape if path == "/private/v1" else _shape)
    done = await _through(guard, _scope("/private/v1", **headers), _Exchange(parts))
    assert list(done.body) == ["error"] and done.body["error"]["code"] == code
    done = await _through(guard, _scope("/private/v2", **headers), _Exchange(parts))
    assert done.body["code"] == code


@pytest.mark.anyio
async def test_each_path_has_its_own_cap() -> None:
    guard = _guard(cap=lambda path: 2 if path == "/small" else CAP)
    small = await _through(guard, _scope("/small"), _Exchange([b"abc"]))
    assert small.status == 413
    assert small.body["message"] == "request body over 2 bytes for /small"
    assert (await _through(guard, _scope("/large"), _Exchange([b"abc"]))).body == 3


@pytest.mark.anyio
async def test_a_path_that_does_not_drain_reads_no_byte_of_a_refused_body() -> None:
    """Even with a cap of 0, whose refused bodies are one byte long."""
    guard = _guard(cap=lambda path: 0)
    done = await _through(guard, _scope(content_length="1"), _Exchange([b"x"]))
    assert (done.status, done.received) == (413, 0)
    done = await _through(guard, _scope(), _Exchange([b"x", b"y"]))
    assert (done.status, done.received) == (413, 1)


@pytest.mark.anyio
async def test_an_answer_given_before_the_body_was_read_is_passed_on_as_it_is() -> None:
    """A handler that answers without reading (a 404) on a draining path: nothing overflowed,
    so nothing is drained or held open."""

    async def unread(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    done = await _through(_draining(app=unread), _scope("/drain"), _Exchange([b"ab", b"cd"]))
    assert done.received == 0
    assert done.sent[1:] == [{"type": "http.response.body", "body": b"no"}]


async def _own_413(scope: Scope, receive: Receive, send: Send) -> None:
    """A handler that answers a cut-off body itself (``exception_handlers``), in two parts."""
    try:
        await _handler(scope, receive, send)
    except BodyTooLarge:
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b'"o', "more_body": True})
        await send({"type": "http.response.body", "body": b'wn"'})


@pytest.mark.anyio
async def test_the_handler_s_own_413_is_held_open_at_its_last_part_only() -> None:
    parts = [b"x" * 6, b"x" * 5, b"x" * 5, b"x" * 4, b"x"]
    done = await _through(_draining(app=_own_413), _scope("/drain"), _Exchange(parts))
    assert done.received == 4
    assert done.sent[1:] == [
        {"type": "http.response.body", "body": b'"o', "more_body": True},
        {"type": "http.response.body", "body": b'wn"', "more_body": True},
        {"type": "http.response.body", "body": b""},
    ]


@pytest.mark.anyio
async def test_the_handler_s_own_413_after_the_whole_budget_was_read_is_not_held() -> None:
    parts = [b"x" * 6, b"x" * 14, b"x"]  # 20 bytes read when the cap was passed: the budget
    done = await _through(_draining(app=_own_413), _scope("/drain"), _Exchange(parts))
    assert done.received == 2
    assert done.sent[1:] == [
        {"type": "http.response.body", "body": b'"o', "more_body": True},
        {"type": "http.response.body", "body": b'wn"'},
    ]


@pytest.mark.anyio
async def test_the_handler_s_own_413_ends_after_the_drain_s_seconds_too() -> None:
    with anyio.fail_after(30):
        done = await _through(
            _draining(app=_own_413, drain_s=0.05),
            _scope("/drain"),
            _Exchange([b"x" * 6, b"x" * 5], then_silence=True),
        )
    assert done.sent[-1] == {"type": "http.response.body", "body": b""}


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
     ("[::1]", True), ("0.0.0.0", False), ("10.0.0.1", False), ("::", False),
     ("example.com", False), ("localhost.example.com", False), ("", False), ("X::1X", False)],
)  # fmt: skip
def test_only_a_loopback_address_or_localhost_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.anyio
@pytest.mark.parametrize("per_path", [False, True])
async def test_a_body_over_the_cap_met_by_a_handler_is_answered_413_in_its_path_s_shape(
    per_path: bool,
) -> None:
    def by_path(path: str) -> Any:
        return _other_shape if path == "/v1/x" else _shape

    handlers = exception_handlers(_shape, by_path if per_path else None)
    assert list(handlers) == [BodyTooLarge]
    request = Request({"type": "http", "path": "/v1/x", "headers": [], "query_string": b""})
    answer = await handlers[BodyTooLarge](request, BodyTooLarge(CAP))
    assert answer.status_code == 413
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["connection"] == "close"
    assert answer.headers["x-should-retry"] == "false"
    expected = {"code": "BODY_TOO_LARGE", "message": f"request body over {CAP} bytes"}
    assert json.loads(answer.body) == ({"error": expected} if per_path else expected)


# --- connections: the guarded protocol on a real uvicorn ----------------------------------------


@contextlib.asynccontextmanager
async def _serving(protocol: type[Any], app: ASGIApp = _handler) -> AsyncIterator[tuple[str, int]]:
    """A uvicorn whose keep-alive timeout (60 s) is far beyond the header timeouts tested, so a
    close is the header timer's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, http=protocol, timeout_keep_alive=60
    )
    server = _Quiet(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            try:
                with anyio.fail_after(20):
                    while not server.started:  # noqa: ASYNC110 -- uvicorn has only the flag
                        await anyio.sleep(0.005)
                yield sock.getsockname()
            finally:
                server.should_exit = True
    finally:
        sock.close()


REQUEST = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab"
SERVICE_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
)


@pytest.mark.anyio
async def test_a_connection_beyond_the_cap_is_answered_503_and_closed_at_once() -> None:
    async with _serving(guarded_protocol(max_connections=2, header_timeout_s=60)) as address:
        first = await anyio.connect_tcp(*address)
        second = await anyio.connect_tcp(*address)
        async with first, second:
            async with await anyio.connect_tcp(*address) as third:
                assert await _to_close(third) == SERVICE_UNAVAILABLE
            for held in (first, second):  # the two within the cap are served
                await held.send(REQUEST)
                with anyio.fail_after(30):
                    assert (await held.receive()).startswith(b"HTTP/1.1 200 OK")


@pytest.mark.anyio
async def test_a_connection_that_never_completes_its_headers_is_closed_after_the_timeout() -> None:
    async with _serving(guarded_protocol(header_timeout_s=0.2)) as address:
        async with await anyio.connect_tcp(*address) as silent:
            assert await _to_close(silent) == b""
        async with await anyio.connect_tcp(*address) as slow:
            await slow.send(b"POST /x HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            assert await _to_close(slow) == b""


@pytest.mark.anyio
async def test_a_connection_idle_after_its_answer_is_closed_after_the_header_timeout() -> None:
    """Re-armed after each answer: long before uvicorn's keep-alive timeout (60 s here)."""
    async with (
        _serving(guarded_protocol(header_timeout_s=0.3)) as address,
        await anyio.connect_tcp(*address) as client,
    ):
        await client.send(REQUEST)
        reply = await _to_close(client)
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"\r\n1\r\n2\r\n0\r\n\r\n"), (
        reply
    )


def test_refused_connections_are_logged_at_most_once_per_10_s_with_their_count(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood cannot fill the disk: one line per 10 s (the protocol's clock, read from the
    ``time`` module when the protocol is made, is a stand-in here), each with the count."""
    clock = [10.0]
    monkeypatch.setitem(sys.modules, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    protocol = guarded_protocol(max_connections=0)
    monkeypatch.undo()

    class Transport:
        closed = False
        written = b""

        def write(self, data: bytes) -> None:
            self.written += data

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str) -> Any:
            return None

        def is_closing(self) -> bool:
            return self.closed

    config = uvicorn.Config(_handler, lifespan="off", log_config=None)
    config.load()
    state = uvicorn.server.ServerState()
    caplog.set_level(logging.WARNING, logger="loraledger.http")
    logged = []
    for now in (10.0, 19.9, 20.0, 29.0, 40.0):
        clock[0] = now
        loop = asyncio.new_event_loop()
        try:
            transport = Transport()
            protocol(config=config, server_state=state, app_state={}, _loop=loop).connection_made(
                transport
            )
        finally:
            loop.close()
        assert transport.closed and transport.written == SERVICE_UNAVAILABLE
        assert {r.name for r in caplog.records} <= {"loraledger.http"}
        logged.append([r.getMessage() for r in caplog.records])
        caplog.clear()
    assert logged == [
        ["refusing connections over the cap of 0 (1 refused so far)"],
        [],
        ["refusing connections over the cap of 0 (3 refused so far)"],
        [],
        ["refusing connections over the cap of 0 (5 refused so far)"],
    ]


@pytest.mark.anyio
async def test_a_request_still_being_handled_is_not_closed_by_the_header_timer() -> None:
    """The timer armed when the connection opened fires while the handler runs (the handler
    waits on the loop's clock past it: the loop runs the earlier timer first); the request,
    whose headers arrived, is answered."""

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(0.3)  # the header timer (0.05 s) is due first, so it has fired
        await _handler(scope, receive, send)

    async with (
        _serving(guarded_protocol(header_timeout_s=0.05), app=slow) as address,
        await anyio.connect_tcp(*address) as client,
    ):
        await client.send(REQUEST)
        with anyio.fail_after(30):
            assert (await client.receive()).startswith(b"HTTP/1.1 200 OK")


@pytest.mark.anyio
async def test_a_connection_closed_by_the_header_timer_frees_its_place() -> None:
    async with _serving(guarded_protocol(max_connections=1, header_timeout_s=0.1)) as address:
        async with await anyio.connect_tcp(*address) as idle:
            assert await _to_close(idle) == b""  # closed by the timer
        with anyio.fail_after(30):
            while True:  # until the server has seen the close: then the one place is free
                async with await anyio.connect_tcp(*address) as next_one:
                    await next_one.send(REQUEST)
                    reply = await _to_close(next_one)
                if reply != SERVICE_UNAVAILABLE:
                    break
        assert reply.startswith(b"HTTP/1.1 200 OK"), reply
