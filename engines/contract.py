"""The engine contract: what the publisher and the gateway need from any inference engine.

An engine does not know it is managed: this package imports nothing from the ledger.

Every reply is either a value (success) or an :class:`EngineError`, and every error is exactly
one of two kinds, decided by its class, never by the caller:

* :class:`CleanRefusal` -- the engine *proved* what it holds (a 4xx with a recognised meaning,
  or an answer read from a fresh inventory). The caller may act on it (e.g. "absent").
* :class:`AmbiguousReply` -- timeout, 5xx, connection lost after sending, malformed body. The
  engine may or may not have acted; only a later inventory can tell.

The publisher's whole failure handling rests on that split, so adapters raise one of the two
subclasses and nothing else (``raise_for_transport`` maps transport exceptions to ambiguity).

A staged load has three recorded steps: ``prepare`` (validate the candidate and fence the
attempt), ``transfer`` (bytes: nothing for engines that load a PEFT directory by path, buckets
for engines that take tensors), ``load`` (register under the immutable name; the receipt echoes
name, digest, attempt and incarnation).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, Sequence
from typing import Any, Literal, Protocol, cast, runtime_checkable

import msgspec

from engines.manifest import Manifest, TensorData

# Managed names never contain ':' (SGLang's OpenAI parsing) nor '/' (paths, vLLM model ids).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,199}$")


class ErrorCode:
    # clean refusals
    INVALID_NAME = "INVALID_NAME"
    INVALID_ADAPTER = "INVALID_ADAPTER"  # bad config / corrupt tensors / config-tensor mismatch
    DIGEST_MISMATCH = "DIGEST_MISMATCH"
    RANK_UNSUPPORTED = "RANK_UNSUPPORTED"
    ALREADY_LOADED = "ALREADY_LOADED"
    NOT_LOADED = "NOT_LOADED"  # unload/generate of a name the engine does not hold
    NAME_PROTECTED = "NAME_PROTECTED"  # managed name touched by an ordinary call
    NAME_RECLAIMED = "NAME_RECLAIMED"  # a reclaimed name is never implicitly reloaded
    STALE_ATTEMPT = "STALE_ATTEMPT"
    ATTEMPT_REQUIRED = "ATTEMPT_REQUIRED"  # an unfenced unload of a managed name (over HTTP)
    NOT_PREPARED = "NOT_PREPARED"
    # Staged bytes would pass the receiver's cap (the engine-host agent's --staging-bytes):
    # refused before they are kept; another publication may fit once staging is freed.
    STAGING_FULL = "STAGING_FULL"
    PATH_OUTSIDE_STORE = "PATH_OUTSIDE_STORE"
    BAD_REQUEST = "BAD_REQUEST"
    # The engine is stopping: it admits nothing new and answered before running anything (503
    # with this code). Another holder may serve the request; it never ran here.
    ENGINE_DRAINING = "ENGINE_DRAINING"
    # ambiguous
    ENGINE_UNREACHABLE = "ENGINE_UNREACHABLE"  # connection refused: nothing was sent
    TIMEOUT = "TIMEOUT"
    SERVER_ERROR = "SERVER_ERROR"
    CONNECTION_LOST = "CONNECTION_LOST"
    MALFORMED_REPLY = "MALFORMED_REPLY"
    ENGINE_STOPPED = "ENGINE_STOPPED"
    # The engine's process is gone for good (a Ray engine actor that died and will not be
    # restarted): no later call can reach this handle. The call that found out may have run;
    # a call made after it was known is refused before sending (``dispatched`` False).
    ENGINE_GONE = "ENGINE_GONE"


class EngineError(Exception):
    """Base of every engine failure. Never raised directly: use one of the two kinds."""

    clean: bool = False

    def __init__(
        self,
        code: str,
        message: str,
        *,
        engine_id: str = "",
        status: int = 0,
        dispatched: bool = True,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.engine_id = engine_id
        self.status = status
        # False only when the request provably never left this process (connection refused):
        # the caller may then send it again without risking a duplicate generation.
        self.dispatched = dispatched

    def __reduce__(self) -> tuple[Any, ...]:  # keep fields across pickling (Ray)
        return (
            _rebuild,
            (type(self), self.code, self.message, self.engine_id, self.status, self.dispatched),
        )


def _rebuild(
    cls: type[EngineError], code: str, message: str, engine_id: str, status: int, dispatched: bool
) -> EngineError:
    return cls(code, message, engine_id=engine_id, status=status, dispatched=dispatched)


class CleanRefusal(EngineError):
    """The engine answered and proved its state; nothing half-done is left behind."""

    clean = True


class AmbiguousReply(EngineError):
    """The outcome is unknown (timeout, 5xx, lost reply, malformed body)."""

    clean = False


def check_name(name: str) -> str:
    """Refuse names an engine must never see (``/``, ``:``, empty, control chars, too long)."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise CleanRefusal(
            ErrorCode.INVALID_NAME,
            f"adapter name {name!r} must match {NAME_PATTERN.pattern} (no '/' or ':')",
        )
    return name


def attempt_required(name: str) -> CleanRefusal:
    """The refusal of an unload that names no attempt, for a name the ledger manages. Any
    process that reaches an engine's (or an agent's) port may knock; the ledger always names
    the attempt it cleans up, so an unfenced unload of a managed name is never the ledger's."""
    return CleanRefusal(
        ErrorCode.ATTEMPT_REQUIRED,
        f"{name} is managed by loraledger: an unload must name the attempt it cleans up "
        "(the ledger always does)",
    )


# --- data exchanged with engines -----------------------------------------------------------


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """What a publication asks an engine to hold, for one attempt.

    ``artifact_path`` is the immutable PEFT directory in the artifact store (path-loading
    engines); staged engines get the bytes through ``transfer`` instead."""

    lora_name: str
    digest: str
    attempt: int
    manifest: Manifest
    artifact_path: str | None = None


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    incarnation: str
    lora_name: str
    digest: str
    attempt: int
    phase: Literal["prepared", "ready"]


class UnloadReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """``was_loaded`` is False when the name was already absent (an idempotent retry)."""

    engine_id: str
    incarnation: str
    lora_name: str
    was_loaded: bool


class InventoryEntry(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    digest: str | None = None
    path: str | None = None


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine holds at ``incarnation``: ``adapters`` are registered (servable);
    ``staged`` names have bytes received for a prepared attempt that were never loaded --
    memory only an attempt-fenced unload (or that attempt's load) frees. An engine that
    stages nothing engine-side (SGLang, vLLM by path) reports none. Reporting them is what
    lets the reconciler find staging that a lost or ignored cleanup left behind
    (docs/engines.md)."""

    engine_id: str
    incarnation: str
    adapters: tuple[InventoryEntry, ...]
    staged: tuple[str, ...] = ()

    def names(self) -> frozenset[str]:
        return frozenset(a.lora_name for a in self.adapters)


class BucketTensor(msgspec.Struct, frozen=True):
    name: str
    tensor: TensorData


class Bucket(msgspec.Struct, frozen=True):
    """One transfer unit of a staged load; a tensor is never split across buckets."""

    index: int
    tensors: tuple[BucketTensor, ...]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    n: int = 1


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """One of the ``n`` parallel samples of a request (``SamplingParams.n > 1``)."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: str


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One completion. ``lora_name`` is the adapter the engine says it used (None = base).

    ``finish_reason`` is ``"stop"`` (EOS or a stop string), ``"length"`` or ``"abort"`` (the
    engine aborted the request, e.g. SGLang ``/abort_request``; the tokens are the partial
    output). With ``n > 1`` (engines that support it), ``choices`` holds every sample in order
    and the top-level fields repeat ``choices[0]``; with ``n == 1`` it is empty.
    """

    engine_id: str
    incarnation: str
    lora_name: str | None
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    request_id: str | None = None
    choices: tuple[Choice, ...] = ()


Transport = Literal["artifact", "staged"]


class EngineCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine offers beyond the required contract, declared by its adapter.

    Callers read these; they never discover them (no signature inspection, no ``getattr`` of
    attributes the contract does not name), so a wrapper or proxy states what it forwards and an
    adapter cannot gain or lose a feature by renaming a parameter. The defaults describe an
    engine that offers nothing more: an adapter states only what it adds.

    * ``extra_body`` -- ``generate`` also takes ``extra_body=`` (a mapping of caller fields merged
      into the engine's request body; SGLang's ``/generate``, the adapter still owning its own
      keys). Without it a caller must not pass the keyword: the gateway refuses a request that
      carries extra fields rather than dropping them silently.
    * ``endpoint`` -- the address the engine serves on (an HTTP adapter's base URL), recorded
      when the engine joins the ledger so an operator can find it; ``""`` for an engine without
      an address of its own (in this process, behind a Ray actor).
    * ``confirms_end`` -- the handle is also an :class:`EndsRequests`: it can abort a request
      by its id and say when the engine no longer runs it. A caller that lost track of a
      request (cancelled, timed out, reply lost) asks it before it stops counting the request
      as running there; without it, the request counts as running until the engine's
      incarnation ends (docs/engines.md, "When a request has ended").
    """

    extra_body: bool = False
    endpoint: str = ""
    confirms_end: bool = False


@runtime_checkable
class EndsRequests(Protocol):
    """What an engine whose ``capabilities.confirms_end`` is True also offers."""

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """Abort ``request_id`` if it still runs (a request that has not started yet never
        will), and answer whether the engine confirms it no longer runs on ``lora_name``: True
        once it ended or was aborted, False when the engine cannot tell yet. Raises
        :class:`EngineError` when the engine cannot be asked."""
        ...


def ends_requests(engine: Engine) -> EndsRequests | None:
    """``engine`` as an :class:`EndsRequests` when its capabilities say it is one, else None:
    the one way a caller (or a wrapper forwarding the contract) reaches ``abort_request``."""
    return cast(EndsRequests, engine) if engine.capabilities.confirms_end else None


@runtime_checkable
class Engine(Protocol):
    """One fleet member, as seen by the control plane. All methods are async and time-bounded."""

    # Read-only: the control plane never sets them, and a wrapper (a fault injector, a
    # restartable host) forwards them as properties.
    @property
    def engine_id(self) -> str: ...

    @property
    def kind(self) -> str:
        """``"local"`` | ``"sglang"`` | ``"vllm"``."""
        ...

    @property
    def transport(self) -> Transport:
        """How it wants bytes: a PEFT directory path, or staged buckets."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """What it offers beyond the contract (``EngineCapabilities()`` when nothing more)."""
        ...

    async def incarnation(self) -> str:
        """Opaque id of the current process life (changes on restart). Health probe."""
        ...

    async def inventory(self) -> Inventory: ...

    async def prepare(self, candidate: Candidate) -> Receipt: ...

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None: ...

    async def load(self, candidate: Candidate) -> Receipt: ...

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        """Unregister the name (new requests refused at once). Returns when physically done.
        ``attempt`` fences cleanup: a stale attempt's unload never touches a newer attempt."""
        ...

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        """Sent at most once. A lost reply raises AmbiguousReply; nothing here ever resends.
        An engine whose ``capabilities.extra_body`` is True also takes ``extra_body=``."""
        ...

    async def aclose(self) -> None: ...
