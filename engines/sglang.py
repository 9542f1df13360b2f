"""The SGLang engine adapter: stock SGLang 0.5.x over HTTP, behind the engine contract.

Endpoints and shapes are those recorded in engines.md §1 (0.5.23):

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
* **Unload blocks until the adapter's in-flight requests drained** (§1.4), holding SGLang's
  update lock: call it only at zero in-flight (the gateway's count), and give it a long timeout
  (:attr:`SGLangTimeouts.unload`). A 400 "does not exist" on a repeat is ``was_loaded=False``.
* **An unloaded name is silently reloaded** by a later request naming it (§1.6 step 7): the
  gateway must never send one. This adapter cannot prevent it; it only reports what happened.
* **Generation is sent at most once**: any transport failure after sending is ambiguous and is
  never retried. Client-supplied ``extra_key``/``cache_salt``/``lora_path`` in ``extra_body`` are
  stripped (a crafted ``extra_key`` equal to an adapter's ``lora_id`` reads that adapter's
  prefix cache, SGLang #24638); with ``cache_salt`` given, this adapter sets both ``cache_salt``
  and ``extra_key`` itself.
* **Clean vs ambiguous**: transport failures and 5xx are classified by :mod:`engines.http`;
  recognised 400 texts become :class:`CleanRefusal`; every other 4xx is ambiguous (an answer we
  do not understand proves nothing).
* **Attempts**: SGLang has none, so the fence lives in this object (highest attempt prepared per
  name, attempts cleaned up): a stale ``prepare``/``load``/``unload`` is ``STALE_ATTEMPT``.

The local engine's HTTP face (:mod:`engines.local.server`) speaks the same protocol and is the
stand-in used by the tests; it prefixes loraledger-only refusals with their code
(``"NAME_PROTECTED: ..."``), which this adapter recognises as well.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from engines import http
from engines.artifacts import ArtifactError, read_adapter_dir
from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    Choice,
    CleanRefusal,
    ErrorCode,
    Generation,
    Inventory,
    InventoryEntry,
    Receipt,
    SamplingParams,
    UnloadReceipt,
    check_name,
)
from engines.manifest import build_manifest

_DIGEST_DIR = re.compile(r"^[0-9a-f]{64}$")
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
# /load_lora_adapter 400 texts (engines.md §1.1) whose meaning is certain: nothing was loaded.
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
    ``unload``: long, because SGLang's unload waits for the adapter's requests (§1.4);
    ``probe``: ``/server_info``; ``generate``: one whole generation; ``incarnation_ttl``: how old
    the incarnation stamped on a :class:`Generation` may be before it is probed again."""

    control: float = 60.0
    unload: float = 900.0
    probe: float = 10.0
    generate: float = 600.0
    incarnation_ttl: float = 5.0


@dataclass(frozen=True)
class _Prepared:
    attempt: int
    digest: str
    path: str


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


class SGLangEngine:
    """One SGLang 0.5.x server as a fleet member.

    ``base_url`` e.g. ``http://127.0.0.1:30000``; ``client`` may be injected (tests, shared
    pools), otherwise one is owned and closed by :meth:`aclose` (it ignores proxy environment
    variables: a proxy would blur "never sent" and "sent once"). ``api_key`` is sent as a bearer
    token (SGLang's ``--api-key``/``--admin-api-key``). ``max_lora_rank`` overrides what
    ``/server_info`` reports.
    """

    kind = "sglang"
    transport = "artifact"

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
        self.engine_id = engine_id
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or SGLangTimeouts()
        self.max_lora_rank = max_lora_rank
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._owns_client = client is None
        self._client = client or http.engine_client(self.base_url, headers=headers)
        self._prepared: dict[str, _Prepared] = {}
        self._fence: dict[str, int] = {}  # highest attempt seen per name
        self._cleaned: dict[str, int] = {}  # highest attempt cleaned up per name
        self._last_incarnation: str | None = None
        self._last_probe = -math.inf

    # --- plumbing ---------------------------------------------------------------------------

    def _clean(self, code: str, message: str, *, status: int = 0) -> CleanRefusal:
        return CleanRefusal(code, message, engine_id=self.engine_id, status=status)

    def _ambiguous(self, code: str, message: str, *, status: int = 0) -> AmbiguousReply:
        return AmbiguousReply(code, message, engine_id=self.engine_id, status=status)

    def _unrecognised(self, what: str, response: httpx.Response) -> AmbiguousReply:
        return self._ambiguous(
            ErrorCode.MALFORMED_REPLY,
            f"{what}: unrecognised HTTP {response.status_code}: {response.text[:300]!r}",
            status=response.status_code,
        )

    async def _send(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        return await http.request(
            self._client,
            method,
            path,
            engine_id=self.engine_id,
            timeout=timeout,
            json=json,
            content=content,
            headers=headers,
        )

    def _json(self, response: httpx.Response) -> Any:
        return http.json_body(response, engine_id=self.engine_id)

    def _prefixed(self, message: str) -> str | None:
        """The loraledger code in front of a message, if it is one we accept as clean."""
        m = _CODE_PREFIX.match(message)
        return m.group(1) if m and m.group(1) in _PREFIXABLE else None

    # --- identity and inventory -------------------------------------------------------------

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

    async def inventory(self) -> Inventory:
        """Adapters from ``/v1/models`` (names and paths; the digest only when the path is an
        artifact directory named by its digest), bracketed by two incarnation probes so the list
        provably belongs to the incarnation it reports."""
        before = await self.incarnation()
        response = await self._send("GET", "/v1/models", timeout=self.timeouts.control)
        if response.status_code != 200:
            raise self._unrecognised("GET /v1/models", response)
        entries = self._parse_models(self._json(response))
        after = await self.incarnation()
        if after != before:
            raise self._ambiguous(
                ErrorCode.ENGINE_STOPPED,
                f"engine restarted while its inventory was read ({before} -> {after})",
            )
        return Inventory(engine_id=self.engine_id, incarnation=after, adapters=entries)

    def _parse_models(self, body: Any) -> tuple[InventoryEntry, ...]:
        try:
            entries = []
            for card in body["data"]:
                if card.get("parent") is None:
                    continue  # the base model
                root = card.get("root")
                path = str(root) if root is not None else None
                base = os.path.basename(path.rstrip("/")) if path else ""
                digest = base if _DIGEST_DIR.match(base) else None
                entries.append(InventoryEntry(lora_name=str(card["id"]), digest=digest, path=path))
        except (KeyError, TypeError, AttributeError) as exc:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY, f"GET /v1/models: unexpected shape: {exc!r}"
            ) from exc
        return tuple(sorted(entries, key=lambda e: e.lora_name))

    # --- attempt fence ------------------------------------------------------------------------

    def _check_fence(self, name: str, attempt: int) -> None:
        newest = self._fence.get(name, 0)
        if attempt < newest:
            raise self._clean(
                ErrorCode.STALE_ATTEMPT, f"{name}: attempt {attempt} is older than {newest}"
            )
        if attempt <= self._cleaned.get(name, 0):
            raise self._clean(
                ErrorCode.STALE_ATTEMPT, f"{name}: attempt {attempt} was already cleaned up"
            )

    def _require_prepared(self, c: Candidate) -> _Prepared:
        self._check_fence(c.lora_name, c.attempt)
        prepared = self._prepared.get(c.lora_name)
        if prepared is None or prepared.attempt != c.attempt or prepared.digest != c.digest:
            raise self._clean(
                ErrorCode.NOT_PREPARED, f"{c.lora_name} attempt {c.attempt} was not prepared here"
            )
        return prepared

    def _receipt(self, c: Candidate, incarnation: str, phase: str) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=incarnation,
            lora_name=c.lora_name,
            digest=c.digest,
            attempt=c.attempt,
            phase=phase,  # type: ignore[arg-type]
        )

    # --- publication (artifact transport) ------------------------------------------------------

    def _validate_artifact(self, c: Candidate, info: Mapping[str, Any]) -> str:
        """Everything checkable before the engine acts; returns the normalised path."""
        if not c.artifact_path:
            raise self._clean(ErrorCode.BAD_REQUEST, "SGLang loads by path: no artifact_path")
        if not os.path.isabs(c.artifact_path):
            # SGLang sends anything that is not an existing directory to the HF hub
            raise self._clean(
                ErrorCode.PATH_OUTSIDE_STORE, f"artifact path {c.artifact_path!r} is not absolute"
            )
        path = os.path.normpath(c.artifact_path)
        base = os.path.basename(path)
        if _DIGEST_DIR.match(base) and base != c.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH, f"artifact dir {base[:16]} != digest {c.digest[:16]}"
            )
        try:
            config, tensors = read_adapter_dir(path)
        except ArtifactError as exc:
            raise self._clean(exc.code, f"{path}: {exc.message}") from exc
        found = build_manifest(config, tensors).digest
        if found != c.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH, f"{path} holds {found[:16]}, candidate {c.digest[:16]}"
            )
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

    def _validate(self, c: Candidate) -> None:
        check_name(c.lora_name)
        if isinstance(c.attempt, bool) or not isinstance(c.attempt, int) or c.attempt < 1:
            raise self._clean(ErrorCode.BAD_REQUEST, f"attempt {c.attempt!r} must be >= 1")
        if c.digest != c.manifest.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH,
                f"candidate digest {c.digest[:16]} != manifest {c.manifest.digest[:16]}",
            )

    async def prepare(self, candidate: Candidate) -> Receipt:
        """Validate the artifact against the server's limits, fence the attempt, probe the
        incarnation. Touches nothing on the server."""
        try:
            self._validate(candidate)
        except CleanRefusal as exc:
            exc.engine_id = self.engine_id
            raise
        self._check_fence(candidate.lora_name, candidate.attempt)
        info = await self.server_info()
        incarnation = self._incarnation_of(info)
        path = await anyio.to_thread.run_sync(self._validate_artifact, candidate, info)
        self._check_fence(candidate.lora_name, candidate.attempt)  # a newer one may have raced
        self._fence[candidate.lora_name] = candidate.attempt
        self._prepared[candidate.lora_name] = _Prepared(candidate.attempt, candidate.digest, path)
        return self._receipt(candidate, incarnation, "prepared")

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        """Nothing moves: SGLang reads the artifact directory. Buckets are a caller bug."""
        self._require_prepared(candidate)
        async for bucket in buckets:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"SGLang uses the artifact transport; got bucket {bucket.index}",
            )

    async def load(self, candidate: Candidate) -> Receipt:
        prepared = self._require_prepared(candidate)
        name = candidate.lora_name
        response = await self._send(
            "POST",
            "/load_lora_adapter",
            timeout=self.timeouts.control,
            json={"lora_name": name, "lora_path": prepared.path, "pinned": False},
        )
        status, body = response.status_code, self._lora_update(response, f"load {name}")
        if status == 200 and body.get("success") is True:
            inventory = await self.inventory()
            held = {e.lora_name: e for e in inventory.adapters}.get(name)
            if held is None or held.path != prepared.path:
                raise self._ambiguous(
                    ErrorCode.MALFORMED_REPLY,
                    f"load {name}: success, but /v1/models shows "
                    f"{held.path if held else 'no such adapter'}",
                )
            return self._receipt(candidate, inventory.incarnation, "ready")
        message = str(body.get("error_message") or "")
        if status == 400:
            if any(text in message for text in _ALREADY_LOADED):
                inventory = await self.inventory()
                held = {e.lora_name: e for e in inventory.adapters}.get(name)
                if held is not None and held.path == prepared.path:
                    return self._receipt(candidate, inventory.incarnation, "ready")
                raise self._clean(
                    ErrorCode.ALREADY_LOADED,
                    f"{name} is loaded from {held.path if held else '?'}, not {prepared.path}",
                    status=400,
                )
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
        requests drain (§1.4). A repeat ("does not exist") is ``was_loaded=False``."""
        try:
            check_name(lora_name)
        except CleanRefusal as exc:
            exc.engine_id = self.engine_id
            raise
        if attempt is not None:
            newest = self._fence.get(lora_name, 0)
            if attempt < newest:
                raise self._clean(
                    ErrorCode.STALE_ATTEMPT,
                    f"cleanup of {lora_name} attempt {attempt} refused: attempt {newest} is newer",
                )
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
        inventory = await self.inventory()
        if lora_name in inventory.names():
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                f"unload {lora_name}: HTTP {status}, but /v1/models still lists it",
            )
        if attempt is not None:
            self._cleaned[lora_name] = max(attempt, self._cleaned.get(lora_name, 0))
            self._fence[lora_name] = max(attempt, self._fence.get(lora_name, 0))
        self._prepared.pop(lora_name, None)
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=inventory.incarnation,
            lora_name=lora_name,
            was_loaded=was_loaded,
        )

    # --- generation -----------------------------------------------------------------------------

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
            try:
                check_name(lora_name)
            except CleanRefusal as exc:
                exc.engine_id = self.engine_id
                raise
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
        if response.status_code == 400:
            error = self._error_of(response)
            if error is not None:
                code, message = error
                if code is not None:
                    raise self._clean(code, message, status=400)
                if any(text in message for text in _NOT_LOADED):
                    raise self._clean(ErrorCode.NOT_LOADED, message, status=400)
        raise self._unrecognised(f"generate on {lora_name}", response)

    def _error_of(self, response: httpx.Response) -> tuple[str | None, str] | None:
        """``(clean code or None, message)`` of ``{"error": {"message", "code"?}}``."""
        try:
            err = response.json()["error"]
            message = str(err["message"])
        except (ValueError, KeyError, TypeError):
            return None
        code = err.get("code") if isinstance(err, dict) else None
        clean = code if code in _PREFIXABLE or code == ErrorCode.NOT_LOADED else None
        return clean, message

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
            first = choices[0]
            return Generation(
                engine_id=self.engine_id,
                incarnation=incarnation,
                lora_name=lora_name,  # SGLang never confirms which adapter served it
                token_ids=first.token_ids,
                text=first.text,
                logprobs=first.logprobs,
                finish_reason=first.finish_reason,
                prompt_tokens=int(meta.get("prompt_tokens") or 0),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                request_id=str(meta["id"]) if meta.get("id") is not None else None,
                choices=choices if params.n > 1 else (),
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

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
