"""One client request of the OpenAI face, parsed: its body, its session, its ids.

* **Session**: header ``x-session-id``, else the body's ``session_id`` (taken out of the body:
  no engine sees it). With neither, the request is a one-turn session, named here after a new
  uuid -- never after the client's ``x-request-id``: an SDK resends the same headers after a
  retryable refusal, and a released session never binds again.
* **Request ids**: the client's ``x-request-id`` (or a new one) is echoed on every reply and is
  the provenance key. It is a label (a trace id in default headers, a proxy's stamp, an SDK
  retry while the first try is being aborted), while engines key running requests by their id
  (vLLM refuses a duplicate; SGLang aborts by prefix), so the id the engine sees is made unique.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from engines import guard

MAX_SESSION_CHARS = 256
SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"


class BadRequest(Exception):
    """A request the face cannot parse (400, ``INVALID_INPUT``): the message says why."""


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    """One client request, parsed."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    body: dict[str, Any]  # the client's body, without ``session_id``
    session: str
    one_turn: bool  # no session was given: bound, served, released
    request_id: str  # the client's x-request-id (or a new one): echoed, the provenance key
    engine_request_id: str  # what the engine sees: unique among its running requests
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk of a stream

    @property
    def model(self) -> str:
        model: str = self.body["model"]
        return model


def parse_ask(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    chat: bool,
    alias: str,
    max_body_bytes: int,
    one_turn_prefix: str,
) -> Ask:
    """The request of ``raw`` (its body) and ``headers`` (lower-case names), or
    :class:`BadRequest`. ``one_turn_prefix`` starts the name of a one-turn session."""
    if len(raw) > max_body_bytes:
        raise BadRequest(f"the body is over {max_body_bytes} bytes")
    try:
        body = guard.strict_json(raw)
    except guard.BadBody as exc:
        raise BadRequest(str(exc)) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise BadRequest(f"model is required: {alias!r} means your session's version")
    in_body = body.pop("session_id", None)
    session = headers.get(SESSION_HEADER) or in_body
    if session is not None and (
        not isinstance(session, str)
        or not 0 < len(session) <= MAX_SESSION_CHARS
        or not session.isprintable()
    ):
        raise BadRequest(f"a session id is 1-{MAX_SESSION_CHARS} printable characters")
    given = headers.get(REQUEST_ID_HEADER)
    rid = given or uuid.uuid4().hex
    if not usable_request_id(rid):
        raise BadRequest("x-request-id must be 1-128 printable ASCII characters")
    options = body.get("stream_options")
    return Ask(
        chat=chat,
        body=body,
        session=session or f"{one_turn_prefix}-once-{uuid.uuid4().hex}",
        one_turn=session is None,
        request_id=rid,
        engine_request_id=f"{given}-{uuid.uuid4().hex[:12]}" if given else rid,
        stream=bool(body.get("stream")),
        wants_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


def usable_request_id(text: str) -> bool:
    """1-128 printable ASCII characters. ASCII: the id goes on to the engine in a header,
    which carries nothing else (it failed there, after the bind, as an "ambiguous" dispatch
    that never left)."""
    return 0 < len(text) <= 128 and text.isprintable() and text.isascii()


def reply_request_id(headers: Mapping[str, str]) -> str:
    """The ``x-request-id`` of a refusal made before the request was parsed: the client's when
    it is a usable one, else a new one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if usable_request_id(given) else uuid.uuid4().hex
