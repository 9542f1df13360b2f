"""The local engine's OpenAI-compatible routes: ``POST /v1/completions`` and
``POST /v1/chat/completions``, streaming (SSE) or not.

They reproduce SGLang 0.5.x's OpenAI face (docs/engines.md), because the local engine stands in
for a GPU SGLang server in the tests of the OpenAI gateway:

* the adapter is chosen as SGLang chooses it: ``"model": "<served>:<adapter>"``, else the part
  after the first ``:``, else the body field ``lora_path``; a bare ``"model": "<adapter>"``
  selects **nothing** (the base model serves it), exactly the trap a gateway must avoid;
* ``rid`` (body) or the ``X-Request-Id`` header names the request (``/abort_request`` stops it);
  ``cache_salt``/``extra_key`` namespace the prefix cache;
* ``stream: true`` sends one SSE chunk per decoded token as it is decoded, a last chunk with the
  ``finish_reason``, the usage chunk (``choices: []``) only with
  ``stream_options.include_usage``, then ``data: [DONE]``;
* usage carries ``prompt_tokens_details.cached_tokens`` (the prefix cache's hit), as SGLang and
  vLLM report it;
* a client that disconnects cancels its request (its adapter lease is released at once).

A request the engine refuses before generating (an unknown adapter, a bad parameter) is
answered ``400`` with ``{"error": {"message", "type", "code"}}`` even when it asked for a stream:
the stream's headers go out only once the first token (or the end) exists. Chat prompts are
rendered with a fixed template (:func:`render_chat`): the tiny model has none of its own.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engines import guard
from engines.contract import EngineError, ErrorCode, Generation, SamplingParams
from engines.local.engine import LocalEngine

_json = msgspec.json.Encoder()
# OpenAI parameters the sampler does not implement: a non-neutral value is refused, never
# silently ignored (it would sample from another distribution).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "top_k": (None, -1, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
}


class OpenAIBadRequest(Exception):
    """A request this face refuses before anything is generated (400)."""


def error_reply(message: str, code: str, status: int = 400) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": code}}
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def render_chat(messages: Any) -> str:
    """A fixed chat template: one ``<|role|>`` line per message, then ``<|assistant|>``. A later
    turn (the same messages plus the reply and a new message) renders to an extension of the
    earlier prompt, which is what lets the prefix cache serve it."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIBadRequest("messages must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIBadRequest("each message must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts) or len(texts) != len(content):
                raise OpenAIBadRequest("only text content parts are supported")
            content = "".join(texts)  # type: ignore[arg-type]
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise OpenAIBadRequest("message content must be a string or text parts")
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def adapter_of(body: Mapping[str, Any], served: str) -> str | None:
    """SGLang's rule (``serving_base.py``): ``served:adapter``, else split on the first ``:``,
    else the body's ``lora_path``; nothing else selects an adapter."""
    model = body.get("model")
    if isinstance(model, str):
        if model.startswith(served + ":"):
            return model[len(served) + 1 :] or None
        if ":" in model:
            return model.split(":", 1)[1] or None
    lora = body.get("lora_path")
    if lora is None:
        return None
    if not isinstance(lora, str):
        raise OpenAIBadRequest("lora_path must be an adapter name")
    return lora


class Parsed(msgspec.Struct, frozen=True, kw_only=True):
    chat: bool
    prompt: str | tuple[int, ...]
    adapter: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    model: str
    namespace: tuple[str | None, str | None]


def parse(body: Any, *, chat: bool, served: str, header_rid: str | None) -> Parsed:
    if not isinstance(body, dict):
        raise OpenAIBadRequest("body must be a JSON object")
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise OpenAIBadRequest(f"parameter {key}={body[key]!r} is not supported")
    prompt: str | tuple[int, ...]
    if chat:
        prompt = render_chat(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]  # a batch of one
        if isinstance(raw, str):
            prompt = raw
        elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
            prompt = tuple(raw)
        else:
            raise OpenAIBadRequest("prompt must be a string or a list of token ids")
        max_tokens = body.get("max_tokens", 16)
    stop = body.get("stop") or ()
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIBadRequest("stream_options must be an object")
    try:
        params = SamplingParams(
            max_tokens=int(128 if max_tokens is None else max_tokens),
            temperature=float(_or(body.get("temperature"), 1.0)),
            top_p=float(_or(body.get("top_p"), 1.0)),
            seed=None if body.get("seed") is None else int(body["seed"]),
            stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=False,
            n=int(body.get("n") or 1),
        )
    except (TypeError, ValueError) as exc:
        raise OpenAIBadRequest(f"bad sampling parameter: {exc}") from exc
    rid = body.get("rid") or header_rid or uuid.uuid4().hex
    salt, extra = body.get("cache_salt"), body.get("extra_key")
    model = body.get("model")
    return Parsed(
        chat=chat,
        prompt=prompt,
        adapter=adapter_of(body, served),
        params=params,
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)),
        request_id=str(rid),
        model=model if isinstance(model, str) else served,
        namespace=(None if salt is None else str(salt), None if extra is None else str(extra)),
    )


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


def _usage(gen: Generation) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in gen.choices) or len(gen.token_ids)
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": gen.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _samples(gen: Generation) -> list[tuple[int, str, str]]:
    if gen.choices:
        return [(c.index, c.text, c.finish_reason) for c in gen.choices]
    return [(0, gen.text, gen.finish_reason)]


def render_full(p: Parsed, gen: Generation, created: int) -> dict[str, Any]:
    """The non-streaming reply."""
    if p.chat:
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            for i, text, finish in _samples(gen)
        ]
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
            for i, text, finish in _samples(gen)
        ]
    return {
        "id": p.request_id,
        "object": "chat.completion" if p.chat else "text_completion",
        "created": created,
        "model": p.model,
        "choices": choices,
        "usage": _usage(gen),
    }


def _sse(data: Any) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


class CompletionStream:
    """One streaming completion as an ASGI response, with structured concurrency: the
    generation, the client's disconnect watch and the writer live in one task group, so a
    client that goes away cancels the generation (its adapter lease comes back at once)."""

    def __init__(self, engine: LocalEngine, p: Parsed) -> None:
        self.engine, self.p = engine, p
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if p.chat else "text_completion"

    def _chunk(self, index: int, text: str | None, finish: str | None, first: bool) -> bytes:
        if self.p.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return _sse(
            {
                "id": self.p.request_id,
                "object": self.kind,
                "created": self.created,
                "model": self.p.model,
                "choices": [choice],
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p = self.p
        tokens_in, tokens_out = anyio.create_memory_object_stream[tuple[int, int]](math.inf)
        outcome: list[Generation | EngineError] = []

        def forward(index: int, token: int) -> None:
            # The writer may be gone (its client disconnected; the generation is being
            # cancelled at its next token): nobody is left to hear this one.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                tokens_in.send_nowait((index, token))

        async def generate() -> None:
            try:
                gen = await self.engine.generate(
                    p.prompt,
                    p.adapter,
                    p.params,
                    request_id=p.request_id,
                    cache_salt=p.namespace[0],
                    extra_key=p.namespace[1],
                    on_token=forward,
                )
                outcome.append(gen)
            except EngineError as exc:
                outcome.append(exc)
            finally:
                tokens_in.close()

        async def watch(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            tg.start_soon(watch, tg.cancel_scope)
            await self._write(tokens_out, outcome, send)
            tg.cancel_scope.cancel()

    async def _write(
        self,
        tokens: MemoryObjectReceiveStream[tuple[int, int]],
        outcome: list[Generation | EngineError],
        send: Send,
    ) -> None:
        p = self.p
        ids: dict[int, list[int]] = {}
        sent: dict[int, str] = {}
        opened: set[int] = set()
        started = False
        async with tokens:
            while True:
                try:
                    batch = [await tokens.receive()]
                except anyio.EndOfStream:
                    break
                while True:
                    try:
                        batch.append(tokens.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                if not started:
                    started = True
                    await _start(send, "text/event-stream")
                for index, token in batch:
                    ids.setdefault(index, []).append(token)
                for index in sorted({i for i, _ in batch}):
                    text = await self.engine.detokenize(ids[index])
                    before = sent.get(index, "")
                    # A token that completes a multi-byte character can change the tail of
                    # the decoded text; only a clean extension is sent as a delta.
                    delta = text[len(before) :] if text.startswith(before) else ""
                    sent[index] = before + delta
                    first = index not in opened
                    opened.add(index)
                    await send(
                        {
                            "type": "http.response.body",
                            "body": self._chunk(index, delta, None, first),
                            "more_body": True,
                        }
                    )
        result = outcome[0] if outcome else None
        if isinstance(result, EngineError) or result is None:
            if not started:
                error = result or EngineError(ErrorCode.ENGINE_STOPPED, "no result")
                status = 400 if error.clean else 503
                reply = error_reply(error.message, error.code, status)
                await _start(send, "application/json", status)
                await send({"type": "http.response.body", "body": reply.body})
                return
            # Already streaming: the stream ends without [DONE] (the client sees a cut stream).
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if not started:
            await _start(send, "text/event-stream")
        for index, _, finish in _samples(result):
            await send(
                {
                    "type": "http.response.body",
                    "body": self._chunk(index, None, finish, False),
                    "more_body": True,
                }
            )
        if p.include_usage:
            usage = {
                "id": p.request_id,
                "object": self.kind,
                "created": self.created,
                "model": p.model,
                "choices": [],
                "usage": _usage(result),
            }
            await send({"type": "http.response.body", "body": _sse(usage), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _start(send: Send, media: str, status: int = 200) -> None:
    headers = [(b"content-type", media.encode())]
    if media == "text/event-stream":
        headers.append((b"cache-control", b"no-cache"))
    await send({"type": "http.response.start", "status": status, "headers": headers})


class _Direct(Response):
    """A Starlette response that hands the ASGI call to another callable."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


class OpenAIFace:
    """The two routes over one running engine."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        try:
            body = guard.strict_json(await request.body())
            p = parse(
                body,
                chat=chat,
                served=self.engine.served_model_name,
                header_rid=request.headers.get("x-request-id"),
            )
        except (guard.BadBody, OpenAIBadRequest) as exc:
            return error_reply(str(exc), ErrorCode.BAD_REQUEST)
        if p.stream:
            return _Direct(CompletionStream(self.engine, p))
        outcome: list[Generation | EngineError] = []

        async def run() -> None:
            try:
                outcome.append(
                    await self.engine.generate(
                        p.prompt,
                        p.adapter,
                        p.params,
                        request_id=p.request_id,
                        cache_salt=p.namespace[0],
                        extra_key=p.namespace[1],
                    )
                )
            except EngineError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await run()
            tg.cancel_scope.cancel()
        if not outcome:
            return Response(status_code=499)
        result = outcome[0]
        if isinstance(result, EngineError):
            return error_reply(result.message, result.code, 400 if result.clean else 503)
        body_out = render_full(p, result, int(time.time()))
        return Response(_json.encode(body_out), media_type="application/json")
