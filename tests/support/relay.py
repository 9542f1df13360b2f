"""A TCP relay in front of an engine's HTTP server, for tests that need a fault between a
caller and a real engine: a reply lost after the engine ran the request, or a request held
until the test lets it go; or in front of ``serve``: an upload cut mid-body, a byte of it
corrupted. One request per connection: the relay forwards each request with ``Connection:
close``, so the server's reply says so too and the caller (engine clients pool their
connections) opens a new connection for its next request instead of sending it into a relay
that reads no more."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc


class Relay:
    """A TCP relay in front of an engine. ``mode``: ``pass`` (relay both ways), ``reset``
    (deliver a generation, wait for the engine's first reply bytes, then reset the client's
    connection: a reply lost after the engine ran it; other requests, e.g. the adapter's
    incarnation probe, pass) or ``hold`` (keep a generation until :meth:`release`, then relay
    both ways). ``arrived`` is set once a generation is in.

    ``requests`` are the request-line prefixes the fault applies to (generations unless told),
    ``faults`` how many of them get it (None: every one; later ones pass). Two more modes:
    ``cut`` delivers a request's head and ``at`` bytes of its body, waits for :meth:`release`
    (the test's sign that the server has them), then resets both connections (a connection
    lost mid-upload), and ``corrupt`` flips the body's byte at ``at`` and relays both ways (a
    byte damaged on the way)."""

    def __init__(
        self,
        target: str,
        mode: str,
        *,
        requests: tuple[bytes, ...] = (b"POST /generate", b"POST /v1/"),
        faults: int | None = None,
        at: int = 0,
    ) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.mode = mode
        self.requests = requests
        self.faults = faults
        self.at = at
        self.arrived = anyio.Event()
        self._released = anyio.Event()
        self.delivered = 0

    def release(self) -> None:
        self._released.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        async with listening(self._relay) as port:
            yield f"http://127.0.0.1:{port}"

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            request = one_request_per_connection(await read_request(client))
            generation = request.startswith(self.requests)
            if generation and self.faults is not None:
                generation = self.faults > 0
                self.faults -= generation
            if generation:
                self.arrived.set()
            if generation and self.mode == "hold":
                await self._released.wait()
            body_at = request.index(b"\r\n\r\n") + 4 + self.at
            if generation and self.mode == "corrupt":
                request = (
                    request[:body_at] + bytes([request[body_at] ^ 0xFF]) + request[body_at + 1 :]
                )
            async with await anyio.connect_tcp(*self.target) as upstream:
                if generation and self.mode == "cut":
                    await upstream.send(request[:body_at])
                    await self._released.wait()
                    reset_on_close(upstream)
                    reset_on_close(client)
                    return
                await upstream.send(request)
                self.delivered += generation
                if generation and self.mode == "reset":
                    await upstream.receive()  # the engine answered: the request ran there
                    reset_on_close(client)
                    return
                # one request per connection: the reply, until the engine closes
                await pipe(upstream, client)


@contextlib.asynccontextmanager
async def listening(
    handle: Callable[[anyio.abc.SocketStream], Awaitable[None]],
    port: int = 0,
) -> AsyncIterator[int]:
    """A loopback listener on ``port`` (0: one the OS picks), each connection handed to
    ``handle`` in a task of its own; yield the port; on exit stop listening and cancel every
    connection's task. The one listener of the test relays (this one and the chaos proxy)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield port
        finally:
            tg.cancel_scope.cancel()


async def pipe(
    source: anyio.abc.ByteReceiveStream,
    sink: anyio.abc.ByteSendStream,
    before: Callable[[bytes], Awaitable[bytes | None]] | None = None,
) -> None:
    """Copy ``source`` to ``sink`` chunk by chunk until either end closes. ``before`` sees
    each chunk first and returns what to send (``None``: nothing): the chaos proxy's faults
    act there."""
    with contextlib.suppress(
        anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
    ):
        while True:
            received = await source.receive()
            chunk = received if before is None else await before(received)
            if chunk is not None:
                await sink.send(chunk)


def reset_on_close(stream: anyio.abc.SocketStream) -> None:
    """Close with a reset (SO_LINGER 0) when the stream closes: the peer sees the connection
    lost, not a clean end."""
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def one_request_per_connection(request: bytes) -> bytes:
    """``request`` asking the server to close the connection after its reply (a header added
    after the request line; the body's offset moves with the head)."""
    line, rest = request.split(b"\r\n", 1)
    return line + b"\r\nConnection: close\r\n" + rest


async def read_request(client: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await client.receive()
    head = data.split(b"\r\n\r\n", 1)[0]
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(data) < len(head) + 4 + length:
        data += await client.receive()
    return data
