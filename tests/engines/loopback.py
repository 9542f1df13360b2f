"""A raw TCP server on loopback for the HTTP client tests: it misbehaves exactly as told.

Real servers lose keep-alive races, reset connections and cut replies short only now and then;
a subclass of :class:`LoopbackServer` does it on every request, so a test of how the client
classifies those failures is deterministic. It binds 127.0.0.1 on a port the OS picks and
answers one connection at a time on a thread of its own, until :meth:`LoopbackServer.stop`.
"""

from __future__ import annotations

import select
import socket
import threading


class LoopbackServer:
    """Accepts connections and hands each to :meth:`answer`, in order. ``connections`` counts
    the accepted ones."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=type(self).__name__)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()
        assert not self._thread.is_alive()

    def answer(self, conn: socket.socket) -> None:
        """Do what this server does with one connection (it is closed afterwards)."""
        raise NotImplementedError

    def read_head(self, conn: socket.socket) -> bytes | None:
        """The request's head (up to the blank line), or None when the client closed first."""
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            head += chunk
        return head

    def wait_readable(self, conn: socket.socket) -> bool:
        """Until the client sends more or closes (True), or the server stops (False)."""
        while not self._stop.is_set():
            if select.select([conn], [], [], 0.05)[0]:
                return True
        return False

    def _serve(self) -> None:
        while not self._stop.is_set():
            if select.select([self._listener], [], [], 0.05)[0]:
                conn, _ = self._listener.accept()
                self.connections += 1
                with conn:
                    self.answer(conn)
