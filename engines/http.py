"""One place where HTTP outcomes become engine outcomes (clean vs ambiguous).

Every HTTP engine adapter sends through :func:`request`, and the OpenAI relay
(:func:`engines.openai_http.open_upstream`) streams through the same classification, so it
cannot differ between callers. :func:`transport_failure` and :func:`server_failure` are that
classification, written once:

* transport failures after the request may have left this process (timeouts, resets, a
  half-read reply) -> :class:`AmbiguousReply`;
* connection refused -> :class:`AmbiguousReply` with ``dispatched=False`` (nothing was sent,
  but the engine's holdings are still unknown, so it is not a proof of anything);
* 5xx -> ambiguous (the server may have acted before failing), except a 503 whose body's
  ``error.code`` is ``ENGINE_DRAINING``: a draining engine's refusal before anything ran
  (:mod:`engines.drain`), a :class:`CleanRefusal`;
* 4xx -> returned to the adapter, which decides whether the body is a recognised, clean refusal
  (adapters map unrecognised 4xx bodies to ambiguous: an answer we do not understand proves
  nothing);
* 2xx -> returned.

Engine connections are pooled (:func:`engine_client`, the one client factory of every engine
caller) and a request is never resent. The hazard of a kept-alive connection: the server's
keep-alive timer (uvicorn, which serves vLLM's and SGLang's APIs: 5 s) closes it just as a
request goes out on it; the server drops the request unread, and the caller gets an ambiguous
``CONNECTION_LOST`` for nothing (a lost generation). What keeps that away:

* **We close first.** A connection idle for :data:`POOL_IDLE_EXPIRY_S` (1 s) is closed by the
  pool and never reused, well inside the engine's 5 s. Until then the engine's timer has not
  fired, so it cannot close the connection under a request -- unless the engine's loop is
  blocked for the whole 4 s margin, from before the request arrives until the timer is due:
  uvloop (vLLM's loop) then runs the due timer before it reads the socket. A starved vLLM in CI
  lost a generation that way against httpx's default expiry, which equals uvicorn's 5 s: no
  margin at all. A caller idle for over 1 s pays one new connection (about half a millisecond,
  BENCHMARKS.md), nothing next to a generation; a busy one reuses its connections.
* **The provable case is httpcore's.** Before reusing a connection, httpcore's pool checks its
  socket: a connection the server closed or reset (its FIN or RST arrived) is dropped and the
  request goes out on a new one, before any byte of it was written. That is the only point at
  which "never left" is provable: once the head is handed to the socket, a reset, a timeout or
  "Server disconnected without sending a response" may come after the server read the request
  (a reset that arrives between that check and the write looks exactly the same: asyncio
  swallows the failed write, and the error surfaces on the read). So nothing is resent here:
  every such failure is an ambiguous ``CONNECTION_LOST`` (at most once; never silent).

An engine whose keep-alive is shorter than :data:`POOL_IDLE_EXPIRY_S` (not uvicorn's default)
closes connections the pool still holds: a reuse after its FIN arrived is safe (the check
above), but a request that crosses the FIN on the wire is lost, ambiguously, as above;
``tests/engines/test_connection_pool.py`` runs that race against a real uvicorn.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from engines.contract import AmbiguousReply, CleanRefusal, EngineError, ErrorCode
from engines.http_pool import ShardedTransport

# uvicorn's default ``timeout_keep_alive``, with which vLLM and SGLang serve their APIs.
ENGINE_KEEP_ALIVE_S = 5.0
# How long a pooled engine connection may stay idle before the pool closes it: under the
# engine's keep-alive with a margin of 4 s for a blocked engine loop (module docstring).
POOL_IDLE_EXPIRY_S = 1.0
# Connections per client (httpx's default cap) and as many kept idle, so a burst of concurrent
# calls does not close and reopen connections on every request.
POOL_MAX_CONNECTIONS = 100
# Shards of the pool (engines.http_pool): each holds at most 13 of the 100 connections, so the
# pool's per-request bookkeeping stays small at any concurrency.
POOL_SHARDS = 8


def engine_client(
    base_url: str = "", *, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """The HTTP client every engine caller uses (adapters, the OpenAI relay): a pool of
    kept-alive connections per engine that closes idle ones before the engine would (module
    docstring), in shards (:mod:`engines.http_pool`). Loopback/cluster traffic never goes
    through a proxy from the environment (a proxy would blur "never sent" and "sent once")."""
    limits = httpx.Limits(
        max_connections=POOL_MAX_CONNECTIONS,
        max_keepalive_connections=POOL_MAX_CONNECTIONS,
        keepalive_expiry=POOL_IDLE_EXPIRY_S,
    )
    return httpx.AsyncClient(
        base_url=base_url,
        trust_env=False,
        headers=headers,
        transport=ShardedTransport(limits, shards=POOL_SHARDS),
    )


async def request(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    engine_id: str,
    timeout: float,
    json: Any = None,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    """Send once (never resent: module docstring) and classify transport-level failures.
    ``content`` (with its ``headers``) carries a binary body, e.g. a msgpack bucket, instead of
    ``json``. ``client`` is an :func:`engine_client` pool.

    A binary body is sent as a one-shot stream (with its ``Content-Length``: the same bytes on
    the wire). Why: httpx keeps each response in a reference cycle with its request, freed
    only when the cyclic garbage collector runs, and a ``bytes`` body stays alive as long;
    a staged transfer sends bucket after bucket of several MiB, which piled up (16 buckets of
    4 MiB alive at once), while a finished stream holds nothing."""
    headers = dict(headers or {})
    what = f"{method} {path}"
    body: AsyncIterator[bytes] | None = None
    if content is not None:
        headers["Content-Length"] = str(len(content))
        body = _once(content)
        del content
    try:
        response = await client.request(
            method, path, json=json, content=body, headers=headers, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise transport_failure(exc, what, engine_id=engine_id, timeout=timeout) from exc
    failure = await server_failure(response, what, engine_id=engine_id)
    if failure is not None:
        raise failure
    return response


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def transport_failure(
    exc: httpx.HTTPError,
    what: str,
    *,
    engine_id: str,
    timeout: httpx.Timeout | float | None = None,
) -> AmbiguousReply:
    """What a transport failure of ``what`` (``"POST /generate"``) proves: never anything
    about the engine's state (ambiguous), and whether the request may have left.

    Only a failure to connect proves it did not (``ENGINE_UNREACHABLE``, ``dispatched=False``:
    another holder may take it). httpx raises :class:`httpx.ConnectError` only while
    establishing a connection, before a byte of the request is written, so this holds wherever
    the failure is caught, body reads included. A timeout (``TIMEOUT``) or any other transport
    error (``CONNECTION_LOST``: a reset, a half-read reply) may come after the engine read the
    request: it may have acted, and the request is never resent."""
    if isinstance(exc, httpx.ConnectError):
        return AmbiguousReply(
            ErrorCode.ENGINE_UNREACHABLE,
            f"{what}: cannot connect: {exc}",
            engine_id=engine_id,
            dispatched=False,
        )
    if isinstance(exc, httpx.TimeoutException):
        within = f" (no reply within {timeout}s)" if isinstance(timeout, int | float) else ""
        return AmbiguousReply(ErrorCode.TIMEOUT, f"{what}: timed out{within}", engine_id=engine_id)
    if isinstance(exc, httpx.LocalProtocolError):
        # Refused before sending (an illegal header, most often): the client's message quotes
        # the header value, which may be the Authorization token; it never reaches a log line.
        return AmbiguousReply(
            ErrorCode.CONNECTION_LOST,
            f"{what}: the HTTP client refused the request ({type(exc).__name__}; its text "
            "is not shown: it may quote a header value such as a token)",
            engine_id=engine_id,
        )
    return AmbiguousReply(ErrorCode.CONNECTION_LOST, f"{what}: {exc!r}", engine_id=engine_id)


async def server_failure(
    response: httpx.Response, what: str, *, engine_id: str
) -> EngineError | None:
    """A 5xx answer to ``what``, as an ambiguous ``SERVER_ERROR`` (the server may have acted
    before failing) quoting the start of its body; None for every other status (a 2xx is the
    reply, a 4xx the caller's to read). Works on a streamed response too: only a 5xx body is
    read here, and a failure while reading it is classified like any transport failure.

    The one 5xx that proves something: a draining engine's ``503`` with the code
    ``ENGINE_DRAINING`` (:mod:`engines.drain`), refused before anything ran: a clean
    ``ENGINE_DRAINING`` refusal, which the gateway sends to another holder."""
    status = response.status_code
    if status < 500:
        return None
    try:
        body = await response.aread()
    except httpx.HTTPError as exc:
        return transport_failure(exc, what, engine_id=engine_id)
    draining = _draining_message(status, body)
    if draining is not None:
        return CleanRefusal(
            ErrorCode.ENGINE_DRAINING,
            f"{what}: {draining}",
            engine_id=engine_id,
            status=status,
        )
    return AmbiguousReply(
        ErrorCode.SERVER_ERROR,
        f"{what}: HTTP {status}: {body[:300].decode(errors='replace')}",
        engine_id=engine_id,
        status=status,
    )


def _draining_message(status: int, body: bytes) -> str | None:
    """The message of a draining engine's refusal (503, ``error.code`` ``ENGINE_DRAINING``),
    or None for any other 5xx."""
    if status != 503:
        return None
    try:
        reply = json.loads(body)
    except ValueError:
        return None
    error = reply.get("error") if isinstance(reply, dict) else None
    if not isinstance(error, dict) or error.get("code") != ErrorCode.ENGINE_DRAINING:
        return None
    return str(error.get("message") or "the engine is draining")


def json_body(response: httpx.Response, *, engine_id: str) -> Any:
    """The JSON body, or an ambiguous MALFORMED_REPLY (a reply we cannot read proves nothing)."""
    try:
        return response.json()
    except ValueError as exc:
        raise AmbiguousReply(
            ErrorCode.MALFORMED_REPLY,
            f"HTTP {response.status_code} body is not JSON: {response.text[:200]!r}",
            engine_id=engine_id,
            status=response.status_code,
        ) from exc
