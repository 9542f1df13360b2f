"""One classification of HTTP failures for every engine call: an adapter's request
(:func:`engines.http.request`) and the OpenAI relay's streamed request
(:func:`engines.openai_http.open_upstream`, its body read by the caller and classified with
:func:`engines.openai_http.read_failure`) turn the same server behaviour into the same engine
outcome -- the same code, and ``dispatched`` False only when nothing can have been sent.

The server is a real TCP server on loopback that misbehaves in one chosen way per test; "refused"
is a port nothing listens on."""

from __future__ import annotations

import socket
import struct

import httpx
import pytest

from engines import http
from engines.contract import AmbiguousReply, ErrorCode
from engines.openai_http import open_upstream, read_failure
from tests.engines.loopback import LoopbackServer

pytestmark = pytest.mark.anyio

TIMEOUT_S = 0.5


class Misbehaving(LoopbackServer):
    """Answers every request the way ``behaviour`` says: ``silent`` (reads it, never answers,
    until the client gives up), ``reset`` (reads it, then resets the connection), ``half`` (a
    200 whose body is cut short), ``503`` (a server error with a body), ``half503`` (a 503
    whose body is cut short), ``404``. ``requests`` counts the requests it read."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.requests = 0
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        if self.read_head(conn) is None:
            return
        self.requests += 1
        if self.behaviour == "silent":
            while self.wait_readable(conn) and conn.recv(65536):
                pass  # the body, if any; then the client's close, after its timeout
        elif self.behaviour == "reset":  # SO_LINGER 0: close sends RST, the client sees a reset
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            status, body, length = {
                "half": (b"200 OK", b'{"partial": ', 100),
                "503": (b"503 Service Unavailable", b"engine overloaded", 17),
                "half503": (b"503 Service Unavailable", b"engine over", 100),
                "404": (b"404 Not Found", b'{"error": "no"}', 15),
            }[self.behaviour]
            conn.sendall(
                b"HTTP/1.1 "
                + status
                + f"\r\ncontent-length: {length}\r\nconnection: close\r\n\r\n".encode()
                + body
            )


@pytest.fixture
def refused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


async def _plain(port: int) -> httpx.Response:
    """The adapters' path: the reply read whole, every failure classified by ``request``."""
    async with httpx.AsyncClient(trust_env=False) as client:
        return await http.request(
            client, "POST", f"http://127.0.0.1:{port}/generate", engine_id="e0", timeout=TIMEOUT_S
        )


async def _streamed(port: int) -> int:
    """The OpenAI relay's path: headers classified by ``open_upstream``, the body read by the
    caller and a failure there classified by ``read_failure``. Returns the status yielded."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with (
        httpx.AsyncClient(trust_env=False) as client,
        open_upstream(
            client, url, b"{}", engine_id="e0", request_id="r1", timeout=TIMEOUT_S
        ) as response,
    ):
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise read_failure(exc, url, "e0") from exc
        return response.status_code


CASES = [
    # (behaviour, code, dispatched)
    ("silent", ErrorCode.TIMEOUT, True),
    ("reset", ErrorCode.CONNECTION_LOST, True),
    ("half", ErrorCode.CONNECTION_LOST, True),
    ("503", ErrorCode.SERVER_ERROR, True),
    ("half503", ErrorCode.CONNECTION_LOST, True),
]


@pytest.mark.parametrize(("behaviour", "code", "dispatched"), CASES)
async def test_both_paths_classify_a_failure_the_same(
    behaviour: str, code: str, dispatched: bool
) -> None:
    server = Misbehaving(behaviour)
    try:
        failures = []
        for send in (_plain, _streamed):
            with pytest.raises(AmbiguousReply) as info:
                await send(server.port)
            failures.append(info.value)
    finally:
        server.stop()
    assert server.requests == 2  # each path sent its request once: the server read both
    for failure in failures:
        assert (failure.code, failure.dispatched, failure.engine_id) == (code, dispatched, "e0")
        assert not failure.clean
    if behaviour == "503":
        assert all(f.status == 503 and "engine overloaded" in f.message for f in failures)


async def test_a_refused_connection_is_the_one_failure_that_was_never_sent(
    refused_port: int,
) -> None:
    for send in (_plain, _streamed):
        with pytest.raises(AmbiguousReply) as info:
            await send(refused_port)
        assert (info.value.code, info.value.dispatched) == (ErrorCode.ENGINE_UNREACHABLE, False)
        assert "cannot connect" in info.value.message


async def test_a_4xx_is_returned_to_the_caller_on_both_paths() -> None:
    server = Misbehaving("404")
    try:
        assert (await _plain(server.port)).status_code == 404
        assert await _streamed(server.port) == 404
    finally:
        server.stop()
