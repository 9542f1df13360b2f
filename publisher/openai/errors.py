"""The OpenAI face's answers when it refuses: its own codes, OpenAI's error shape, the HTTP
status of every code it can answer, and whether a client may simply send the request again.

An OpenAI SDK reads ``{"error": {"message", "type", "param", "code"}}``; the machine code goes
in ``code`` (the ledger's, the gateway's or this face's). The official client retries 408, 409,
429 and 5xx unless told otherwise, so every refusal says ``x-should-retry``: true only for the
refusals after which the same request may pass (nothing was sent, and the condition may pass);
a resend of an ambiguous request would be a second sample, and a refusal by the rules would
only repeat. A refusal after the response started (mid-stream) can only be one SSE error event.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.middleware import Middleware
from starlette.responses import Response
from starlette.types import Message, Send

from engines import guard
from engines.contract import CleanRefusal, ErrorCode
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, Refused
from publisher.core.errors import Code
from publisher.gateway import DispatchCode

_json = msgspec.json.Encoder()


class OpenAICode:
    """The OpenAI face's own codes (the ledger's and the gateway's keep theirs)."""

    # model names a version the session is not bound to (the ledger's code for a first turn's
    # bind, the face's for a binding it judges: one string, spelled once)
    VERSION_NOT_BOUND = Code.VERSION_NOT_BOUND
    ENGINE_NOT_HTTP = "ENGINE_NOT_HTTP"  # a holder has no OpenAI endpoint (in-process engine)
    # model is neither the alias nor a version served here. OpenAI's and vLLM's own spelling
    # (lower case, unlike ours): clients' fallback logic keys on it and on the 404.
    MODEL_NOT_FOUND = "model_not_found"
    UNKNOWN_ROUTE = "UNKNOWN_ROUTE"  # no route at this path (404)
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"  # a route of this path, another method (405)


class OpenAIError(LoraLedgerError):
    """A refusal of the OpenAI face."""


class OpenAIRefused(
    OpenAIError,
    Refused,
    codes=[OpenAICode.VERSION_NOT_BOUND, OpenAICode.ENGINE_NOT_HTTP, OpenAICode.MODEL_NOT_FOUND],
):
    """Refused before anything was sent to an engine."""


class OpenAIInvalidInput(
    OpenAIError,
    InvalidInput,
    codes=[OpenAICode.UNKNOWN_ROUTE, OpenAICode.METHOD_NOT_ALLOWED],
):
    """A request to no route of the face: fix the client's path or method."""


# HTTP status of each code the routes can answer (anything else: 409, a refusal by the rules).
STATUS_OF_CODE = {
    INVALID_INPUT: 400,
    Code.INVALID_INPUT: 400,
    Code.UNKNOWN_OWNER: 503,
    Code.LEASE_EXPIRED: 503,
    Code.NO_PUBLISHED_VERSION: 503,
    Code.LEDGER_CLOSED: 503,
    Code.FENCED: 503,
    DispatchCode.NO_ROUTE: 503,
    DispatchCode.AMBIGUOUS_DISPATCH: 502,
    OpenAICode.ENGINE_NOT_HTTP: 503,
    OpenAICode.MODEL_NOT_FOUND: 404,
    OpenAICode.UNKNOWN_ROUTE: 404,
    OpenAICode.METHOD_NOT_ALLOWED: 405,
    "UNAUTHORIZED": 401,
    "WRITES_DISABLED": 403,
}


# Refusals after which the same request may simply be sent again (nothing was sent, and the
# condition may pass): the only ones the client is told to retry (``x-should-retry``).
RETRYABLE_CODES = frozenset(
    {
        DispatchCode.NO_ROUTE,
        Code.LEDGER_CLOSED,
        Code.NO_PUBLISHED_VERSION,
        ErrorCode.ENGINE_DRAINING,  # every holder is stopping: a later try finds another
    }
)


def error_body(code: str, message: str, status: int) -> bytes:
    """OpenAI's error shape, with the machine code in ``code``."""
    kind = (
        "authentication_error"
        if status == 401
        else "invalid_request_error"
        if status < 500
        else "server_error"
    )
    return _json.encode({"error": {"message": message, "type": kind, "param": None, "code": code}})


def error_response(
    code: str, message: str, status: int | None = None, *, allow: str | None = None
) -> Response:
    """A refusal in OpenAI's shape; ``allow`` is the ``Allow`` header of a 405."""
    status = status or STATUS_OF_CODE.get(code, 409)
    headers = {"x-should-retry": "true" if code in RETRYABLE_CODES else "false"}
    if allow is not None:
        headers["Allow"] = allow
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="loraledger"'
    return Response(error_body(code, message, status), status, headers, "application/json")


def guard_error_body(code: str, message: str) -> Any:
    """A refusal of :class:`engines.guard.Guard` (a body over the cap, a bad Content-Length)
    in this face's error shape: every app that mounts the routes answers them so."""
    return msgspec.json.decode(error_body(code, message, 413))


def body_guard(max_body_bytes: int) -> Middleware:
    """The :class:`engines.guard.Guard` in front of the routes: bodies capped at
    ``max_body_bytes``, refused 413 ``BODY_TOO_LARGE`` in this face's error shape, with
    ``x-should-retry: false``, after the rest of the body is read (bounded: see ``Guard``) so
    that a client still uploading reads the 413 instead of a reset connection. The token is
    the routes' own check (``WRITES_DISABLED`` when none is configured)."""
    return Middleware(
        guard.Guard,
        token=None,
        protected=lambda path: False,
        cap=lambda path: max_body_bytes,
        error_body=guard_error_body,
        drains=lambda path: True,
    )


def refusal_reply(refusal: CleanRefusal) -> tuple[str, str, int]:
    """An engine's clean refusal as the client gets it: the engine's status, its code
    (``GENERATION_FAILED`` when it gave none) and its message."""
    return (
        refusal.code or DispatchCode.GENERATION_FAILED,
        f"engine {refusal.engine_id} refused the request: {refusal.message}",
        refusal.status,
    )


class Tracked:
    """The ASGI ``send`` of one request, remembering whether the response has started (an
    error after that can only be told inside the stream)."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id  # on every reply, errors included
        self.started = False
        self.ended = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.ended = True
        await self._send(message)


async def send_error(send: Send, code: str, message: str, status: int | None = None) -> None:
    """Answer a refusal on ``send``: a whole error response, or one SSE error event when the
    response has started (then the stream ends)."""
    status = status or STATUS_OF_CODE.get(code, 409)
    if isinstance(send, Tracked) and send.started:
        if not send.ended:  # mid-stream: one SSE error event, then the stream ends
            event = b"data: " + error_body(code, message, status) + b"\n\n"
            await send({"type": "http.response.body", "body": event})
        return
    retry = b"true" if code in RETRYABLE_CODES else b"false"
    headers = [(b"content-type", b"application/json"), (b"x-should-retry", retry)]
    if isinstance(send, Tracked):  # the id that a provenance row of it, if any, is under
        headers.append((b"x-request-id", send.request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(code, message, status)})
