"""Stopping an engine-side HTTP face without cutting requests off: stop admitting, refuse new
work retryably, wait for what runs (bounded), then stop.

Why: SIGTERM used to stop the server at once (uvicorn's graceful shutdown, 2 s), so a
generation still running was cut and its client saw a 500 or a reset: an ambiguous turn that
is never resent, for a stop that was planned. A face served with a :class:`Drain`
(:mod:`engines.local.server`, :mod:`engines.agent`) stops in three steps instead:

1. :meth:`Drain.begin` (the process got SIGTERM): from now on every new request on a *work*
   route (generation, loads, staged transfer; the face says which) is answered ``503`` with
   the code ``ENGINE_DRAINING`` in ``{"error": {"message", "type", "code"}}``, before anything
   runs. That answer proves the request did not run here, so the gateway's executor sends it
   to another holder of the version (:func:`engines.http.server_failure` reads it as a
   :class:`~engines.contract.CleanRefusal`). Reads, unloads, aborts and generation control
   (pause, continue) keep working: the control plane still observes and cleans up. vLLM's
   and SGLang's own pause routes answer 503 the same way, and SGLang's ``/health`` answers
   503 while it shuts down, so ``/health`` does here too.
2. :meth:`Drain.wait`: every request admitted before (whatever its route) runs to its end, up
   to the drain timeout (``--drain-timeout``, :data:`DEFAULT_DRAIN_TIMEOUT_S`).
3. The server stops. Requests still running past the timeout are cut: their clients see the
   connection drop or a 5xx, which the gateway reports ``AMBIGUOUS_DISPATCH`` (never silently
   lost, never resent).

The count is the face's own: a request is in flight from the moment the middleware admits it
until its response has been sent in full (a stream included). A host without HTTP (a Ray engine
actor) uses the same gate directly: :meth:`Drain.refused` and :meth:`Drain.running`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import anyio
import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from engines.contract import CleanRefusal, ErrorCode

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_json = msgspec.json.Encoder()


class Drain:
    """One face's admission gate and its count of requests in flight (module docstring)."""

    def __init__(self, engine_id: str = "") -> None:
        self.engine_id = engine_id
        self.draining = False
        self.in_flight = 0
        self.refused_count = 0  # requests answered ENGINE_DRAINING
        self._idle: anyio.Event | None = None

    def begin(self) -> None:
        """Stop admitting work from now on (idempotent)."""
        self.draining = True

    async def wait(self, timeout: float) -> int:
        """Wait until nothing admitted is in flight, at most ``timeout`` seconds; returns how
        many requests are still running (0: drained)."""
        with anyio.move_on_after(timeout if math.isfinite(timeout) else None):
            while self.in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
        return self.in_flight

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count one admitted request for the body of the ``with``."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._idle is not None:
                self._idle.set()

    def refused(self) -> CleanRefusal:
        """The refusal of a request that came while draining (it did not run)."""
        self.refused_count += 1
        message = (
            f"engine {self.engine_id or 'this engine'} is draining before it stops: it admits "
            "no new request (this one did not run); send it to another engine"
        )
        return CleanRefusal(
            ErrorCode.ENGINE_DRAINING, message, engine_id=self.engine_id, status=503
        )

    def refusal_body(self) -> bytes:
        """:meth:`refused` as an HTTP body: ``{"error": {"message", "type", "code"}}``."""
        refusal = self.refused()
        error = {"message": refusal.message, "type": "server_error", "code": refusal.code}
        return _json.encode({"error": error})


class DrainGuard:
    """ASGI middleware: counts every request of ``app`` while it runs, and while ``drain`` is
    draining answers ``503 ENGINE_DRAINING`` to a request whose path ``refuses`` names."""

    def __init__(self, app: ASGIApp, *, drain: Drain, refuses: Callable[[str], bool]) -> None:
        self.app = app
        self.drain = drain
        self.refuses = refuses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining and self.refuses(scope["path"]):
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": drain.refusal_body()})
            return
        with drain.running():
            await self.app(scope, receive, send)
