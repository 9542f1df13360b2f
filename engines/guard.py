"""What every loraledger HTTP server checks before a handler runs: the token, the body size,
and that a body's numbers are numbers a handler can use.

Shared by the local engine's server (:mod:`engines.local.server`) and ``loraledger serve``
(``tools/http_app.py``), so the two cannot drift. Why each check lives here and not in the
handlers:

* **the bearer token** is checked from the headers alone, before one byte of the body is read:
  an unauthenticated caller cannot make the server buffer anything;
* **the body cap** is enforced on the declared ``Content-Length`` (refused at once) and on the
  bytes actually received (a chunked or lying body is cut off at the cap): without it, one
  300 MB body took the engine from 946 MB to 1.8 GB RSS. Paths whose clients upload a whole
  body before they read anything (OpenAI SDKs) also get the refusal *readable*: see
  :class:`Guard`, ``drains``;
* **strict JSON**: Python's ``json`` accepts ``NaN``, ``Infinity`` and ``1e400`` (infinite) and
  integers of any size; a handler that passes one on (a NaN temperature to the sampler, 2^80 to
  SQLite) fails with a 500 long after the parse. :func:`strict_json` refuses them at the parse,
  so every route answers 400 with the reason.

A refusal is a JSON body ``{"code", "message"}`` plus the shape each server's clients read
(``error_body``), with 401 (token), 413 (body too large) or 400 (bad JSON), and
``x-should-retry: false``: each is about the request itself, which would be refused again (the
header is the one the official OpenAI clients obey).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Integers beyond a signed 64-bit range cannot be stored (SQLite) or used as a count or id.
INT_LIMIT = 2**63
UNAUTHORIZED = "UNAUTHORIZED"
BODY_TOO_LARGE = "BODY_TOO_LARGE"
BAD_JSON = "BAD_JSON"

ErrorBody = Callable[[str, str], Any]  # (code, message) -> the JSON body a server's clients read

# A refused body of a draining path is read, and thrown away, up to this many times its cap
# and for at most DRAIN_S seconds (see Guard).
DRAIN_FACTOR = 2
DRAIN_S = 10.0

_encode = msgspec.json.Encoder()


class BadBody(ValueError):
    """A body that is not strict JSON (see :func:`strict_json`)."""


class BodyTooLarge(Exception):
    """Raised from ``receive`` once a body passes its cap; turned into a 413 by :class:`Guard`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


def _no_constant(name: str) -> Any:
    raise BadBody(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(f"{text[:40]} is out of the range of a 64-bit float")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # int() of a huge digit string is itself slow: refuse by length first
        raise BadBody(f"integer {text[:24]}... is out of range (|n| < 2^63)")
    value = int(text)
    if not -INT_LIMIT <= value < INT_LIMIT:
        raise BadBody(f"integer {text} is out of range (|n| < 2^63)")
    return value


def strict_json(body: bytes | str) -> Any:
    """Parse JSON, refusing NaN/Infinity, floats that overflow to infinity and integers outside
    a signed 64-bit range (:class:`BadBody`, a ``ValueError``, with the reason)."""
    try:
        return json.loads(
            body,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
        )
    except BadBody:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadBody(f"body is not JSON: {exc}") from None


def strict_decode(body: bytes, type_: type[Any]) -> Any:
    """:func:`strict_json` then ``msgspec.convert`` to ``type_`` (strict: no str -> int)."""
    try:
        return msgspec.convert(strict_json(body), type=type_)
    except msgspec.ValidationError as exc:
        raise BadBody(f"bad request body: {exc}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a hostname other than localhost may resolve
    anywhere, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(env_var: str, token_file: str | os.PathLike[str] | None) -> str | None:
    """The token from ``token_file`` if given, else from ``env_var``. Never from argv: the
    command line of a process is visible to every user (``ps``).

    In a file, the token is the first whitespace-separated field of the first line that is
    neither blank nor a ``#`` comment: the rest (a note, a rotated token kept for the record)
    is never sent. A token an HTTP header cannot carry is refused here, with a message that
    does not show it: sent as is, the HTTP client would refuse the header on every request and
    its error (which quotes the header value) would put the token in every log line."""
    if token_file is not None:
        text = Path(token_file).read_text(encoding="utf-8")
        token = _first_field(text)
        if token is None:
            raise ValueError(
                f"token file {token_file} is empty: it holds no token (only blanks or # comments)"
            )
        check_token(token, f"token file {token_file}")
        return token
    token = os.environ.get(env_var) or None
    if token is not None:
        check_token(token, f"${env_var}")
    return token


def _first_field(text: str) -> str | None:
    for _, fields in token_lines(text):
        return fields[0]
    return None


def token_lines(text: str) -> Iterable[tuple[int, list[str]]]:
    """The lines of a token file that are neither blank nor a ``#`` comment, each as its
    1-based line number and its whitespace-separated fields: how every token file is read
    (one token per file here; one ``ROLE TOKEN`` per line in :mod:`engines.access`)."""
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            yield number, fields


def check_token(token: str, source: str) -> None:
    """A bearer token is visible ASCII (RFC 6750's token68 and more): no spaces, no controls."""
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"{source}: the token holds a space, a control character or non-ASCII "
            f"({len(token)} characters, not shown): an HTTP header cannot carry it"
        )


class Guard:
    """ASGI middleware: token for ``protected`` paths, body cap per path, JSON refusals.

    ``protected(path) -> bool`` says which paths need the token (when ``token`` is set);
    ``cap(path) -> int`` the most body bytes a path accepts. ``error_body(code, message)`` builds
    the refusal in the shape the server's clients read; ``error_body_for(path)``, when given,
    picks that builder per path (a server whose routes answer in two shapes).

    ``drains(path) -> bool`` names the paths whose refused bodies are read to the end before the
    connection closes. Why: answering 413 and closing while the client is still uploading
    leaves unread bytes in the server's socket, so the kernel resets the connection, and the
    reset throws away the answer the client has not read yet. A client that sends its whole
    body before reading (httpx, hence every OpenAI SDK) then sees a connection error, and the
    SDK retries it, uploading the body twice more. On a draining path the 413 is sent at once,
    the rest of the body is read and discarded, and only then is the connection closed (a
    clean end, the answer intact). Bounded, so a client cannot make the server read without
    end: at most ``DRAIN_FACTOR`` times the cap in all and ``drain_s`` seconds; a body declared
    larger than that is not read at all (refused and closed at once, as on other paths: that
    client may see the reset), nor is a declared body of a client waiting for ``100 Continue``
    (refused on its length, it has sent nothing and sends nothing). A chunked body with that
    header is drained like any other: the app's first read sent the ``100 Continue``, so the
    client is uploading (curl adds the header to every chunked upload). Other paths keep the
    plain refusal: their clients are loraledger's own, whose bodies never come near a cap.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        protected: Callable[[str], bool],
        cap: Callable[[str], int],
        error_body: ErrorBody,
        error_body_for: Callable[[str], ErrorBody] | None = None,
        drains: Callable[[str], bool] | None = None,
        drain_s: float = DRAIN_S,
    ) -> None:
        self.app = app
        self.expected = token.encode() if token else None
        self.protected = protected
        self.cap = cap
        self.error_body_for = error_body_for or (lambda path: error_body)
        self.drains = drains or (lambda path: False)
        self.drain_s = drain_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(_headers(scope["headers"]))
        if self.expected is not None and self.protected(path):
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self.expected):
                await self._refuse(
                    send, path, 401, UNAUTHORIZED, "a valid bearer token is required for this route"
                )
                return
        limit = self.cap(path)
        budget = DRAIN_FACTOR * limit if self.drains(path) else 0
        too_large = f"request body over {limit} bytes for {path}"
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or len(declared) > 18:
                await self._refuse(send, path, 400, BAD_JSON, "Content-Length is not a byte count")
                return
            if int(declared) > limit:
                # Refused before any read: a client waiting for ``100 Continue`` has sent
                # nothing and, told no, sends nothing; reading would only invite the body.
                waits_for_continue = headers.get(b"expect", b"").lower() == b"100-continue"
                drain = budget if int(declared) <= budget and not waits_for_continue else 0
                await self._refuse(send, path, 413, BODY_TOO_LARGE, too_large, receive, drain)
                return
        received = 0
        ended = False  # the last part of the body has arrived
        overflowed = False  # it passed the cap: what the app answers next is a refusal

        async def bounded() -> Message:
            nonlocal received, ended, overflowed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                ended = not message.get("more_body", False)
                if received > limit:
                    overflowed = True
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            final = message["type"] == "http.response.body" and not message.get("more_body")
            if final and overflowed and not ended and budget > received:
                # the app's own 413 (exception_handlers): keep the response open while the
                # rest of the body is read, or the close would reset it unread
                await send({**message, "more_body": True})
                await _drain(receive, budget - received, self.drain_s)
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        try:
            await self.app(scope, bounded, tracked)
        except BodyTooLarge:
            if started:
                raise
            drain = 0 if ended else max(0, budget - received)
            await self._refuse(send, path, 413, BODY_TOO_LARGE, too_large, receive, drain)

    async def _refuse(
        self,
        send: Send,
        path: str,
        status: int,
        code: str,
        message: str,
        receive: Receive | None = None,
        drain: int = 0,
    ) -> None:
        """Answer ``status`` and close; with ``drain`` > 0, up to that many more body bytes are
        read (and thrown away) between the answer and the close."""
        headers = [
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            (b"x-should-retry", b"false"),
        ]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="loraledger"'))
        body = _encode.encode(self.error_body_for(path)(code, message))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if receive is None or drain <= 0:
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await _drain(receive, drain, self.drain_s)
        await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive, budget: int, seconds: float) -> None:
    """Read and discard the rest of a refused body: until it ends, the client goes, ``budget``
    bytes have been read or ``seconds`` have passed, whichever comes first."""
    with anyio.move_on_after(seconds):
        while budget > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            budget -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def exception_handlers(
    error_body: ErrorBody, error_body_for: Callable[[str], ErrorBody] | None = None
) -> dict[Any, Any]:
    """Starlette ``exception_handlers`` turning a :class:`BodyTooLarge` raised while a handler
    reads its body into the 413 (Starlette's outermost middleware would otherwise answer 500),
    in the shape of ``error_body_for(path)`` when given, else ``error_body``. The
    :class:`Guard` around the app still drains the rest of the body on a draining path."""
    from starlette.requests import Request
    from starlette.responses import Response

    async def too_large(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BodyTooLarge)
        shape = error_body if error_body_for is None else error_body_for(request.url.path)
        body = _encode.encode(shape(BODY_TOO_LARGE, f"request body over {exc.limit} bytes"))
        headers = {"connection": "close", "x-should-retry": "false"}
        return Response(body, 413, headers, media_type="application/json")

    return {BodyTooLarge: too_large}


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[bytes, bytes]]:
    for name, value in raw:
        yield name.lower(), value


# --- connections --------------------------------------------------------------------------------

MAX_CONNECTIONS = 1000
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5
MAX_HEADER_BYTES = 64 * 1024
_FD_HEADROOM = 64  # descriptors kept free for the log, the database, the engines


def connection_cap(wanted: int = MAX_CONNECTIONS) -> int:
    """``wanted``, lowered to stay under this process's descriptor limit: a server that hits
    EMFILE cannot accept even the connection that would have closed another."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    return min(wanted, max(8, soft - _FD_HEADROOM))


def guarded_protocol(
    *, max_connections: int = MAX_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S
) -> type[Any]:
    """uvicorn's h11 protocol with what it lacks against idle and slow clients:

    * a connection beyond ``max_connections`` is answered 503 and closed at once (uvicorn's own
      ``limit_concurrency`` answers 503 only once a request arrives, so idle connections pile
      up: 20,000 of them made ``/health`` time out and the accept loop log 196,607 EMFILE
      tracebacks in 10 s);
    * a connection that has not completed its request headers ``header_timeout_s`` after it
      opened, or after its previous reply, is closed (uvicorn times out only idle keep-alive
      connections, never one that sends nothing, or a byte at a time).

    Refusals are logged at most once per 10 s, with a count, so a flood cannot fill the disk.
    """
    import logging
    import time

    from uvicorn.protocols.http.h11_impl import H11Protocol

    log = logging.getLogger("loraledger.http")
    refused = {"count": 0, "logged": 0.0}

    class GuardedH11Protocol(H11Protocol):
        _header_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                refused["count"] += 1
                now = time.monotonic()
                if now - refused["logged"] >= 10.0:
                    log.warning(
                        "refusing connections over the cap of %d (%d refused so far)",
                        max_connections,
                        refused["count"],
                    )
                    refused["logged"] = now
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n"
                    b"content-length: 0\r\n\r\n"
                )
                transport.close()
                return
            self._arm(None)

        def _arm(self, cycle: Any) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expired, cycle)

        def _expired(self, cycle: Any) -> None:
            self._header_timer = None
            # still no request, or still the previous one, answered: no new headers arrived
            current = self.cycle
            waiting = current is None or (current is cycle and current.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(self.cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_limits(
    *, max_connections: int = MAX_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: the guarded protocol, the keep-alive timeout
    and the largest request head h11 will buffer."""
    return {
        "http": guarded_protocol(
            max_connections=connection_cap(max_connections), header_timeout_s=header_timeout_s
        ),
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
