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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from engines.contract import AmbiguousReply, ErrorCode

# Servers close idle keep-alive connections after a few seconds (uvicorn, which serves vLLM's
# and SGLang's HTTP APIs, after 5 s). A client that keeps them as long reuses a connection the
# server is closing just as a request goes out: a spurious CONNECTION_LOST (ambiguous, never
# resent, but an attempt lost for nothing). Expire ours well before.
KEEPALIVE_EXPIRY_S = 2.0


def engine_client(base_url: str, *, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """The HTTP client every engine adapter uses: loopback/cluster traffic never goes through
    a proxy from the environment, and idle connections expire before the server's do."""
    return httpx.AsyncClient(
        base_url=base_url,
        trust_env=False,
        headers=headers,
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
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
    """Send once (never retried here) and classify transport-level failures. ``content`` (with
    its ``headers``) carries a binary body, e.g. a msgpack bucket, instead of ``json``."""
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
