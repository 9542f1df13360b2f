"""A benchmark stub of a vLLM OpenAI server: answers at once, in a process of its own.

Test double for ``loraledger bench gateway`` only (named as such): what the benchmark needs is
an engine whose own cost is as close to nothing as an HTTP server on the same stack allows, so
that whatever a proxy or the gateway adds in front of it shows. It speaks the parts of vLLM's
API (docs/engines.md, vLLM) that loraledger and an OpenAI client use, with vLLM's reply shapes:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: non-streaming, or ``stream: true``
  as server-sent events, one content chunk per token, ``max_tokens`` tokens (default 16), then
  ``data: [DONE]``. A usage chunk (``choices: []``) comes before ``[DONE]`` only when the request
  sets ``stream_options.include_usage``, as vLLM does. Each streamed token's text is the
  server's ``time.monotonic_ns()`` when the chunk was written (the system-wide monotonic clock
  on Linux), so a client on the same machine can tell how long each chunk took to reach it.
  ``--chunk-interval-ms`` spaces the chunks (a decode step); the first chunk is never delayed.
* vLLM's runtime LoRA API, enough for :class:`engines.vllm.VLLMEngine` to publish to it:
  ``POST /v1/load_lora_adapter`` (200 text; 400 ``InvalidUserInput`` "has already been loaded";
  404 ``NotFoundError`` "No adapter found" when the path is not a directory),
  ``POST /v1/unload_lora_adapter`` (200 text; 404 "cannot be found"), ``GET /v1/models`` (the
  base card with ``parent`` null, one card per adapter with ``root`` = its path and ``parent`` =
  the base), ``GET /metrics`` (``process_start_time_seconds``: the incarnation signal, and
  ``vllm:lora_requests_info``: the adapters of the streams running now, the signal
  :meth:`engines.vllm.VLLMEngine.abort_request` reads to know a request has ended) and
  ``GET /health``. A generation for a model that is neither the base nor a loaded adapter is
  vLLM's 404 "The model `x` does not exist.".

Generations compute nothing: the reply is ``"ok"`` tokens. It imports no torch. Their token ids
are ``7`` for the base model and, for an adapter, a function of the prompt and of the bytes of
the files loaded under its name (hashed at load), as a real engine's greedy tokens depend on the
weights: other weights loaded under a name answer a canary differently.

Run ``python -m tools.bench.stub_engine --port-file FILE`` (the port is written once the socket
listens).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

BASE_MODEL = "tiny"
DEFAULT_MAX_TOKENS = 16

_encode = msgspec.json.encode


def _json(body: Any, status: int = 200) -> Response:
    return Response(_encode(body), status_code=status, media_type="application/json")


def _error(status: int, err_type: str, message: str) -> Response:
    """vLLM's error envelope."""
    return _json(
        {"error": {"message": message, "type": err_type, "param": None, "code": status}}, status
    )


class StubEngine:
    """The state of one stub server: the adapters it holds, and its start time."""

    def __init__(self, *, base_model: str = BASE_MODEL, chunk_interval_s: float = 0.0) -> None:
        self.base_model = base_model
        self.chunk_interval_s = chunk_interval_s
        self.started = time.time()
        self.adapters: dict[str, str] = {}  # name -> path, in load order
        self.contents: dict[str, bytes] = {}  # name -> hash of the files loaded under it
        self.running: Counter[str] = Counter()  # adapter -> streams being written now

    # --- LoRA management --------------------------------------------------------------------

    async def load(self, request: Request) -> Response:
        body = msgspec.json.decode(await request.body())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be set.")
        if name == self.base_model:
            return _error(
                400,
                "InvalidUserInput",
                f"The lora adapter name '{name}' conflicts with a served base model name.",
            )
        if name in self.adapters:
            return _error(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if not await anyio.Path(path).is_dir():
            return _error(
                404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}"
            )
        self.adapters[name] = path
        self.contents[name] = await _hash_files(anyio.Path(path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        name = msgspec.json.decode(await request.body()).get("lora_name")
        if not name:
            return _error(400, "InvalidUserInput", "'lora_name' needs to be provided.")
        self.contents.pop(name, None)
        if self.adapters.pop(name, None) is None:
            return _error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, _request: Request) -> Response:
        created = int(self.started)
        cards = [
            {
                "id": self.base_model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.base_model,
                "parent": None,
            }
        ]
        cards += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base_model,
            }
            for name, path in self.adapters.items()
        ]
        return _json({"object": "list", "data": cards})

    async def metrics(self, _request: Request) -> Response:
        running = ",".join(name for name, n in self.running.items() if n > 0)
        return PlainTextResponse(
            "# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {self.started:.2f}\n"
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{max(len(self.adapters), 1)}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {time.time():.6f}\n'
        )

    async def health(self, _request: Request) -> Response:
        return Response(status_code=200)

    # --- generation -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return _error(400, "BadRequestError", f"invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return _error(400, "BadRequestError", "the body must be a JSON object")
        model = body.get("model", self.base_model)
        if model != self.base_model and model not in self.adapters:
            return _error(404, "NotFoundError", f"The model `{model}` does not exist.")
        max_tokens = body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "BadRequestError", f"max_tokens={max_tokens!r} must be >= 1")
        prompt_tokens = len(body.get("messages") or ()) if chat else 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            options = body.get("stream_options") or {}
            include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
            return StreamingResponse(
                self._stream(
                    rid, created, model, max_tokens, chat, usage if include_usage else None
                ),
                media_type="text/event-stream",
            )
        text = "ok" * max_tokens
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {
                "index": 0,
                "text": text,
                "token_ids": self._token_ids(model, str(body.get("prompt", "")), max_tokens),
                "finish_reason": "length",
            }
        )
        return _json(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _token_ids(self, model: str, prompt: str, n: int) -> list[int]:
        """``7``s for the base model; for an adapter, ids drawn from its content and the prompt
        (deterministic: the same bytes and prompt always give the same tokens)."""
        content = self.contents.get(model)
        if content is None:
            return [7] * n
        seed = hashlib.sha256(content + prompt.encode()).digest()
        return [1 + seed[i % len(seed)] for i in range(n)]

    async def _stream(
        self,
        rid: str,
        created: int,
        model: str,
        tokens: int,
        chat: bool,
        usage: dict[str, int] | None,
    ) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        adapter = model != self.base_model
        if adapter:
            self.running[model] += 1
        try:
            async for chunk in self._chunks(rid, created, model, tokens, chat, usage, kind):
                yield chunk
        finally:
            if adapter:
                self.running[model] -= 1

    async def _chunks(
        self,
        rid: str,
        created: int,
        model: str,
        tokens: int,
        chat: bool,
        usage: dict[str, int] | None,
        kind: str,
    ) -> AsyncIterator[bytes]:
        for i in range(tokens):
            if i and self.chunk_interval_s:
                await anyio.sleep(self.chunk_interval_s)
            stamp = str(time.monotonic_ns())
            last = i == tokens - 1
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "delta": {"content": stamp},
                    "finish_reason": "length" if last else None,
                }
                if chat
                else {"index": 0, "text": stamp, "finish_reason": "length" if last else None}
            )
            chunk = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            yield b"data: " + _encode(chunk) + b"\n\n"
        if usage is not None:
            chunk = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            yield b"data: " + _encode(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/metrics", self.metrics),
                Route("/health", self.health),
            ]
        )


async def _hash_files(directory: anyio.Path) -> bytes:
    digest = hashlib.sha256()
    for path in sorted([p async for p in directory.iterdir()], key=lambda p: p.name):
        if await path.is_file():
            digest.update(path.name.encode() + b"\0" + await path.read_bytes())
    return digest.digest()


def listen_and_run(app: Any, port_file: str) -> None:
    """Serve ``app`` with uvicorn on a free loopback port, written to ``port_file`` (atomically,
    once the socket listens). Shared by the benchmark's proxy."""
    import uvicorn

    # proto=IPPROTO_TCP, as asyncio's own listeners have: only then does asyncio set
    # TCP_NODELAY on accepted connections (tools/bench/http.py says why that matters).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(tmp, port_file)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", backlog=4096
    )
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.stub_engine", description=__doc__)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    stub = StubEngine(base_model=args.base_model, chunk_interval_s=args.chunk_interval_ms / 1000)
    listen_and_run(stub.app(), args.port_file)


if __name__ == "__main__":
    main()
