"""One attempt of the OpenAI face: the client's body forwarded once to one engine's own OpenAI
endpoint, and the engine's reply relayed to the client as it arrives.

The body is rewritten for the engine's kind by :func:`engines.openai_http.engine_body` (adapter
name, request id, cache namespace) and sent by :func:`engines.openai_http.open_upstream`, which
classifies what happens like every other engine call: connection refused is the only failure
that proves nothing was sent; a timeout, a reset or a 5xx is ambiguous; a 4xx is the engine's
refusal, raised as :class:`~engines.contract.CleanRefusal` before anything reached the client
(the dispatch executor then decides between another holder and relaying it).

**Streaming** passes the engine's SSE events through as they arrive (framed, never held); usage
is always asked of the engine, and its chunk is dropped when the client did not ask. A client
that disconnects cancels the relay, which closes the engine's connection (the engine aborts).
**Headers** before the first byte: ``x-loraledger-version``, ``-digest``, ``-engine``,
``-staleness`` and ``x-request-id`` (the client's or a new one), the provenance key.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterable
from typing import Any, cast

import httpx
import msgspec
from starlette.types import Send

from engines.contract import CleanRefusal
from engines.http import engine_client
from engines.openai_http import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    engine_body,
    open_upstream,
    read_failure,
    refusal_of,
)
from publisher.core.outcomes import Bound
from publisher.gateway import Attempt, DispatchCode
from publisher.gateway.provenance import Usage
from publisher.logs import get_logger
from publisher.openai.admission import Ask
from publisher.openai.errors import STATUS_OF_CODE, error_body

log = get_logger("loraledger.openai")

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]"


class EngineRoute(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach one engine's OpenAI endpoint."""

    engine_id: str
    kind: str
    base_url: str


def engine_routes(engines: Iterable[Any]) -> dict[str, EngineRoute]:
    """The OpenAI endpoint of every engine handle in ``engines`` (a fleet) that has one (an
    HTTP adapter: its ``capabilities.endpoint``); in-process engines have none and are left
    out: this face never routes to them."""
    return {
        e.engine_id: EngineRoute(
            engine_id=e.engine_id, kind=e.kind, base_url=e.capabilities.endpoint.rstrip("/")
        )
        for e in engines
        if e.capabilities.endpoint
    }


class UsageReader:
    """What the engine reports of a reply as it streams by, for its provenance row."""

    __slots__ = ("cached", "completion", "finish", "prompt", "served")

    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0
        self.finish = ""
        self.served: str | None = None

    def read(self, reply: Any) -> None:
        if not isinstance(reply, dict):
            return
        if isinstance(reply.get("model"), str) and self.served is None:
            self.served = reply["model"]
        usage = reply.get("usage")
        if isinstance(usage, dict):
            self.prompt = int(usage.get("prompt_tokens") or 0)
            self.completion = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached = int(details.get("cached_tokens") or 0)
        for choice in reply.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])

    def usage(self, outcome: str) -> Usage:
        """The row's usage, ended by ``outcome`` (the engine's finish reason of a relayed
        reply, or how the attempt ended: ``ambiguous``, ``engine_error``, ``client_abort``)."""
        return Usage(
            prompt_tokens=self.prompt,
            completion_tokens=self.completion,
            cached_tokens=self.cached,
            finish_reason=outcome,
            served_name=self.served,
        )


class Relay:
    """Sends attempts to engines over one pooled client (:func:`engines.http.engine_client`,
    with the engines' token and the timeouts)."""

    def __init__(
        self,
        *,
        engine_token: str | None,
        upstream_timeout_s: float,
        connect_timeout_s: float,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._client = client or engine_client()
        self._headers = {"authorization": f"Bearer {engine_token}"} if engine_token else {}
        self._timeout = httpx.Timeout(upstream_timeout_s, connect=connect_timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def forward(
        self,
        ask: Ask,
        bound: Bound,
        route: EngineRoute,
        attempt: Attempt,
        staleness: int,
        usage: UsageReader,
        send: Send,
    ) -> str:
        """Send once and relay the reply. Returns the provenance outcome: the engine's finish
        reason of a reply relayed whole, ``engine_error`` or ``ambiguous`` for a stream that
        did not finish (the client was told in the stream). Raises the engine's
        :class:`~engines.contract.CleanRefusal` (a 4xx, nothing sent to the client) or an
        ``AmbiguousReply``."""
        body = engine_body(
            ask.fields,
            kind=route.kind,
            lora_name=bound.lora_name,
            request_id=attempt.request_id,
            cache_salt=attempt.cache_salt,
            stream=ask.stream,
            include_usage=True,
        )
        url = route.base_url + (CHAT_PATH if ask.chat else COMPLETIONS_PATH)
        async with open_upstream(
            self._client,
            url,
            _json.encode(body),
            engine_id=route.engine_id,
            request_id=attempt.request_id,
            headers=self._headers,
            timeout=self._timeout,
        ) as response:
            if response.status_code != 200:
                raise await _refusal(response, route, bound.lora_name)
            headers = _headers_for(ask, bound, route, staleness, response)
            if not ask.stream:
                try:
                    payload = await response.aread()
                except httpx.HTTPError as exc:
                    raise read_failure(exc, url, route.engine_id) from exc
                with contextlib.suppress(msgspec.DecodeError):
                    usage.read(msgspec.json.decode(payload))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": payload})
                return usage.finish or "stop"
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            try:
                failed = await _relay_stream(ask, response, usage, send, route.engine_id)
            except httpx.HTTPError as exc:
                # Mid-stream: the status is sent; the error goes in the stream.
                raise read_failure(exc, url, route.engine_id) from exc
            return failed or usage.finish or "stop"


async def _relay_stream(
    ask: Ask, response: httpx.Response, usage: UsageReader, send: Send, engine_id: str
) -> str | None:
    """Pass SSE events on as they arrive. Events are framed (an event cut across two reads
    waits for its end, nothing longer) so the usage chunk can be read and dropped when the
    client did not ask for it. The engine's byte iterator is closed here, when the relay ends
    (a client gone mid-stream included), not whenever the garbage collector finds it (a CI run
    logged such a late close failing: "async generator already executing").

    Returns the provenance outcome of a stream that did not finish, None for one that did.
    Every OpenAI stream ends with ``data: [DONE]``; an engine that fails mid-stream (vLLM,
    SGLang) sends an error event first: relayed as it is, and the row says ``engine_error``. A
    stream that ends without ``[DONE]`` was cut (the local engine ends a failed generation so):
    the client gets an ``AMBIGUOUS_DISPATCH`` error event, so its SDK raises instead of taking a
    partial sample for a whole one, and the row says ``ambiguous``, as for a connection broken
    mid-stream. The cut tail of an unfinished event is dropped, not sent: an SSE client
    dispatches an event only at its blank line, so half an event is none, and glued to the
    error event it would make that event unreadable too."""
    pending = b""
    done = False
    error: Any = None
    raw = cast(AsyncGenerator[bytes, None], response.aiter_raw())  # annotated an iterator
    async with contextlib.aclosing(raw) as chunks:
        async for data in chunks:
            pending += data
            if b"\n\n" not in pending:
                continue
            *events, pending = pending.split(b"\n\n")
            out = []
            for event in events:
                if event.strip() == _DONE:
                    done = True
                elif b'"error"' in event and error is None:
                    error = _stream_error(event)
                if b'"usage"' in event or b'"finish_reason":"' in event:
                    usage.read(_event_json(event))
                    if not ask.wants_usage and b'"choices":[]' in event:
                        continue  # the usage chunk the client did not ask for
                elif usage.served is None and event.startswith(b"data: {"):
                    usage.read(_event_json(event))
                out.append(event + b"\n\n")
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    done = done or pending.strip() == _DONE
    if error is not None:
        log.error("openai.stream_error", engine=engine_id, rid=ask.request_id, error=error)
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        return "engine_error"
    if done:
        await send({"type": "http.response.body", "body": pending, "more_body": False})
        return None
    log.error("openai.stream_cut", engine=engine_id, rid=ask.request_id)
    message = (
        f"the stream of request {ask.request_id} from {engine_id} ended without [DONE]: "
        "the generation was cut off and its outcome is unknown; it was not resent"
    )
    status = STATUS_OF_CODE.get(DispatchCode.AMBIGUOUS_DISPATCH, 502)
    event = b"data: " + error_body(DispatchCode.AMBIGUOUS_DISPATCH, message, status)
    await send({"type": "http.response.body", "body": event + b"\n\n"})
    return "ambiguous"


async def _refusal(response: httpx.Response, route: EngineRoute, lora_name: str) -> CleanRefusal:
    """A 4xx: the engine refused before generating, read by its adapter's rule
    (:func:`engines.openai_http.refusal_of`: vLLM's 404 "model does not exist" is
    ``NOT_LOADED``), so both faces report the same refusals as engine trouble."""
    try:
        reply = msgspec.json.decode(await response.aread())
    except (httpx.HTTPError, msgspec.DecodeError):
        reply = None
    return refusal_of(
        response.status_code,
        reply,
        kind=route.kind,
        lora_name=lora_name,
        engine_id=route.engine_id,
    )


def _headers_for(
    ask: Ask, bound: Bound, route: EngineRoute, staleness: int, response: httpx.Response
) -> list[tuple[bytes, bytes]]:
    media = response.headers.get("content-type", "application/json")
    headers = [
        (b"content-type", media.encode()),
        (b"x-loraledger-version", str(bound.version_id).encode()),
        (b"x-loraledger-digest", bound.digest.encode()),
        (b"x-loraledger-engine", route.engine_id.encode()),
        (b"x-loraledger-staleness", str(staleness).encode()),
        (b"x-request-id", ask.request_id.encode()),
    ]
    if not ask.one_turn:
        headers.append((b"x-session-id", ask.session.encode()))
    if ask.stream:
        headers.append((b"cache-control", b"no-cache"))
    return headers


def _stream_error(event: bytes) -> Any:
    """The ``error`` of an SSE error event (``data: {"error": {...}}``, as vLLM and SGLang send
    one mid-stream), or None for any other event (a completion whose text says "error")."""
    reply = _event_json(event)
    if isinstance(reply, dict) and "error" in reply and not reply.get("choices"):
        return reply["error"] or "error"
    return None


def _event_json(event: bytes) -> Any:
    for line in event.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                return msgspec.json.decode(line[6:])
            except msgspec.DecodeError:
                return None
    return None
