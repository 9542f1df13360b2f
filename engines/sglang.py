"""The SGLang engine adapter: stock SGLang 0.5.x over HTTP, behind the engine contract.

Endpoints and shapes are SGLang 0.5.23's (docs/engines.md):

* ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned": false}`` and
  ``POST /unload_lora_adapter {"lora_name"}`` answer ``LoRAUpdateOutput``
  (``{"rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"}``), 200 on
  success, 400 otherwise;
* ``GET /v1/models``: the base card (``parent`` null) and one card per adapter (``id`` = name,
  ``root`` = the path it was loaded from) -- the only view of live adapters;
* ``GET /server_info``: startup configuration and ``startup_time`` (the incarnation signal);
* ``POST /generate`` with ``lora_path`` = the adapter *name*.

Rules this adapter follows, each from a recorded fact:

* **Loads by artifact path** (``transport = "artifact"``): ``prepare`` re-reads and re-hashes the
  immutable artifact directory (the engine will read the same bytes) and checks rank and target
  modules against the server's startup limits; ``transfer`` moves nothing; ``load`` calls
  ``/load_lora_adapter`` and proves the result with ``/v1/models`` (``root`` must be our path).
  A 400 "already loaded" is success only if ``/v1/models`` shows our path under the name (a
  retry after a lost reply); any other holder is a clean ``ALREADY_LOADED``.
* **Unload blocks until the adapter's in-flight requests drained**, holding SGLang's
  update lock: call it only at zero in-flight (the gateway's count), and give it a long timeout
  (:attr:`SGLangTimeouts.unload`). A 400 "does not exist" on a repeat is ``was_loaded=False``.
* **An unloaded name is silently reloaded** by a later request naming it (from its path): the
  gateway must never send one. This adapter cannot prevent it; it only reports what happened.
* **Generation is sent at most once**: any transport failure after sending is ambiguous and is
  never retried. Client-supplied ``extra_key``/``cache_salt``/``lora_path`` in ``extra_body`` are
  stripped (a crafted ``extra_key`` equal to an adapter's ``lora_id`` reads that adapter's
  prefix cache, SGLang #24638); with ``cache_salt`` given, this adapter sets both ``cache_salt``
  and ``extra_key`` itself.
* **Clean vs ambiguous**: transport failures and 5xx are classified by :mod:`engines.http`;
  recognised 400 texts become :class:`CleanRefusal`; every other 4xx is ambiguous (an answer we
  do not understand proves nothing).
* **Attempts**: SGLang has none, so the fence lives in this object
  (:class:`engines.path_engine.AttemptFence`: highest attempt prepared per name, attempts
  cleaned up): a stale ``prepare``/``load``/``unload`` is ``STALE_ATTEMPT``.

The local engine's HTTP face (:mod:`engines.local.server`) speaks the same protocol and is the
stand-in used by the tests; it prefixes loraledger-only refusals with their code
(``"NAME_PROTECTED: ..."``), which this adapter recognises as well.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from engines.contract import (
    AmbiguousReply,
    Candidate,
    Choice,
    EngineCapabilities,
    ErrorCode,
    Generation,
    Receipt,
    SamplingParams,
    UnloadReceipt,
)
from engines.path_engine import PathLoadingEngine

# Codes a loraledger-aware server puts in front of its own refusals ("NAME_PROTECTED: ...").
_CODE_PREFIX = re.compile(r"^([A-Z_]+): ")
_PREFIXABLE = frozenset(
    {
        ErrorCode.INVALID_NAME,
        ErrorCode.INVALID_ADAPTER,
        ErrorCode.DIGEST_MISMATCH,
        ErrorCode.RANK_UNSUPPORTED,
        ErrorCode.NAME_PROTECTED,
        ErrorCode.NAME_RECLAIMED,
        ErrorCode.PATH_OUTSIDE_STORE,
        ErrorCode.BAD_REQUEST,
    }
)
# /load_lora_adapter 400 texts (SGLang 0.5.23) whose meaning is certain: nothing was loaded.
_LOAD_REFUSALS = (
    ("is incompatible with the current LoRA memory pool", ErrorCode.RANK_UNSUPPORTED),
    ("doesn't support DoRA", ErrorCode.INVALID_ADAPTER),
    ("adapters that add tokens to the vocabulary", ErrorCode.INVALID_ADAPTER),
    ("LoRA is not enabled", ErrorCode.BAD_REQUEST),
    ("It is not allowed to pin all slots", ErrorCode.BAD_REQUEST),
)
_ALREADY_LOADED = ("because it is already loaded", "already exists. Loaded LoRAs")
# /generate 400 texts for an adapter the server does not hold (or failed to reload).
_NOT_LOADED = (
    "has never been loaded",
    "adapters are not loaded",
    "Failed to implicitly load LoRA adapter",
)


def generation_refusal(status: int, code: Any, message: str) -> str | None:
    """The clean code of a reply refusing a generation (``/generate``, or the OpenAI routes of
    SGLang and of the local engine, which answer in SGLang's terms), or ``None`` when it proves
    nothing (the caller treats it as ambiguous). Only a 400 refuses before running anything: a
    code we know (a loraledger-aware server's), or SGLang's texts for an adapter it does not
    hold, which are ``NOT_LOADED``. Shared with the OpenAI gateway, which reads the refusals
    of the engines' own routes by the same rule."""
    if status != 400:
        return None
    if isinstance(code, str) and (code in _PREFIXABLE or code == ErrorCode.NOT_LOADED):
        return code
    if any(text in message for text in _NOT_LOADED):
        return ErrorCode.NOT_LOADED
    return None


# Body keys this adapter owns; a caller's ``extra_body`` can never set them.
_OWNED_KEYS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "lora_path",
        "lora_id",
        "rid",
        "return_logprob",
        "stream",
        "extra_key",
        "cache_salt",
        "session_id",
    }
)


@dataclass(frozen=True)
class SGLangTimeouts:
    """Seconds per call kind; nothing waits unbounded.

    ``control``: load (the engine reads the adapter), ``/v1/models``, staged steps;
    ``unload``: long, because SGLang's unload waits for the adapter's requests;
    ``probe``: ``/server_info``; ``generate``: one whole generation; ``incarnation_ttl``: how old
    the incarnation stamped on a :class:`Generation` may be before it is probed again."""

    control: float = 60.0
    unload: float = 900.0
    probe: float = 10.0
    generate: float = 600.0
    incarnation_ttl: float = 5.0


def build_generate_body(
    prompt: str | Sequence[int],
    lora_name: str | None,
    params: SamplingParams,
    *,
    request_id: str | None = None,
    cache_salt: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body. ``extra_body`` may add fields but never the ones this adapter owns
    (prompt, adapter, request id, cache namespace, streaming): those are dropped, then set here."""
    body: dict[str, Any] = {k: v for k, v in (extra_body or {}).items() if k not in _OWNED_KEYS}
    if isinstance(prompt, str):
        body["text"] = prompt
    else:
        body["input_ids"] = [int(t) for t in prompt]
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "ignore_eos": params.ignore_eos,
        "n": params.n,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    body["sampling_params"] = sampling
    body["lora_path"] = lora_name
    body["return_logprob"] = params.logprobs
    body["stream"] = False
    if request_id is not None:
        body["rid"] = request_id
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
        body["extra_key"] = cache_salt
    return body


class SGLangEngine(PathLoadingEngine):
    """One SGLang 0.5.x server as a fleet member.

    ``base_url`` e.g. ``http://127.0.0.1:30000``; ``client`` may be injected (tests, shared
    pools), otherwise one is owned and closed by :meth:`aclose` (it ignores proxy environment
    variables: a proxy would blur "never sent" and "sent once"). ``api_key`` is sent as a bearer
    token (SGLang's ``--api-key``/``--admin-api-key``). ``max_lora_rank`` overrides what
    ``/server_info`` reports.
    """

    kind = "sglang"
    engine_name = "SGLang"

    def __init__(
        self,
        base_url: str,
        engine_id: str,
        *,
        timeouts: SGLangTimeouts | None = None,
        max_lora_rank: int | None = None,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        super().__init__(
            base_url, engine_id, max_lora_rank=max_lora_rank, client=client, headers=headers
        )
        # ``generate`` forwards caller body fields (minus the keys this adapter owns);
        # ``abort_request`` ends a request by its ``rid`` (see there).
        self.capabilities = EngineCapabilities(
            extra_body=True, endpoint=self.base_url, confirms_end=True
        )
        self.timeouts = timeouts or SGLangTimeouts()

    def _prefixed(self, message: str) -> str | None:
        """The loraledger code in front of a message, if it is one we accept as clean."""
        m = _CODE_PREFIX.match(message)
        return m.group(1) if m and m.group(1) in _PREFIXABLE else None

    # --- identity -----------------------------------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        response = await self._send("GET", "/server_info", timeout=self.timeouts.probe)
        if response.status_code != 200:
            raise self._unrecognised("GET /server_info", response)
        body = self._json(response)
        if not isinstance(body, dict):
            raise self._ambiguous(ErrorCode.MALFORMED_REPLY, "GET /server_info: not an object")
        return body

    async def incarnation(self) -> str:
        """``startup_time`` from ``/server_info`` (fixed for a process life), joined with any
        explicit id the server offers (the local engine's ``incarnation``)."""
        info = await self.server_info()
        return self._incarnation_of(info)

    def _incarnation_of(self, info: Mapping[str, Any]) -> str:
        started = info.get("startup_time")
        if isinstance(started, bool) or not isinstance(started, int | float):
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY, f"/server_info has no startup_time ({started!r})"
            )
        value = f"st-{float(started)!r}"
        if isinstance(info.get("incarnation"), str):
            value += f"/{info['incarnation']}"
        self._last_incarnation, self._last_probe = value, time.monotonic()
        return value

    # --- publication (artifact transport) ------------------------------------------------------

    def _validate_artifact(self, c: Candidate, info: Mapping[str, Any]) -> str:
        """Everything checkable before the engine acts; returns the normalised path."""
        path, config = self._read_artifact(c)
        limit = self.max_lora_rank if self.max_lora_rank is not None else info.get("max_lora_rank")
        if isinstance(limit, int) and int(config["r"]) > limit:
            raise self._clean(
                ErrorCode.RANK_UNSUPPORTED,
                f"adapter rank {config['r']} exceeds the server's --max-lora-rank {limit}",
            )
        served = info.get("lora_target_modules")
        targets = config["target_modules"]
        if isinstance(served, list) and served and "all" not in served and targets != "all-linear":
            outside = sorted(set(targets if isinstance(targets, list) else [targets]) - set(served))
            if outside:
                raise self._clean(
                    ErrorCode.INVALID_ADAPTER,
                    f"target modules {outside} not in the server's --lora-target-modules {served}",
                )
        return path

    async def prepare(self, candidate: Candidate) -> Receipt:
        """Validate the artifact against the server's limits, fence the attempt, probe the
        incarnation. Touches nothing on the server."""
        self._check_candidate(candidate)
        self._attempts.check(candidate.lora_name, candidate.attempt)
        info = await self.server_info()
        incarnation = self._incarnation_of(info)
        path = await anyio.to_thread.run_sync(self._validate_artifact, candidate, info)
        self._attempts.stage(candidate, path)
        return self._receipt(candidate, incarnation, "prepared")

    async def load(self, candidate: Candidate) -> Receipt:
        prepared = self._attempts.prepared(candidate)
        name = candidate.lora_name
        response = await self._send(
            "POST",
            "/load_lora_adapter",
            timeout=self.timeouts.control,
            json={"lora_name": name, "lora_path": prepared.path, "pinned": False},
        )
        status, body = response.status_code, self._lora_update(response, f"load {name}")
        if status == 200 and body.get("success") is True:
            return await self._confirm_loaded(candidate, prepared.path, after="success")
        message = str(body.get("error_message") or "")
        if status == 400:
            if any(text in message for text in _ALREADY_LOADED):
                return await self._already_loaded(candidate, prepared.path, status=400)
            code = self._prefixed(message) or next(
                (code for text, code in _LOAD_REFUSALS if text in message), None
            )
            if code is not None:
                raise self._clean(code, message, status=400)
        raise self._unrecognised(f"load {name}", response)

    def _lora_update(self, response: httpx.Response, what: str) -> dict[str, Any]:
        """A ``LoRAUpdateOutput`` body; anything else is ambiguous."""
        body = self._json(response)
        if not isinstance(body, dict) or "success" not in body:
            raise self._unrecognised(what, response)
        return body

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        """Unload and prove absence with a fresh inventory. Blocks while the adapter's in-flight
        requests drain. A repeat ("does not exist") is ``was_loaded=False``. The attempt
        is recorded as cleaned up only once its absence is proven."""
        self._check_name(lora_name)
        if attempt is not None:
            self._attempts.check_cleanup(lora_name, attempt)
        response = await self._send(
            "POST",
            "/unload_lora_adapter",
            timeout=self.timeouts.unload,
            json={"lora_name": lora_name},
        )
        status, body = response.status_code, self._lora_update(response, f"unload {lora_name}")
        message = str(body.get("error_message") or "")
        if status == 200 and body.get("success") is True:
            was_loaded = True
        elif status == 400 and f"LoRA with name {lora_name} does not exist" in message:
            was_loaded = False
        elif status == 400 and (code := self._prefixed(message)) is not None:
            raise self._clean(code, message, status=400)
        else:
            raise self._unrecognised(f"unload {lora_name}", response)
        receipt = await self._unloaded_receipt(lora_name, status=status, was_loaded=was_loaded)
        if attempt is not None:
            self._attempts.close(lora_name, attempt, refuse_older_cleanups=True)
        return receipt

    # --- generation -----------------------------------------------------------------------------

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """``POST /abort_request {"rid"}``; its 200 is taken as the request's end.

        Why that is enough on SGLang, which answers once the abort is queued, not done: what a
        caller waits for the end of a request for is the adapter it holds, and SGLang's unload
        itself waits until every request holding the adapter released it (docs/engines.md), so
        no unload can run under the aborted request whatever the order. The bundled local
        engine answers this route only once the request ended. An unknown ``rid`` (ended
        already) is a 200 as well."""
        response = await self._send(
            "POST", "/abort_request", timeout=self.timeouts.probe, json={"rid": request_id}
        )
        if response.status_code != 200:
            raise self._unrecognised(f"abort {request_id}", response)
        return True

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Generation:
        """One ``/generate`` call, sent at most once. ``Generation.incarnation`` is the last
        probed one, probed again first when older than ``timeouts.incarnation_ttl``."""
        if lora_name is not None:
            self._check_name(lora_name)
        body = build_generate_body(
            prompt,
            lora_name,
            params,
            request_id=request_id,
            cache_salt=cache_salt,
            extra_body=extra_body,
        )
        if time.monotonic() - self._last_probe > self.timeouts.incarnation_ttl:
            try:
                await self.incarnation()
            except AmbiguousReply as exc:  # the generation itself was never sent
                exc.dispatched = False
                raise
        incarnation = self._last_incarnation or ""
        response = await self._send("POST", "/generate", timeout=self.timeouts.generate, json=body)
        if response.status_code == 200:
            return self._parse_generation(response, lora_name, params, incarnation)
        error = self._error_of(response)
        if error is not None:
            code = generation_refusal(response.status_code, *error)
            if code is not None:
                raise self._clean(code, error[1], status=400)
        raise self._unrecognised(f"generate on {lora_name}", response)

    def _error_of(self, response: httpx.Response) -> tuple[Any, str] | None:
        """``(code or None, message)`` of ``{"error": {"message", "code"?}}``."""
        try:
            err = response.json()["error"]
            message = str(err["message"])
        except (ValueError, KeyError, TypeError):
            return None
        return (err.get("code") if isinstance(err, dict) else None), message

    def _parse_generation(
        self,
        response: httpx.Response,
        lora_name: str | None,
        params: SamplingParams,
        incarnation: str,
    ) -> Generation:
        body = self._json(response)
        try:
            items = body if isinstance(body, list) else [body]
            if len(items) != params.n:
                raise ValueError(f"{len(items)} outputs for n={params.n}")
            choices = tuple(self._choice(i, item, params) for i, item in enumerate(items))
            meta = items[0]["meta_info"]
            return self._generation(
                choices,
                incarnation=incarnation,
                lora_name=lora_name,  # SGLang never confirms which adapter served it
                prompt_tokens=int(meta.get("prompt_tokens") or 0),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                request_id=str(meta["id"]) if meta.get("id") is not None else None,
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                f"generate reply unreadable: {exc!r}",
                status=response.status_code,
            ) from exc

    @staticmethod
    def _choice(index: int, item: Mapping[str, Any], params: SamplingParams) -> Choice:
        meta = item["meta_info"]
        token_ids = tuple(int(t) for t in item["output_ids"])
        logprobs: tuple[float, ...] | None = None
        if params.logprobs:
            pairs = meta["output_token_logprobs"]
            if [int(p[1]) for p in pairs] != list(token_ids):
                raise ValueError("output_token_logprobs do not match output_ids")
            logprobs = tuple(float(p[0]) for p in pairs)
        finish = meta.get("finish_reason")
        reason = finish.get("type") if isinstance(finish, dict) else finish
        return Choice(
            index=index,
            token_ids=token_ids,
            text=str(item["text"]),
            logprobs=logprobs,
            finish_reason=str(reason or "stop"),
        )
