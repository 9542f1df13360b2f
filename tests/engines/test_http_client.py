"""The one way engine adapters send HTTP: no proxy from the environment, and a pool of
kept-alive connections that cannot lose a request to the engine's keep-alive timer: the pool
closes an idle connection before the engine would, and a request is resent only when its head
provably never reached the socket.

The server here is a real TCP server on loopback that loses every keep-alive race it can: it
answers a request and, unless asked to close, keeps the connection; when the next request
arrives on a connection idle for longer than its keep-alive, it closes the socket without
reading it, as a server whose idle timer fired late (a stalled loop) does (the kernel resets the
connection and the client reads ECONNRESET). That is what happened to a generation against a
starved vLLM in CI, made deterministic."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from engines import guard, http
from engines.contract import AmbiguousReply, ErrorCode
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from tests.engines.loopback import LoopbackServer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio

# A vLLM /metrics body as far as VLLMEngine.incarnation reads it.
METRICS = b"process_start_time_seconds 1.7e+09\n"
REPLY = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
    + f"content-length: {len(METRICS)}\r\n".encode()
    + b"\r\n"
    + METRICS
)


class KeepAliveRacer(LoopbackServer):
    """The server described in the module docstring, with a keep-alive of ``keep_alive_s``.
    ``connections`` counts accepted connections, ``resets`` the requests it dropped by closing
    a kept-alive connection with them unread."""

    def __init__(self, keep_alive_s: float) -> None:
        self.keep_alive_s = keep_alive_s
        self.resets = 0
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        while (head := self.read_head(conn)) is not None:
            if b"connection: close" in head.lower():
                conn.sendall(REPLY.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1))
                return
            conn.sendall(REPLY)
            replied = time.monotonic()
            if not self.wait_readable(conn):
                return
            if time.monotonic() - replied > self.keep_alive_s:
                if conn.recv(1, socket.MSG_PEEK):  # a request, not the client's close
                    self.resets += 1
                return


@pytest.fixture
def racer(request: pytest.FixtureRequest) -> Iterator[KeepAliveRacer]:
    server = KeepAliveRacer(getattr(request, "param", http.ENGINE_KEEP_ALIVE_S))
    try:
        yield server
    finally:
        server.stop()


async def _get(client: httpx.AsyncClient, port: int) -> httpx.Response:
    return await http.request(
        client, "GET", f"http://127.0.0.1:{port}/metrics", engine_id="e0", timeout=10.0
    )


@pytest.mark.parametrize("racer", [0.1], indirect=True)
async def test_the_racer_swallows_a_request_sent_after_its_keep_alive(
    racer: KeepAliveRacer,
) -> None:
    """The server really does what the module docstring says: a client that keeps connections
    longer than the server does (httpx's default expiry, 5 s) loses its second request to a
    reset. (Were this to pass, the tests below would prove nothing.)"""
    async with httpx.AsyncClient(trust_env=False) as client:
        first = await client.get(f"http://127.0.0.1:{racer.port}/metrics")
        assert first.content == METRICS
        await anyio.sleep(racer.keep_alive_s * 3)  # the idle time is the scenario
        with pytest.raises(httpx.TransportError):
            await client.get(f"http://127.0.0.1:{racer.port}/metrics")
    assert (racer.connections, racer.resets) == (1, 1)


@pytest.mark.parametrize("racer", [http.POOL_IDLE_EXPIRY_S + 0.2], indirect=True)
async def test_the_pool_drops_an_idle_connection_before_the_engine_would(
    racer: KeepAliveRacer,
) -> None:
    """Idle past the pool's expiry but not yet past the engine's keep-alive: the pool opens a
    new connection rather than race the engine's timer (httpx's default of 5 s would reuse it
    and lose the request)."""
    async with http.engine_client() as client:
        assert (await _get(client, racer.port)).content == METRICS
        await anyio.sleep(http.POOL_IDLE_EXPIRY_S + 0.4)  # the idle time is the scenario
        assert (await _get(client, racer.port)).content == METRICS
    assert (racer.connections, racer.resets) == (2, 0)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_adapters_reuse_connections_and_never_lose_a_request_to_a_keepalive_race(
    racer: KeepAliveRacer, kind: str
) -> None:
    """Against an engine with uvicorn's keep-alive, back-to-back requests share one connection
    and none is lost."""
    base_url = f"http://127.0.0.1:{racer.port}"
    engine = VLLMEngine(base_url, "e0") if kind == "vllm" else SGLangEngine(base_url, "e0")
    try:
        if isinstance(engine, VLLMEngine):
            for _ in range(3):
                assert await engine.incarnation() == "pst-1700000000.00"
        else:  # any endpoint will do: the racer answers them all alike
            for _ in range(3):
                assert (await engine._send("GET", "/metrics", timeout=10.0)).content == METRICS
        assert engine._client._trust_env is False
    finally:
        await engine.aclose()
    assert (racer.connections, racer.resets) == (1, 0)


class CloseOnCue(LoopbackServer):
    """Answers every request; keeps its first connection alive after the first reply until the
    test cues the close (``cue``), then closes it as an engine's keep-alive timer does: with a
    FIN, or with a reset (SO_LINGER 0) when ``reset``. ``requests`` counts the requests it
    read; ``closed`` is set once that connection is closed."""

    def __init__(self, *, reset: bool) -> None:
        self.reset = reset
        self.cue = threading.Event()
        self.closed = threading.Event()
        self.requests = 0
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        while self.read_head(conn) is not None:
            self.requests += 1
            conn.sendall(REPLY)
            if self.connections > 1:
                continue
            while not self.cue.wait(0.01):
                pass
            if self.reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.closed.set()
            return


@pytest.fixture
def closing_server(request: pytest.FixtureRequest) -> Iterator[CloseOnCue]:
    server = CloseOnCue(reset=request.param == "reset")
    try:
        yield server
    finally:
        server.cue.set()
        server.stop()


@pytest.mark.parametrize("closing_server", ["fin", "reset"], indirect=True)
async def test_a_connection_the_engine_closed_while_idle_is_replaced_before_reuse(
    closing_server: CloseOnCue,
) -> None:
    """The provable "never left": the engine closed (or reset) the idle connection and that
    reached us before the next request; the pool sees it and sends the request on a new
    connection, read once, with no error."""
    async with http.engine_client() as client:
        assert (await _get(client, closing_server.port)).content == METRICS
        closing_server.cue.set()
        await wait_for("the engine closed the idle connection", closing_server.closed.is_set)
        assert (await _get(client, closing_server.port)).content == METRICS
    assert (closing_server.connections, closing_server.requests) == (2, 2)


@pytest.mark.parametrize("closing_server", ["reset"], indirect=True)
async def test_a_reset_that_crosses_the_request_is_ambiguous_and_never_resent(
    closing_server: CloseOnCue,
) -> None:
    """What the pool cannot prove: the reset arrives after the pool checked the connection and
    before the request's head is written (cued from httpcore's trace, just before that write).
    No byte of the request left, but nothing says so (asyncio swallows the failed write; the
    read fails as it would after the engine read the request and died), so it is an ambiguous
    CONNECTION_LOST, and the engine reads nothing: not resent."""
    heads = 0

    async def close_before_the_second_head(name: str, info: dict[str, Any]) -> None:
        nonlocal heads
        if name == "http11.send_request_headers.started":
            heads += 1
            if heads == 2:
                closing_server.cue.set()
                await wait_for("the engine reset the connection", closing_server.closed.is_set)

    async def traced(request: httpx.Request) -> None:
        request.extensions["trace"] = close_before_the_second_head

    async with http.engine_client() as client:
        client.event_hooks["request"].append(traced)
        assert (await _get(client, closing_server.port)).content == METRICS
        with pytest.raises(AmbiguousReply) as lost:
            await _get(client, closing_server.port)
    assert (lost.value.code, lost.value.dispatched) == (ErrorCode.CONNECTION_LOST, True)
    assert (closing_server.connections, closing_server.requests, heads) == (1, 1, 2)


def test_the_pool_expires_idle_connections_seconds_before_any_engine_server_would() -> None:
    """The margin the pool's safety rests on: uvicorn's default keep-alive (vLLM, SGLang) and
    the local engine's (``engines.guard``) are the 5 s the pool counts on, and the pool lets go
    of an idle connection 4 s before that."""
    assert uvicorn.Config(app="unused:app").timeout_keep_alive == http.ENGINE_KEEP_ALIVE_S
    assert guard.KEEP_ALIVE_S == http.ENGINE_KEEP_ALIVE_S
    assert http.ENGINE_KEEP_ALIVE_S - http.POOL_IDLE_EXPIRY_S >= 4.0
