"""Serving an ASGI app from inside an event loop we already own (an engine, an agent, a test).

uvicorn's ``Server.serve`` is written for a process it owns: it installs signal handlers and
binds its own socket. Embedded in a test or in a process whose signals belong to someone else,
both are wrong, so the engine-side HTTP faces (:mod:`engines.local.server`,
:mod:`engines.agent`) share this one way to run it:

* :func:`bind_listener` binds the socket first, so the caller knows the port before uvicorn
  runs (``port=0`` asks the OS) and can hand it on (``--port-file``, a Ray reply);
* :class:`EmbeddedServer` is uvicorn without its signal handlers;
* :func:`embedded_config` applies the limits every face shares
  (:func:`engines.guard.uvicorn_limits`);
* :func:`serving` runs the server for the body of an ``async with`` and always lets uvicorn's
  own shutdown run (why it is shielded: see the comment inside).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn

from engines import guard


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: inside a test process, the process owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` has a colon)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: a reply is written as headers + body, and with Nagle
    # plus the client's delayed ACK every small JSON reply would wait ~40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def embedded_config(app: Any) -> uvicorn.Config:
    """The uvicorn settings every engine-side face runs with: quiet, no lifespan, a bounded
    graceful shutdown, and the shared connection and header limits."""
    return uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        **guard.uvicorn_limits(),
    )


@contextlib.asynccontextmanager
async def serving(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` and yield its base URL once uvicorn accepts connections;
    stop the server on exit, whatever ended the body."""
    sock = bind_listener(host, port)
    server = EmbeddedServer(embedded_config(app))

    async def run() -> None:
        # Shielded: the server stops only through ``should_exit`` (set on every exit below),
        # so uvicorn's shutdown always runs, even when the enclosing scope is cancelled.
        # Cancelled mid-serve, it left its listener registered with the event loop while
        # ``sock`` was closed: the next server of that loop whose socket reused the file
        # descriptor accepted connections and never answered them.
        with anyio.CancelScope(shield=True):
            await server.serve([sock])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                while not server.started:
                    if server.should_exit:
                        raise RuntimeError("uvicorn failed to start")
                    await anyio.sleep(0.005)
                bracketed = f"[{host}]" if ":" in host else host
                yield f"http://{bracketed}:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()
