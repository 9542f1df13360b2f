"""One place where HTTP outcomes become engine outcomes (clean vs ambiguous).

Every HTTP engine adapter sends through :func:`request`, so the classification cannot differ
between adapters:

* transport failures after the request may have left this process (timeouts, resets, a
  half-read reply) -> :class:`AmbiguousReply`;
* connection refused -> :class:`AmbiguousReply` with ``dispatched=False`` (nothing was sent,
  but the engine's holdings are still unknown, so it is not a proof of anything);
* 5xx -> ambiguous (the server may have acted before failing);
* 4xx -> returned to the adapter, which decides whether the body is a recognised, clean refusal
  (adapters map unrecognised 4xx bodies to ambiguous: an answer we do not understand proves
  nothing);
* 2xx -> returned.

Every request goes out on a connection of its own and asks the server to close it after the
reply (``Connection: close``). A pooled idle connection can be closed by the server's
keep-alive timer (uvicorn, which serves vLLM's and SGLang's APIs: 5 s) just as a request goes
out on it; the server resets the connection with the request unread, and since nothing here is
ever resent, the caller gets an ambiguous ``CONNECTION_LOST`` for nothing. Expiring idle
connections early on the client side narrows that window but cannot close it: a server whose
event loop stalls fires its timer late, after the request has arrived (a generation in CI,
against a starved vLLM; uvloop runs a due timer before it reads the socket). A fresh connection
has no idle timer to race. It costs one loopback or LAN handshake, well under a millisecond,
nothing next to an engine call (BENCHMARKS.md, Engine HTTP connections); and because the server
closes first, the TIME_WAIT left behind is the server's, so a busy client does not run out of
ephemeral ports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from engines.contract import AmbiguousReply, ErrorCode

# Sent with every request: see the module docstring.
ONE_REQUEST_PER_CONNECTION = {"Connection": "close"}


def engine_client(base_url: str, *, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """The HTTP client every engine adapter uses: loopback/cluster traffic never goes through
    a proxy from the environment (a proxy would blur "never sent" and "sent once")."""
    return httpx.AsyncClient(base_url=base_url, trust_env=False, headers=headers)


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
    """Send once (never retried here) and classify transport-level failures. ``content`` (with
    its ``headers``) carries a binary body, e.g. a msgpack bucket, instead of ``json``. The
    request travels on a fresh connection (module docstring), through an injected client too,
    provided nothing else leaves kept-alive connections in that client's pool (httpx reuses an
    idle one whatever this request's headers say)."""
    headers = {**(headers or {}), **ONE_REQUEST_PER_CONNECTION}
    try:
        response = await client.request(
            method, path, json=json, content=content, headers=headers, timeout=timeout
        )
    except httpx.ConnectError as exc:
        raise AmbiguousReply(
            ErrorCode.ENGINE_UNREACHABLE,
            f"{method} {path}: cannot connect: {exc}",
            engine_id=engine_id,
            dispatched=False,
        ) from exc
    except httpx.TimeoutException as exc:
        raise AmbiguousReply(
            ErrorCode.TIMEOUT, f"{method} {path}: no reply within {timeout}s", engine_id=engine_id
        ) from exc
    except httpx.HTTPError as exc:
        raise AmbiguousReply(
            ErrorCode.CONNECTION_LOST, f"{method} {path}: {exc!r}", engine_id=engine_id
        ) from exc
    if response.status_code >= 500:
        raise AmbiguousReply(
            ErrorCode.SERVER_ERROR,
            f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}",
            engine_id=engine_id,
            status=response.status_code,
        )
    return response


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
