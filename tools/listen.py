"""The listening sockets of ``loraledger serve`` and ``loraledger gateway``, bound before
anything else starts, and the HTTP server run on them.

Why first: a port someone else holds is the commonest start-up failure, and one a user fixes
without reading a log. Bound before serve opens its log (a new epoch, the deployment, the
engines joining) or a gateway registers its owner with the ledger (an owner nobody renews
expires 30 s later as an incident), a busy port leaves nothing behind: one ``error: cannot
listen on HOST:PORT: ...`` line and exit 1. Left to uvicorn, the bind happens once all that
is done, and a failure ends the process with ``sys.exit(3)`` -- exit 3 means "the log file
does not exist" here.

The sockets are the ones uvicorn would have made (through asyncio's ``create_server``): one
per address ``host`` resolves to, ``SO_REUSEADDR`` (a restart need not wait out TIME_WAIT,
yet a port another process listens on is refused), IPv6 sockets IPv6-only (so ``::`` and
``0.0.0.0`` can both be bound), an address whose family this host cannot open skipped (a
kernel without IPv6: ``--host ''`` still listens on IPv4). They listen at once: a socket that
is only bound does not hold a port against another ``SO_REUSEADDR`` socket on Linux. One
difference: with port 0 every address gets the port the OS chose for the first, so the
announced URL reaches all.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tools.exitcodes import Exit, ToolError

BACKLOG = 2048  # uvicorn's default; asyncio sets it again when it starts serving


def where(host: str, port: int) -> str:
    """``HOST:PORT`` as a user writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@asynccontextmanager
async def listening(host: str, port: int) -> AsyncIterator[list[socket.socket]]:
    """Listening sockets on every address of ``host`` at ``port`` (0: one the OS picks),
    closed on exit; ``ToolError`` (exit 1) naming the address when they cannot be had.
    Asynchronous only to stack in one ``async with`` with what it must precede."""
    sockets: list[socket.socket] = []
    try:
        try:
            _bind_all(sockets, host, port)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ToolError(
                Exit.FAILED, f"cannot listen on {where(host, port)}: {reason}"
            ) from None
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _bind_all(sockets: list[socket.socket], host: str, port: int) -> None:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    unsupported: OSError | None = None
    for family, kind, proto, _, address in dict.fromkeys(infos):  # distinct, in order
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # e.g. IPv6 disabled in the kernel: asyncio skips it too
            unsupported = exc
            continue
        sockets.append(sock)  # closed by the caller whatever happens next
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if port == 0 and len(sockets) > 1:
            address = (address[0], sockets[0].getsockname()[1], *address[2:])
        sock.bind(address)
        sock.listen(BACKLOG)
    if not sockets and unsupported is not None:
        raise unsupported


async def serve_on(server: Any, sockets: list[socket.socket]) -> None:
    """Run uvicorn ``server`` on ``sockets`` until it stops. uvicorn reports a start-up
    failure with ``sys.exit(3)``; it becomes a ``ToolError`` (exit 1), so the command's
    clean-up runs and its exit code keeps its meaning."""
    try:
        await server.serve(sockets=sockets)
    except SystemExit as exc:
        raise ToolError(
            Exit.FAILED, f"the HTTP server did not start (uvicorn exit {exc.code}; see the log)"
        ) from None
