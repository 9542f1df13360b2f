"""One :class:`~engines.local.engine.LocalEngine` over HTTP: SGLang 0.5.x's face + staged endpoints.

Why one module of ~830 lines: it is one concept, SGLang's HTTP face of one engine; its routes,
the ``/generate`` parsing and rendering they share, and the process that serves them are read
side by side against SGLang's own server, and a difference between them is a bug. (The OpenAI
routes, ``engines.local.openai_face``, and the staged wire, ``engines.local.wire``, which follow
other references, live apart.)

**This is the test stand-in for a GPU SGLang server** (none can run on our CPU machines), so
the SGLang endpoints reproduce SGLang 0.5.23's observed behaviour (docs/engines.md), not an
idealised one:

* ``POST /load_lora_adapter`` / ``/unload_lora_adapter`` answer the ``LoRAUpdateOutput`` shape
  ``{"rid": null, "http_worker_ipc": null, "success", "error_message", "loaded_adapters"}`` with
  200 on success and 400 otherwise, with SGLang's error texts ("... because it is already
  loaded", "LoRA with name X does not exist. Loaded LoRAs: ...", "... is incompatible with the
  current LoRA memory pool configuration");
* unload returns only after the adapter's in-flight requests drained, holding the update lock
  meanwhile; an unloaded ordinary name is implicitly reloaded by a later ``/generate``;
* ``POST /generate`` takes ``text`` or ``input_ids`` (single or batch), ``sampling_params``,
  ``lora_path`` (the adapter *name*, one per batch item or one for all), ``return_logprob``,
  ``rid``, ``extra_key``/``cache_salt``; replies ``{"text", "output_ids", "meta_info"}`` (a list
  for batches and ``n > 1``); an unknown adapter is 400 ``{"error": {"message": ...}}``;
* ``POST /v1/completions`` and ``/v1/chat/completions``, streaming or not, with SGLang's
  adapter selection (``model="<served>:<adapter>"`` or ``lora_path``):
  :mod:`engines.local.openai_face`;
* ``GET /v1/models`` (base card + one card per adapter: ``id``, ``root`` = path, ``parent``),
  ``GET /server_info`` (with ``startup_time`` and, as an extension, ``incarnation`` and
  ``engine_id``), ``GET /health``, ``/health_generate``, ``/model_info``, ``/flush_cache``,
  ``/pause_generation``, ``/continue_generation``, ``/abort_request``.

Deliberate differences, all stricter: ``stream``, ``top_k``, penalties and constrained decoding
are refused with 400 rather than ignored; names with ``/`` or ``:`` are refused; managed names
(loaded through the staged endpoints) cannot be loaded over or unloaded by these ordinary calls
and are never implicitly reloaded; loraledger-only refusals carry their code as a prefix of the
message (``"NAME_PROTECTED: ..."``); an ``artifact_root`` confines every path load; error
bodies of ``/generate`` carry a ``code`` next to ``message``.

The staged endpoints (``/loraledger/*``) are described in :mod:`engines.local.wire`.

Trust (RELIABILITY.md, Security and limits): with a token (``token=``, or
``LORALEDGER_ENGINE_TOKEN`` / ``--token-file`` for the process) every control route
(:data:`CONTROL_PATHS`) needs ``Authorization: Bearer``, else 401; without one the server
refuses to listen beyond loopback (:class:`UnsafeListen`, exit 11). ``/loraledger/unload`` of a
managed name needs its attempt (``ATTEMPT_REQUIRED``). Every route caps its body (413), parses
strict JSON (400 for NaN, Infinity, 1e400, 2^80), and a request is capped in ``n`` and tokens
(:class:`~engines.local.admission.ServingLimits`); connections are capped and slow headers
timed out (:func:`engines.guard.uvicorn_limits`).

Run in process with :func:`serve` / :func:`running_server` (tests), or as a process:
``python -m engines.local.server --port 0 --engine-id e0 --artifact-root DIR`` prints the bound
port on its first stdout line (and writes ``--port-file`` if given); SIGTERM stops it.

Why one module of ~670 lines: it is one HTTP face, and its routes share the body parsing, the
error rendering and SGLang's reply shapes; the staged wire format is in :mod:`engines.local.wire`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from engines import embedded, guard
from engines.contract import (
    Candidate,
    Choice,
    CleanRefusal,
    EngineError,
    ErrorCode,
    Generation,
    SamplingParams,
)
from engines.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainGuard
from engines.local import wire
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.openai_face import OpenAIFace
from engines.tensor_wire import ROUTE as TENSOR_ROUTE
from engines.tensor_wire import PayloadError, TensorLoadRequest, decode_request

_json = msgspec.json.Encoder()
_SGLANG_VERSION = "0.5.23"
# SGLang sampling parameters we do not implement: refusing a non-default value beats silently
# sampling from another distribution.
_UNSUPPORTED_SAMPLING = {
    "top_k": (-1, None),
    "min_p": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
}


def _reply(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def _lora_update(engine: LocalEngine, success: bool, error: str | None) -> Response:
    return _reply(
        {
            "rid": None,
            "http_worker_ipc": None,
            "success": success,
            "error_message": error,
            "loaded_adapters": engine.loaded_adapters(),
        },
        200 if success else 400,
    )


def _lora_error_text(name: str, exc: EngineError) -> str:
    """SGLang's text where SGLang has one; otherwise the loraledger code as a prefix."""
    if exc.code in (ErrorCode.ALREADY_LOADED, ErrorCode.NOT_LOADED):
        return exc.message
    if exc.code == ErrorCode.RANK_UNSUPPORTED:
        return (
            f"LoRA adapter {name} is incompatible with the current LoRA memory pool "
            f"configuration: {exc.message}"
        )
    return f"{exc.code}: {exc.message}"


class _BadRequest(Exception):
    pass


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = guard.strict_json(await request.body())
    except guard.BadBody as exc:
        raise _BadRequest(str(exc)) from exc
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    return body


class _App:
    """Route handlers bound to one engine. ``sglang_info`` overrides fields of
    ``/server_info`` (``tp_size``, ``dp_size``, ``max_loaded_loras``: the launch flags a real
    server would report); ``on_bad_payload`` runs when a tensor payload fails to decode or to
    match its checksums (see :meth:`load_lora_adapter_from_tensors`)."""

    def __init__(
        self,
        engine: LocalEngine,
        *,
        sglang_info: dict[str, Any] | None = None,
        on_bad_payload: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.sglang_info = dict(sglang_info or {})
        self.on_bad_payload = on_bad_payload

    # --- SGLang: adapters -------------------------------------------------------------------

    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            name, path = body["lora_name"], body["lora_path"]
        except (_BadRequest, KeyError) as exc:
            return _lora_update(self.engine, False, f"invalid request: {exc}")
        if not isinstance(name, str) or not isinstance(path, str):
            return _lora_update(self.engine, False, "lora_name and lora_path must be strings")
        try:
            await self.engine.load_ordinary(name, path)
        except CleanRefusal as exc:
            return _lora_update(self.engine, False, _lora_error_text(name, exc))
        return _lora_update(self.engine, True, None)

    async def load_lora_adapter_from_tensors(self, request: Request) -> Response:
        """SGLang >= 0.5.17's tensor route, same schema and failure modes
        (:mod:`engines.tensor_wire`). A bad request body, a ``load_format`` this face does not
        read, a bad config or an over-rank adapter are 400 (SGLang catches those). A payload
        that does not decode by value, a payload list that is not one per TP rank, or a
        checksum mismatch is what SGLang's TP worker hits *without* a ``try``: its scheduler
        dies and takes the server with it. Here it is a 500, after ``on_bad_payload`` (the
        process form exits there, so the caller sees the connection drop and a restarted
        server: a new incarnation holding nothing)."""
        body = await request.body()
        try:
            # In a worker thread, like decode_request below: a 512 MiB adapter is a ~1.4 GB
            # JSON body, seconds of parsing that would otherwise stall every other request.
            req = await anyio.to_thread.run_sync(guard.strict_decode, body, TensorLoadRequest)
        except guard.BadBody as exc:
            return _lora_update(self.engine, False, f"invalid request: {exc}")
        if self.sglang_info.get("dp_size", 1) != 1:  # SGLang asserts it: an unhandled 500
            return PlainTextResponse(
                "AssertionError: data-parallel replicas are not supported for dynamic lora loading",
                status_code=500,
            )
        if req.load_format is not None:
            return _lora_update(
                self.engine, False, f"BAD_REQUEST: load_format {req.load_format!r} is not read here"
            )
        tp_size = int(self.sglang_info.get("tp_size", 1))
        try:
            tensors = await anyio.to_thread.run_sync(decode_request, req, tp_size)
        except PayloadError as exc:
            if self.on_bad_payload is not None:
                self.on_bad_payload()
            return PlainTextResponse(f"Scheduler hit an exception: {exc}", status_code=500)
        try:
            await self.engine.load_tensors_ordinary(req.lora_name, req.config_dict, tensors)
        except CleanRefusal as exc:
            return _lora_update(self.engine, False, _lora_error_text(req.lora_name, exc))
        return _lora_update(self.engine, True, None)

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            name = (await _json_body(request))["lora_name"]
        except (_BadRequest, KeyError) as exc:
            return _lora_update(self.engine, False, f"invalid request: {exc}")
        try:
            await self.engine.unload_ordinary(str(name))
        except CleanRefusal as exc:
            return _lora_update(self.engine, False, _lora_error_text(str(name), exc))
        return _lora_update(self.engine, True, None)

    async def models(self, request: Request) -> Response:
        created = int(self.engine.startup_time)
        base = self.engine.served_model_name
        cards = [
            {
                "id": base,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": str(self.engine.model_dir),
                "parent": None,
                "max_model_len": self.engine.max_length,
            }
        ]
        for name, path in self.engine.loaded_adapters().items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": path,
                    "parent": base,
                    "max_model_len": self.engine.max_length,
                }
            )
        return _reply({"object": "list", "data": cards})

    # --- SGLang: server state ---------------------------------------------------------------

    async def server_info(self, request: Request) -> Response:
        e = self.engine
        return _reply(
            {
                "model_path": str(e.model_dir),
                "served_model_name": e.served_model_name,
                "enable_lora": True,
                "max_lora_rank": e.limits.max_lora_rank,
                "lora_target_modules": list(e.limits.target_modules),
                "max_loras_per_batch": 8,
                "max_loaded_loras": None,
                "lora_paths": None,
                "dp_size": 1,
                "tp_size": 1,
                "startup_time": e.startup_time,
                "version": _SGLANG_VERSION,
                "frontend": "python",
                "internal_states": [{"paused": e.paused, "in_flight": e.in_flight}],
                "incarnation": e.incarnation_id,
                "engine_id": e.engine_id,
                "loraledger_staged": True,
                **self.sglang_info,
            }
        )

    async def model_info(self, request: Request) -> Response:
        return _reply(
            {
                "model_path": str(self.engine.model_dir),
                "served_model_name": self.engine.served_model_name,
                "weight_version": "default",
                "is_generation": True,
            }
        )

    async def health(self, request: Request) -> Response:
        try:
            await self.engine.incarnation()
        except EngineError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def flush_cache(self, request: Request) -> Response:
        if self.engine.in_flight:
            return PlainTextResponse(
                "Cache not flushed because there are pending requests.", status_code=400
            )
        await self.engine.flush_cache()
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.")

    async def pause_generation(self, request: Request) -> Response:
        try:
            body = await _json_body(request) if await request.body() else {}
        except _BadRequest as exc:
            return _reply({"error": {"message": str(exc), "code": ErrorCode.BAD_REQUEST}}, 400)
        mode = body.get("mode", "abort")
        if mode == "abort":
            self.engine.abort_all()
        elif mode not in ("in_place", "retract"):
            return _reply({"error": {"message": f"unknown pause mode {mode!r}"}}, 400)
        self.engine.pause_generation()
        return _reply({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.engine.continue_generation()
        return _reply({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: Request) -> Response:
        """SGLang's route, stricter: a ``rid`` abort answers once the request has ended here
        (SGLang answers as soon as the abort is queued), so its 200 confirms the end
        (:meth:`~engines.local.engine.LocalEngine.abort_request`)."""
        try:
            body = await _json_body(request)
        except _BadRequest as exc:
            return _reply({"error": {"message": str(exc), "code": ErrorCode.BAD_REQUEST}}, 400)
        if body.get("abort_all"):
            self.engine.abort_all()
        elif body.get("rid") is not None:
            await self.engine.abort_request(str(body["rid"]), None)
        return Response(status_code=200)

    # --- SGLang: generation -----------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        try:
            items, params, return_logprob, namespace = _parse_generate(await _json_body(request))
        except _BadRequest as exc:
            return _reply({"error": {"message": str(exc), "code": ErrorCode.BAD_REQUEST}}, 400)
        # The batch as a whole (each item is checked exactly once tokenized): a text prompt
        # counts its minimum, one token, so a batch of a million tiny prompts is refused here.
        cap = self.engine.limits.max_request_tokens
        cost = params.n * sum(
            (len(p) if isinstance(p, list) else 1) + max(params.max_tokens, 0) for p, _, _ in items
        )
        if cost > cap:
            message = f"the batch asks for at least {cost} tokens; the per-request limit is {cap}"
            return _reply({"error": {"message": message, "code": ErrorCode.BAD_REQUEST}}, 400)
        outputs: list[Generation | None] = [None] * len(items)
        failures: list[EngineError] = []

        async def one(i: int, prompt: Any, lora: str | None, rid: str | None) -> None:
            try:
                outputs[i] = await self.engine.generate(
                    prompt,
                    lora,
                    params,
                    request_id=rid,
                    cache_salt=namespace[0],
                    extra_key=namespace[1],
                )
            except CleanRefusal as exc:
                failures.append(exc)

        # A client that disconnects cancels its requests (and so releases their adapters).
        finished = await _until_disconnect(
            request, [functools.partial(one, i, *it) for i, it in enumerate(items)]
        )
        if not finished:
            return Response(status_code=499)
        if failures:
            first = failures[0]
            return _reply({"error": {"message": first.message, "code": first.code}}, 400)
        rendered: list[dict[str, Any]] = []
        for gen in outputs:
            assert gen is not None
            rendered.extend(_render(gen, params, return_logprob, self.engine.eos_token_id))
        if len(items) == 1 and params.n == 1:
            return _reply(rendered[0])
        return _reply(rendered)

    # --- loraledger staged endpoints --------------------------------------------------------

    async def staged_prepare(self, request: Request) -> Response:
        return await _staged(lambda: self._decode_then(request, Candidate, self.engine.prepare))

    async def staged_load(self, request: Request) -> Response:
        return await _staged(lambda: self._decode_then(request, Candidate, self.engine.load))

    async def staged_bucket(self, request: Request) -> Response:
        async def run() -> Any:
            try:
                upload = wire.bucket_decoder.decode(await request.body())
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                raise CleanRefusal(ErrorCode.BAD_REQUEST, f"bad bucket body: {exc}") from exc
            received = await self.engine.receive_bucket(
                upload.lora_name, upload.attempt, upload.digest, upload.bucket
            )
            return wire.BucketAck(index=upload.bucket.index, received_tensors=received)

        return await _staged(run)

    async def staged_unload(self, request: Request) -> Response:
        async def run() -> Any:
            req = await self._decode(request, wire.UnloadRequest)
            # Over HTTP the caller is any process that reaches the port: a managed name is
            # unloaded only under its attempt's fence (ATTEMPT_REQUIRED otherwise).
            return await self.engine.unload(req.lora_name, attempt=req.attempt, fenced_only=True)

        return await _staged(run)

    async def staged_inventory(self, request: Request) -> Response:
        return await _staged(self.engine.inventory)

    async def _decode(self, request: Request, type_: type[Any]) -> Any:
        try:
            return guard.strict_decode(await request.body(), type_)
        except guard.BadBody as exc:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, str(exc)) from exc

    async def _decode_then(
        self,
        request: Request,
        type_: type[Any],
        action: Callable[[Any], Coroutine[Any, Any, Any]],
    ) -> Any:
        return await action(await self._decode(request, type_))


async def _staged(action: Callable[[], Coroutine[Any, Any, Any]]) -> Response:
    try:
        return _reply(await action())
    except CleanRefusal as exc:
        return _reply(wire.ErrorBody(wire.ErrorDetail(exc.code, exc.message)), 400)
    except EngineError as exc:
        return _reply(wire.ErrorBody(wire.ErrorDetail(exc.code, exc.message)), 503)


async def _until_disconnect(
    request: Request, jobs: list[Callable[[], Coroutine[Any, Any, None]]]
) -> bool:
    """Run ``jobs`` concurrently; cancel them if the client disconnects first. Returns whether
    they all finished. (Starlette does not cancel a handler whose client went away, and a
    request whose client is gone must not keep holding its adapter.)"""
    finished = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        async def work() -> None:
            nonlocal finished
            async with anyio.create_task_group() as inner:
                for job in jobs:
                    inner.start_soon(job)
            finished = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(work)
    return finished


def _parse_generate(
    body: dict[str, Any],
) -> tuple[list[tuple[Any, str | None, str | None]], SamplingParams, bool, tuple[str, str]]:
    """``(items [(prompt, lora, rid)], params, return_logprob, (cache_salt, extra_key))``."""
    if body.get("stream"):
        raise _BadRequest("stream=true is not supported by the local engine")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise _BadRequest("exactly one of text and input_ids is required")
    if text is not None:
        prompts = text if isinstance(text, list) else [text]
        if not all(isinstance(p, str) for p in prompts):
            raise _BadRequest("text must be a string or a list of strings")
    else:
        if not isinstance(ids, list) or not ids:
            raise _BadRequest("input_ids must be a non-empty list")
        prompts = ids if isinstance(ids[0], list) else [ids]
    batch = isinstance(text, list) or (ids is not None and isinstance(ids[0], list))
    lora = body.get("lora_path")
    if isinstance(lora, list):
        if len(lora) != len(prompts):
            raise _BadRequest(f"lora_path has {len(lora)} entries for {len(prompts)} prompts")
        loras = lora
    else:
        loras = [lora] * len(prompts)
    if not all(x is None or isinstance(x, str) for x in loras):
        raise _BadRequest("lora_path entries must be adapter names or null")
    rid = body.get("rid")
    rids: list[str | None]
    if isinstance(rid, list):
        if len(rid) != len(prompts):
            raise _BadRequest("rid list length differs from the batch")
        rids = [str(r) for r in rid]
    elif rid is not None:
        rids = [str(rid)] if not batch else [f"{rid}-{i}" for i in range(len(prompts))]
    else:
        rids = [None] * len(prompts)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _BadRequest("sampling_params must be an object")
    for key, neutral in _UNSUPPORTED_SAMPLING.items():
        if key in sp and sp[key] not in neutral:
            raise _BadRequest(f"sampling parameter {key}={sp[key]!r} is not supported")
    stop = sp.get("stop") or ()
    try:
        params = SamplingParams(
            max_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            seed=None if sp.get("sampling_seed") is None else int(sp["sampling_seed"]),
            stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            logprobs=True,
            n=int(sp.get("n", 1)),
        )
    except (TypeError, ValueError) as exc:
        raise _BadRequest(f"bad sampling_params: {exc}") from exc
    salt, extra = body.get("cache_salt"), body.get("extra_key")
    namespace = (str(salt) if salt is not None else "", str(extra) if extra is not None else "")
    items = list(zip(prompts, loras, rids, strict=True))
    return items, params, bool(body.get("return_logprob", False)), namespace


def _render(
    gen: Generation, params: SamplingParams, return_logprob: bool, eos: int | None
) -> list[dict[str, Any]]:
    samples = gen.choices or (
        Choice(
            index=0,
            token_ids=gen.token_ids,
            text=gen.text,
            logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
        ),
    )
    out = []
    for i, s in enumerate(samples):
        if s.finish_reason == "length":
            finish: dict[str, Any] = {"type": "length", "length": len(s.token_ids)}
        elif s.finish_reason == "stop":
            last = s.token_ids[-1] if s.token_ids else None
            # SGLang reports the matched EOS id, or the matched stop string (not kept here)
            finish = {"type": "stop", "matched": last if last == eos else None}
        else:
            finish = {"type": "abort", "message": "Abort in waiting queue"}
        meta: dict[str, Any] = {
            "id": gen.request_id if len(samples) == 1 else f"{gen.request_id}-{i}",
            "finish_reason": finish,
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": len(s.token_ids),
            "cached_tokens": gen.cached_tokens,
            "weight_version": "default",
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(s.logprobs or (), s.token_ids, strict=False)
            ]
        out.append({"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta})
    return out


# Paths that change what the engine holds or does: with a token configured, only a caller that
# presents it may reach them. /generate and the read-only routes stay open (a rollout worker
# generates; a monitor reads), as on SGLang without --admin-api-key.
CONTROL_PATHS = frozenset(
    {
        "/load_lora_adapter",
        "/unload_lora_adapter",
        TENSOR_ROUTE,
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        f"{wire.PREFIX}/prepare",
        f"{wire.PREFIX}/bucket",
        f"{wire.PREFIX}/load",
        f"{wire.PREFIX}/unload",
        f"{wire.PREFIX}/inventory",
    }
)
# Paths a draining engine refuses (503 ENGINE_DRAINING, engines.drain): new work, and the
# health checks (SGLang's /health answers 503 while it shuts down). Reads, unloads, aborts and
# pause/continue stay open: the control plane still observes, cleans up and ends requests.
DRAIN_REFUSES = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/load_lora_adapter",
        TENSOR_ROUTE,
        "/health",
        "/health_generate",
        f"{wire.PREFIX}/prepare",
        f"{wire.PREFIX}/bucket",
        f"{wire.PREFIX}/load",
    }
)
MAX_BODY_BYTES = 4 * 1024 * 1024  # every JSON route: a batch of prompts, a candidate manifest
# A bucket is packed up to 64 MiB, but a tensor larger than that travels alone in its own.
MAX_BUCKET_BYTES = 256 * 1024 * 1024
# The tensor route carries a whole adapter as base64, once per TP rank: 256 MiB holds a
# 190 MiB adapter at TP 1; larger ones need ``max_tensor_body_bytes`` raised.
MAX_TENSOR_BODY_BYTES = 256 * 1024 * 1024
ENGINE_TOKEN_ENV = "LORALEDGER_ENGINE_TOKEN"


def _error_body(code: str, message: str) -> Any:
    return wire.ErrorBody(wire.ErrorDetail(code, message))


def create_app(
    engine: LocalEngine,
    *,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_bucket_bytes: int = MAX_BUCKET_BYTES,
    max_tensor_body_bytes: int = MAX_TENSOR_BODY_BYTES,
    sglang_info: dict[str, Any] | None = None,
    on_bad_payload: Callable[[], None] | None = None,
    drain: Drain | None = None,
) -> Starlette:
    """The ASGI app for one running engine (the caller owns the engine's lifetime). ``token``:
    the bearer token every control route (:data:`CONTROL_PATHS`) then requires; every route's
    body is capped (``max_bucket_bytes`` for buckets, ``max_tensor_body_bytes`` for the tensor
    route, ``max_body_bytes`` for the rest). ``sglang_info`` and ``on_bad_payload``: see
    :class:`_App`. ``drain``: the gate a stopping process closes (:mod:`engines.drain`): it
    counts every request, and once draining refuses :data:`DRAIN_REFUSES`."""
    app = _App(engine, sglang_info=sglang_info, on_bad_payload=on_bad_payload)
    openai = OpenAIFace(engine)
    bucket_path = f"{wire.PREFIX}/bucket"
    caps = {bucket_path: max_bucket_bytes, TENSOR_ROUTE: max_tensor_body_bytes}
    routes = [
        Route("/generate", app.generate, methods=["POST"]),
        Route("/load_lora_adapter", app.load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", app.unload_lora_adapter, methods=["POST"]),
        Route(TENSOR_ROUTE, app.load_lora_adapter_from_tensors, methods=["POST"]),
        Route("/v1/models", app.models, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/server_info", app.server_info, methods=["GET"]),
        Route("/get_server_info", app.server_info, methods=["GET"]),
        Route("/model_info", app.model_info, methods=["GET"]),
        Route("/health", app.health, methods=["GET"]),
        Route("/health_generate", app.health, methods=["GET"]),
        Route("/flush_cache", app.flush_cache, methods=["GET", "POST"]),
        Route("/pause_generation", app.pause_generation, methods=["POST"]),
        Route("/continue_generation", app.continue_generation, methods=["POST"]),
        Route("/abort_request", app.abort_request, methods=["POST"]),
        Route(f"{wire.PREFIX}/prepare", app.staged_prepare, methods=["POST"]),
        Route(f"{wire.PREFIX}/bucket", app.staged_bucket, methods=["POST"]),
        Route(f"{wire.PREFIX}/load", app.staged_load, methods=["POST"]),
        Route(f"{wire.PREFIX}/unload", app.staged_unload, methods=["POST"]),
        Route(f"{wire.PREFIX}/inventory", app.staged_inventory, methods=["GET"]),
    ]
    draining = (
        []
        if drain is None
        else [Middleware(DrainGuard, drain=drain, refuses=DRAIN_REFUSES.__contains__)]
    )
    return Starlette(
        routes=routes,
        middleware=[
            *draining,
            Middleware(
                guard.Guard,
                token=token,
                protected=CONTROL_PATHS.__contains__,
                cap=lambda path: caps.get(path, max_body_bytes),
                error_body=_error_body,
            ),
        ],
        exception_handlers=guard.exception_handlers(_error_body),
    )


# --- running it -----------------------------------------------------------------------------


class UnsafeListen(ValueError):
    """Listening beyond loopback without a token: anyone who reaches the port could unload."""


def check_listen(host: str, token: str | None) -> None:
    if not guard.is_loopback(host) and not token:
        raise UnsafeListen(
            f"refusing to listen on {host!r} without a token: anyone who can reach it could "
            f"load and unload adapters. Give a token ({ENGINE_TOKEN_ENV} or --token-file), or "
            "listen on 127.0.0.1."
        )


@contextlib.asynccontextmanager
async def serve(
    engine: LocalEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    **app_options: Any,
) -> AsyncIterator[str]:
    """Serve a running engine on ``host`` (loopback by default) and yield its base URL; stops
    the server (not the engine) on exit. ``token`` guards the control routes; beyond loopback
    it is required (:class:`UnsafeListen`). ``app_options`` go to :func:`create_app`."""
    check_listen(host, token)
    async with embedded.serving(
        create_app(engine, token=token, **app_options), host=host, port=port
    ) as url:
        yield url


@contextlib.asynccontextmanager
async def running_server(
    engine_id: str = "local",
    *,
    host: str = "127.0.0.1",
    token: str | None = None,
    sglang_info: dict[str, Any] | None = None,
    on_bad_payload: Callable[[], None] | None = None,
    **engine_kwargs: Any,
) -> AsyncIterator[tuple[LocalEngine, str]]:
    """A fresh engine served on a free loopback port: ``(engine, base_url)``."""
    async with (
        LocalEngine(engine_id, **engine_kwargs) as engine,
        serve(
            engine, host=host, token=token, sglang_info=sglang_info, on_bad_payload=on_bad_payload
        ) as url,
    ):
        yield engine, url


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m engines.local.server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (printed on stdout)")
    p.add_argument("--port-file", type=Path, help="also write the bound port here (atomically)")
    p.add_argument("--engine-id", default="local")
    p.add_argument(
        "--token-file",
        type=Path,
        help=f"bearer token for the control routes (first line); default: ${ENGINE_TOKEN_ENV}. "
        "Required to listen beyond loopback",
    )
    p.add_argument("--artifact-root", type=Path, help="refuse adapter paths outside this dir")
    p.add_argument("--model-dir", type=Path, help="base model (default: the tiny model)")
    p.add_argument("--max-lora-rank", type=int, default=ServingLimits().max_lora_rank)
    p.add_argument(
        "--lora-target-modules",
        default=",".join(ServingLimits().target_modules),
        help="comma-separated module names adapters may target",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--transport", choices=["staged", "artifact"], default="staged")
    p.add_argument(
        "--exit-on-bad-tensor-payload",
        action="store_true",
        help="die (exit 70, no reply) when a /load_lora_adapter_from_tensors payload fails to "
        "decode or to match its checksums, as a stock SGLang server probably does",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long requests already running may take to finish (seconds); "
        "new ones are refused 503 ENGINE_DRAINING meanwhile",
    )
    p.add_argument(
        "--no-implicit-reload",
        action="store_true",
        help="do not reproduce SGLang's implicit reload of unloaded ordinary names",
    )
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    limits = ServingLimits(
        max_lora_rank=args.max_lora_rank,
        target_modules=tuple(m for m in args.lora_target_modules.split(",") if m),
    )
    token = guard.read_token(ENGINE_TOKEN_ENV, args.token_file)
    check_listen(args.host, token)
    sock = embedded.bind_listener(args.host, args.port)
    async with LocalEngine(
        args.engine_id,
        model_dir=args.model_dir,
        limits=limits,
        artifact_root=args.artifact_root,
        transport=args.transport,
        threads=args.threads,
        implicit_reload=not args.no_implicit_reload,
    ) as engine:
        on_bad_payload = _die if args.exit_on_bad_tensor_payload else None
        drain = Drain(args.engine_id)
        app = create_app(engine, token=token, on_bad_payload=on_bad_payload, drain=drain)
        server = embedded.EmbeddedServer(embedded.embedded_config(app))
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                await server.serve([sock])
                tg.cancel_scope.cancel()  # stopped (signal or failure): stop listening too

            tg.start_soon(run)
            tg.start_soon(_stop_on_signal, server, drain, args.drain_timeout)
            # uvicorn exposes "started" only as a flag
            while not server.started and not server.should_exit:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            port = sock.getsockname()[1]
            if args.port_file:
                tmp = args.port_file.with_name(f".{args.port_file.name}.{os.getpid()}")
                tmp.write_text(f"{port}\n")
                tmp.replace(args.port_file)
            print(port, flush=True)
    sock.close()


EXIT_BAD_PAYLOAD = 70


def _die() -> None:
    """SGLang's scheduler, on an exception in its TP worker, signals its parent and the whole
    server goes: no reply, no cleanup. Whoever supervises the process restarts it."""
    print("engines.local.server: bad tensor payload, exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_BAD_PAYLOAD)


async def _stop_on_signal(server: uvicorn.Server, drain: Drain, drain_timeout: float) -> None:
    """SIGTERM/SIGINT: drain (new work refused retryably, requests already running finish,
    at most ``drain_timeout`` seconds: :mod:`engines.drain`), then stop; exit status 0."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            drain.begin()
            left = await drain.wait(drain_timeout)
            if left:
                print(
                    f"engines.local.server: drain timed out after {drain_timeout:g}s with "
                    f"{left} request(s) still running: they are cut",
                    file=sys.stderr,
                    flush=True,
                )
            server.should_exit = True
            return


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    try:
        check_listen(args.host, guard.read_token(ENGINE_TOKEN_ENV, args.token_file))
    except (UnsafeListen, OSError, ValueError) as exc:
        print(f"engines.local.server: {exc}", file=sys.stderr)
        raise SystemExit(11) from None
    started = time.monotonic()
    anyio.run(_main, args)
    print(f"stopped after {time.monotonic() - started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
