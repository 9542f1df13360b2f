"""The guard's body cap, as a client that uploads its whole body before reading sees it (httpx,
hence the official OpenAI clients): on a draining path the 413 is readable, the rest of the body
is read and thrown away, and that reading is bounded in bytes and in time.

A real uvicorn (the servers' own connection limits) on a free loopback port, a one-route app
behind :class:`engines.guard.Guard`; each test is named after the defect it pins."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines.guard import DRAIN_FACTOR, Guard, exception_handlers, uvicorn_limits

pytestmark = pytest.mark.anyio

CAP = 16 * 1024 * 1024  # over it, a body outruns what the socket buffers absorb
PATH = "/upload"


def _error_body(code: str, message: str) -> Any:
    return {"code": code, "message": message}


class _Counted:
    """The app behind the guard, counting the requests that reached the server."""

    def __init__(self) -> None:
        self.requests = 0

    async def upload(self, request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"received": len(body)})

    def app(self, *, drains: bool, drain_s: float = 10.0, handlers: bool = True) -> Starlette:
        """``handlers``: the app turns a body over the cap into its 413 itself (Starlette's
        ``exception_handlers``); without, the guard does."""
        inner = Starlette(
            routes=[Route(PATH, self.upload, methods=["POST"])],
            middleware=[
                Middleware(
                    Guard,
                    token=None,
                    protected=lambda path: False,
                    cap=lambda path: CAP,
                    error_body=_error_body,
                    drains=lambda path: drains,
                    drain_s=drain_s,
                )
            ],
            exception_handlers=exception_handlers(_error_body) if handlers else None,
        )

        async def counting(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.requests += 1
            await inner(scope, receive, send)

        return counting  # type: ignore[return-value]


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def _serving(app: Any) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = _Quiet(uvicorn.Config(app, lifespan="off", log_config=None, **uvicorn_limits()))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            try:
                with anyio.fail_after(20):
                    while not server.started:  # noqa: ASYNC110 -- uvicorn has only the flag
                        await anyio.sleep(0.005)
                yield f"http://127.0.0.1:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


async def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send ``head`` (and ``body``) on a raw connection, read until the server closes it; the
    reply and the seconds from the last byte sent to the close."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(head + body)
        sent = time.monotonic()
        reply = await _to_close(stream)
    return reply, time.monotonic() - sent


async def _to_close(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the server sends until it closes the connection (30 s at most)."""
    reply = b""
    with anyio.fail_after(30):
        while True:
            try:
                reply += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return reply


def _head(length: int | None, *extra: str) -> bytes:
    lines = [f"POST {PATH} HTTP/1.1", "Host: x", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("handlers", [True, False])
async def test_a_client_still_uploading_got_a_reset_instead_of_the_413(handlers: bool) -> None:
    """Before: the 413 went out and the connection closed while the client was still
    uploading; the unread bytes made the kernel reset it, and httpx raised ``ReadError``
    instead of returning the 413 (an OpenAI SDK then retried, uploading twice more). Now,
    on a draining path, the client reads the 413 and its code, declared length or chunked,
    and a request under the cap on the next connection is served; whether the 413 of a
    chunked body is the app's (its exception handler) or the guard's."""
    counted = _Counted()
    async with (
        _serving(counted.app(drains=True, handlers=handlers)) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        over = b"x" * (3 * CAP // 2)
        declared = await http.post(PATH, content=over)
        assert declared.status_code == 413, declared.text
        assert declared.json()["code"] == "BODY_TOO_LARGE"
        assert declared.headers["x-should-retry"] == "false"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(7):  # 1.75 times the cap, within what is drained
                yield b"y" * (CAP // 4)

        chunked = await http.post(PATH, content=chunks())  # no length: cut at the cap
        assert chunked.status_code == 413, chunked.text
        assert chunked.json()["code"] == "BODY_TOO_LARGE"
        assert chunked.headers["x-should-retry"] == "false"

        fits = await http.post(PATH, content=b"z" * CAP)
        assert fits.status_code == 200 and fits.json() == {"received": CAP}
        assert counted.requests == 3  # one each: nothing was sent twice


async def test_a_refused_body_is_read_only_so_far() -> None:
    """The reading that makes a 413 readable is bounded: a body declared beyond
    ``DRAIN_FACTOR`` times the cap is answered and closed at once, without waiting for a byte
    of it; a client that stops sending mid-body is closed once ``drain_s`` has passed; a
    client that waits for ``100 Continue`` gets the 413 at once; and on a path that does not
    drain the answer is immediate, as before."""
    async with _serving(_Counted().app(drains=True, drain_s=0.5)) as url:
        huge = 200 * 1024 * 1024
        assert huge > DRAIN_FACTOR * CAP
        reply, closed_after = await _raw(url, _head(huge))  # no body byte is ever sent
        assert reply.startswith(b"HTTP/1.1 413") and b"BODY_TOO_LARGE" in reply, reply[:200]
        assert b"x-should-retry: false" in reply.lower()
        assert closed_after < 0.4, closed_after  # never waited for the body

        within = 3 * CAP // 2
        reply, closed_after = await _raw(url, _head(within), b"x" * 1000)  # then silence
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert 0.4 < closed_after < 5, closed_after  # waited for the rest, drain_s at most

        reply, closed_after = await _raw(url, _head(within, "Expect: 100-continue"))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert closed_after < 0.4, closed_after

    async with _serving(_Counted().app(drains=False, drain_s=0.5)) as url:
        reply, closed_after = await _raw(url, _head(3 * CAP // 2))
        assert reply.startswith(b"HTTP/1.1 413") and closed_after < 0.4, closed_after


@pytest.mark.parametrize("handlers", [True, False])
async def test_a_chunked_upload_told_to_continue_got_a_reset(handlers: bool) -> None:
    """curl sends ``Expect: 100-continue`` with every chunked upload. The app's first read makes
    the server answer ``100 Continue``, so the client uploads; the guard used to skip the
    drain for any client that sent the header, closed on the unread upload, and the reset
    threw the 413 away. Now the client reads the whole 413, whoever answered it."""
    async with _serving(_Counted().app(drains=True, handlers=handlers)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        chunk = 1024 * 1024
        frame = b"%x\r\n" % chunk + b"c" * chunk + b"\r\n"
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(_head(None, "Transfer-Encoding: chunked", "Expect: 100-continue"))
            with anyio.fail_after(10):
                assert (await stream.receive()).startswith(b"HTTP/1.1 100 Continue")
            for _ in range(3 * CAP // (2 * chunk)):  # 1.5 times the cap, within the drain
                await stream.send(frame)
            await stream.send(b"0\r\n\r\n")
            reply = await _to_close(stream)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"BODY_TOO_LARGE" in body, reply[:400]


async def test_a_draining_path_reads_no_more_than_its_bound() -> None:
    """A chunked body that never ends (no length to refuse it by) is read to ``DRAIN_FACTOR``
    times the cap at most, then the connection is closed: the client cannot make the server
    read without end (it sees its upload broken off, far short of what it meant to send). A
    bound on the draining itself: the code before it read nothing past the cap."""
    async with _serving(_Counted().app(drains=True)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        chunk = 64 * 1024
        frame = b"%x\r\n" % chunk + b"c" * chunk + b"\r\n"
        sent = 0
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(_head(None, "Transfer-Encoding: chunked"))
            with anyio.fail_after(30), contextlib.suppress(anyio.BrokenResourceError, OSError):
                while sent < 100 * CAP:
                    await stream.send(frame)
                    sent += chunk
        assert sent < 100 * CAP, "the server read a never-ending body to the end"
