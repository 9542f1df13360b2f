"""The one way engine adapters send HTTP: no proxy from the environment, and every request on
a connection of its own, so a server closing an idle keep-alive connection can never swallow
a request (it would come back as a spurious ambiguous CONNECTION_LOST, never resent).

The server here is a real TCP server on loopback that loses every keep-alive race on purpose:
it answers a request and, unless asked to close, keeps the connection; when the next request
arrives on it, it closes the socket without reading it, as a server whose idle timer fired just
then does (the kernel resets the connection and the client reads ECONNRESET). That is what
happened to a generation against a starved vLLM in CI, made deterministic."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from engines import http
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from tests.engines.loopback import LoopbackServer

pytestmark = pytest.mark.anyio

# A vLLM /metrics body as far as VLLMEngine.incarnation reads it.
METRICS = b"process_start_time_seconds 1.7e+09\n"


class KeepAliveRacer(LoopbackServer):
    """The server described in the module docstring. ``connections`` counts accepted
    connections, ``resets`` the requests it dropped by closing a kept-alive connection."""

    def __init__(self) -> None:
        self.resets = 0
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        head = self.read_head(conn)
        if head is None:
            return
        close = b"connection: close" in head.lower()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
            + f"content-length: {len(METRICS)}\r\n".encode()
            + (b"connection: close\r\n" if close else b"")
            + b"\r\n"
            + METRICS
        )
        if close:
            return
        # Kept alive: wait for the next request and lose the race (close with it unread).
        if self.wait_readable(conn) and conn.recv(1, socket.MSG_PEEK):
            self.resets += 1


@pytest.fixture
def racer() -> Iterator[KeepAliveRacer]:
    server = KeepAliveRacer()
    try:
        yield server
    finally:
        server.stop()


async def _get(client: httpx.AsyncClient, port: int) -> httpx.Response:
    return await http.request(
        client, "GET", f"http://127.0.0.1:{port}/metrics", engine_id="e0", timeout=10.0
    )


async def test_the_racer_swallows_a_request_sent_on_a_kept_alive_connection(
    racer: KeepAliveRacer,
) -> None:
    """The server really does what the module docstring says: plain httpx, which pools
    connections, loses its second request to a reset. (Were this to pass, the tests below
    would prove nothing.)"""
    async with httpx.AsyncClient(trust_env=False) as client:
        first = await client.get(f"http://127.0.0.1:{racer.port}/metrics")
        assert first.content == METRICS
        with pytest.raises(httpx.TransportError):
            await client.get(f"http://127.0.0.1:{racer.port}/metrics")
    assert (racer.connections, racer.resets) == (1, 1)


async def test_every_request_goes_on_a_fresh_connection_even_through_an_injected_client(
    racer: KeepAliveRacer,
) -> None:
    async with httpx.AsyncClient(trust_env=False) as pooled:  # a caller's own, keep-alive client
        for _ in range(5):
            assert (await _get(pooled, racer.port)).content == METRICS
    assert (racer.connections, racer.resets) == (5, 0)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_adapters_never_lose_a_request_to_a_keepalive_race(
    racer: KeepAliveRacer, kind: str
) -> None:
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
    assert (racer.connections, racer.resets) == (3, 0)
