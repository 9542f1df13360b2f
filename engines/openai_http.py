"""Forwarding an OpenAI request body to an engine's own OpenAI endpoint, once.

vLLM, SGLang and the local engine's HTTP server all serve ``POST /v1/chat/completions`` and
``POST /v1/completions``; what differs is how a request names its LoRA adapter, request id and
prefix-cache namespace (docs/engines.md):

========  =============================================  ==========================  ============
kind      adapter                                        request id                  cache
========  =============================================  ==========================  ============
vllm      ``model: <lora_name>``                         ``X-Request-Id`` header     ``cache_salt``
sglang,   ``lora_path: <lora_name>`` (a bare ``model``   ``rid`` (``/abort_request``  ``cache_salt``
local     selects nothing on SGLang's OpenAI routes)     takes it) + header          + ``extra_key``
========  =============================================  ==========================  ============

:func:`engine_body` writes those fields (over whatever the client sent for them);
:func:`open_upstream` sends the body and classifies what happens with the classification every
other engine call uses (:func:`engines.http.transport_failure`,
:func:`engines.http.server_failure`): connection refused is the only failure that proves
nothing was sent (``dispatched=False``); a timeout, a reset or a 5xx is ambiguous (so is a
failure while the caller reads the body: :func:`read_failure`); a 4xx is the engine's
refusal, read by :func:`refusal_of` with the rule of that engine's own adapter. The request
goes out on the caller's :func:`engines.http.engine_client` pool, never resent
(:mod:`engines.http` says why that pool does not lose requests to the engine's keep-alive
timer). The response is returned *streaming*: the caller reads the body chunk by chunk as the
engine writes it, and closing it (a client that went away) closes the connection (an unfinished
reply's connection never goes back to the pool), which is how every one of these engines learns
to abort the request.

This module imports nothing of the ledger: an engine is addressed by URL, kind and headers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx

from engines import sglang, vllm
from engines.contract import AmbiguousReply, CleanRefusal
from engines.http import server_failure, transport_failure

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Fields of a client body that select the adapter, name the request or the cache namespace:
# the gateway owns them; whatever the client put there is replaced, never forwarded.
ENGINE_OWNED_FIELDS = frozenset({"model", "lora_path", "lora_id", "rid", "cache_salt", "extra_key"})


def engine_body(
    body: Mapping[str, Any],
    *,
    kind: str,
    lora_name: str,
    request_id: str,
    cache_salt: str,
    stream: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """The body to send to an engine of ``kind`` for ``lora_name``: the client's fields minus
    the ones the gateway owns, plus this engine's way of naming adapter, request and cache. A
    stream always asks for usage (``include_usage``: the caller strips that chunk when its
    client did not ask for it).

    ``body``'s values are anything msgspec encodes: the client's own bytes of each field
    (``msgspec.Raw``) travel unchanged, so a conversation is never rebuilt as Python objects;
    ``stream`` is the client's ``stream``, as the caller read it, and ``stream_options``, when
    present, a mapping."""
    out = {k: v for k, v in body.items() if k not in ENGINE_OWNED_FIELDS}
    out["model"] = lora_name
    out["cache_salt"] = cache_salt
    if kind != "vllm":
        out["lora_path"] = lora_name
        out["rid"] = request_id
        out["extra_key"] = cache_salt
    if stream and include_usage:
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    return out


@asynccontextmanager
async def open_upstream(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    *,
    engine_id: str,
    request_id: str,
    headers: Mapping[str, str] | None = None,
    timeout: httpx.Timeout | float = 600.0,
) -> AsyncIterator[httpx.Response]:
    """POST ``content`` (a JSON body) to ``url`` once and yield the response as soon as its
    headers arrived, its body still streaming. Raises ``AmbiguousReply``:
    ``ENGINE_UNREACHABLE`` with ``dispatched=False`` (connection refused: nothing sent, another
    holder may take it), ``TIMEOUT`` / ``CONNECTION_LOST`` (sent, outcome unknown),
    ``SERVER_ERROR`` (a 5xx: the engine may have acted). A 4xx is yielded: the caller reads the
    engine's refusal. Errors while reading the body are the caller's to classify (ambiguous:
    see :func:`read_failure`)."""
    sent_headers = {
        "content-type": "application/json",
        "x-request-id": request_id,
        **(headers or {}),
    }
    request = client.build_request(
        "POST", url, content=content, headers=sent_headers, timeout=timeout
    )
    what = f"POST {url}"
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise transport_failure(exc, what, engine_id=engine_id, timeout=timeout) from exc
    try:
        failure = await server_failure(response, what, engine_id=engine_id)
        if failure is not None:
            raise failure
        yield response
    finally:
        await response.aclose()


def read_failure(exc: httpx.HTTPError, url: str, engine_id: str) -> AmbiguousReply:
    """A failure while reading the body of a reply from ``url``: the request had left, so it
    is ambiguous and never resent (:func:`engines.http.transport_failure`)."""
    return transport_failure(exc, f"POST {url}", engine_id=engine_id)


def refusal_of(
    status: int, reply: object, *, kind: str, lora_name: str, engine_id: str
) -> CleanRefusal:
    """What an engine's 4xx reply to a forwarded generation of ``lora_name`` means, read by the
    rule its own adapter applies to the same reply (:func:`engines.vllm.generation_refusal`,
    :func:`engines.sglang.generation_refusal`, the local engine answering in SGLang's terms), so
    both paths agree on what ``NOT_LOADED`` is: vLLM's 404 "model does not exist", SGLang's
    400 "not loaded" texts, the local engine's coded 400. A 4xx that rule does not recognise
    keeps the code the engine gave, if any (vLLM and SGLang give the HTTP status): it is still a
    refusal before anything ran (both validate before scheduling), only not one the gateway
    acts on.
    ``reply`` is the decoded body: ``{"error": {...}}`` (vLLM, the local engine) or the error
    object itself (SGLang's OpenAI routes)."""
    error = reply.get("error", reply) if isinstance(reply, dict) else None
    if not isinstance(error, dict) or "message" not in error:
        return CleanRefusal("", f"HTTP {status}", engine_id=engine_id, status=status)
    message = str(error["message"])
    given = error.get("code")
    if kind == "vllm":
        code = vllm.generation_refusal(
            status, str(error.get("type") or ""), message, error.get("param"), lora_name
        )
    else:
        code = sglang.generation_refusal(status, given, message)
    if code is None:  # as the engine gave it (vLLM's and SGLang's is the HTTP status)
        code = str(given) if given not in (None, "") else ""
    return CleanRefusal(code, message, engine_id=engine_id, status=status)
