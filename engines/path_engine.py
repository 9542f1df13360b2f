"""What the SGLang and vLLM adapters share: a stock server that loads a PEFT directory by path.

Both servers take an adapter as ``(name, path)``, list the adapters they hold as OpenAI model
cards on ``GET /v1/models`` (``id`` = name, ``root`` = the path it was loaded from, ``parent``
null on the base model's card) and know nothing of publication attempts. So both adapters need
the same things around their own endpoints, and they live here once:

* :class:`AttemptFence` -- the attempt fence the server lacks, kept in the adapter object;
* :class:`PathLoadingEngine` -- the base class of both adapters: HTTP plumbing (every request
  sent once and classified by :mod:`engines.http`), the clean/ambiguous error constructors, the
  inventory read from ``/v1/models`` between two incarnation probes, the checks an artifact
  directory must pass before the engine is allowed to read it, and the fresh-inventory proofs
  that follow a load or an unload.

What stays in each adapter is what really differs: endpoints, the reply texts and status codes
that mean a clean refusal, the incarnation signal, rank limits, and generation.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from engines import http
from engines.artifacts import HEADER_ALLOWANCE, ArtifactError, describe_adapter_dir
from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    Choice,
    CleanRefusal,
    EngineCapabilities,
    ErrorCode,
    Generation,
    Inventory,
    InventoryEntry,
    Receipt,
    Transport,
    UnloadReceipt,
    check_name,
)

# Artifact directories are named by their digest, so a path alone can name the content.
DIGEST_DIR = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Prepared:
    """A prepared candidate: what ``load`` will ask the engine to read, for which attempt."""

    attempt: int
    digest: str
    path: str  # normalised, absolute artifact directory


class AttemptFence:
    """Per-name attempt fences for an engine that has no notion of attempts.

    Per adapter name it remembers the highest attempt prepared, the highest attempt cleaned up
    (``unload(name, attempt=a)``) and the candidate currently prepared. A ``prepare``/``load``
    of an attempt older than the newest one, or of one already cleaned up, is
    ``STALE_ATTEMPT``: a late step of an attempt the publisher gave up on must never resurrect
    it. A cleanup of an attempt older than the newest one is ``STALE_ATTEMPT`` too, so a late
    cleanup of attempt k never touches attempt k+1.

    The fence is per adapter object: after a control-plane restart the publisher re-establishes
    the truth from inventories, not from this memory.
    """

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._newest: dict[str, int] = {}  # highest attempt prepared, per name
        self._cleaned: dict[str, int] = {}  # highest attempt cleaned up, per name
        self._prepared: dict[str, Prepared] = {}

    def _refuse(self, code: str, message: str) -> CleanRefusal:
        return CleanRefusal(code, message, engine_id=self.engine_id)

    def check(self, name: str, attempt: int) -> None:
        """Refuse an attempt older than the newest prepared one, or one already cleaned up."""
        newest = self._newest.get(name, 0)
        if attempt < newest:
            raise self._refuse(
                ErrorCode.STALE_ATTEMPT, f"{name}: attempt {attempt} is older than attempt {newest}"
            )
        cleaned = self._cleaned.get(name, 0)
        if attempt <= cleaned:
            raise self._refuse(
                ErrorCode.STALE_ATTEMPT,
                f"{name}: attempt {attempt} was cleaned up (up to attempt {cleaned})",
            )

    def stage(self, candidate: Candidate, path: str) -> None:
        """Record ``candidate`` as prepared from ``path``; its attempt becomes the newest.

        Checks the fence again first: a newer attempt may have been prepared while this one
        was being validated (``prepare`` awaits the engine and the disk)."""
        name = candidate.lora_name
        self.check(name, candidate.attempt)
        self._newest[name] = candidate.attempt
        self._prepared[name] = Prepared(candidate.attempt, candidate.digest, path)

    def prepared(self, candidate: Candidate) -> Prepared:
        """What ``prepare`` recorded for exactly this attempt and digest (else ``NOT_PREPARED``)."""
        self.check(candidate.lora_name, candidate.attempt)
        prepared = self._prepared.get(candidate.lora_name)
        if (
            prepared is None
            or prepared.attempt != candidate.attempt
            or prepared.digest != candidate.digest
        ):
            raise self._refuse(
                ErrorCode.NOT_PREPARED,
                f"{candidate.lora_name} attempt {candidate.attempt} was not prepared here",
            )
        return prepared

    def check_cleanup(self, name: str, attempt: int) -> None:
        """Refuse a cleanup of an attempt older than the newest one prepared."""
        newest = self._newest.get(name, 0)
        if attempt < newest:
            raise self._refuse(
                ErrorCode.STALE_ATTEMPT,
                f"cleanup of {name} attempt {attempt} refused: attempt {newest} is newer",
            )

    def close(self, name: str, attempt: int, *, refuse_older_cleanups: bool) -> None:
        """Record that ``attempt`` (and every older one) of ``name`` is cleaned up: none of them
        can be prepared or loaded here again, and the prepared candidate is dropped.

        ``refuse_older_cleanups`` also makes ``attempt`` the newest, so that a later cleanup of
        an older attempt is ``STALE_ATTEMPT`` (as the local engine's own fence does). Without
        it, such a cleanup still goes through; nothing newer can have been prepared meanwhile,
        or the newest attempt would refuse it anyway."""
        self._cleaned[name] = max(attempt, self._cleaned.get(name, 0))
        if refuse_older_cleanups:
            self._newest[name] = max(attempt, self._newest.get(name, 0))
        self._prepared.pop(name, None)

    def knows(self, name: str) -> bool:
        """Whether ``name`` was prepared or cleaned up through this fence (a managed name)."""
        return name in self._newest or name in self._cleaned

    def forget(self, name: str) -> None:
        """Drop the prepared candidate of ``name`` (it was unloaded): a load needs a new
        ``prepare``."""
        self._prepared.pop(name, None)


class PathLoadingEngine:
    """Base class of the SGLang and vLLM adapters (artifact transport: adapters load by path).

    A subclass sets ``kind``, ``engine_name`` (for messages) and ``timeouts`` (with at least
    ``control``, the bound on ``/v1/models``), implements ``incarnation``, ``prepare``,
    ``load``, ``unload`` and ``generate``, and calls the shared steps below from them.

    ``client`` may be injected (tests, shared pools); otherwise one is owned and closed by
    :meth:`aclose`. The owned client ignores proxy environment variables: a proxy between the
    control plane and an engine would blur "never sent" and "sent once".
    """

    kind: str
    transport: Transport = "artifact"
    engine_name: str  # "SGLang", "vLLM"
    timeouts: Any  # the subclass's own timeouts dataclass

    def __init__(
        self,
        base_url: str,
        engine_id: str,
        *,
        max_lora_rank: int | None,
        client: httpx.AsyncClient | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.base_url = base_url.rstrip("/")
        self.capabilities = EngineCapabilities(endpoint=self.base_url)
        self.max_lora_rank = max_lora_rank
        self._owns_client = client is None
        self._client = client or http.engine_client(self.base_url, headers=headers)
        self._attempts = AttemptFence(engine_id)
        self._last_incarnation: str | None = None
        self._last_probe = -math.inf

    async def incarnation(self) -> str:
        raise NotImplementedError

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    # --- errors and sending -----------------------------------------------------------------

    def _clean(self, code: str, message: str, *, status: int = 0) -> CleanRefusal:
        return CleanRefusal(code, message, engine_id=self.engine_id, status=status)

    def _ambiguous(self, code: str, message: str, *, status: int = 0) -> AmbiguousReply:
        return AmbiguousReply(code, message, engine_id=self.engine_id, status=status)

    def _unrecognised(self, what: str, response: httpx.Response) -> AmbiguousReply:
        """A 4xx we do not understand proves nothing: ambiguous, never clean."""
        return self._ambiguous(
            ErrorCode.MALFORMED_REPLY,
            f"{what}: unrecognised HTTP {response.status_code}: {response.text[:300]!r}",
            status=response.status_code,
        )

    def _check_name(self, name: str) -> str:
        """:func:`check_name`, with the refusal stamped with this engine's id."""
        try:
            return check_name(name)
        except CleanRefusal as exc:
            exc.engine_id = self.engine_id
            raise

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

    def _receipt(self, candidate: Candidate, incarnation: str, phase: str) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=incarnation,
            lora_name=candidate.lora_name,
            digest=candidate.digest,
            attempt=candidate.attempt,
            phase=phase,  # type: ignore[arg-type]
        )

    def _generation(
        self,
        choices: tuple[Choice, ...],
        *,
        incarnation: str,
        lora_name: str | None,
        prompt_tokens: int,
        cached_tokens: int,
        request_id: str | None,
    ) -> Generation:
        """The contract's shape of a reply: the top-level fields repeat ``choices[0]``, and
        ``choices`` is kept only when there is more than one sample."""
        first = choices[0]
        return Generation(
            engine_id=self.engine_id,
            incarnation=incarnation,
            lora_name=lora_name,
            token_ids=first.token_ids,
            text=first.text,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            request_id=request_id,
            choices=choices if len(choices) > 1 else (),
        )

    # --- inventory ----------------------------------------------------------------------------

    async def inventory(self) -> Inventory:
        """Adapters from ``/v1/models``, bracketed by two incarnation probes.

        If the server restarted while the list was read, the two probes differ and the answer
        proves nothing (ambiguous ``ENGINE_STOPPED``) rather than pinning one process's list on
        another process."""
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

    def _is_base_card(self, card: Mapping[str, Any]) -> bool:
        """The base model's card has no ``parent``; adapter cards name the base as theirs."""
        return card.get("parent") is None

    def _parse_models(self, body: Any) -> tuple[InventoryEntry, ...]:
        """Names and paths; the digest only when the path is an artifact directory named by
        its digest (the server itself knows no digests)."""
        try:
            entries = []
            for card in body["data"]:
                if self._is_base_card(card):
                    continue
                root = card.get("root")
                path = str(root) if root is not None else None
                base = os.path.basename(path.rstrip("/")) if path else ""
                digest = base if DIGEST_DIR.match(base) else None
                entries.append(InventoryEntry(lora_name=str(card["id"]), digest=digest, path=path))
        except (KeyError, TypeError, AttributeError) as exc:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY, f"GET /v1/models: unexpected shape: {exc!r}"
            ) from exc
        return tuple(sorted(entries, key=lambda e: e.lora_name))

    # --- publication steps ----------------------------------------------------------------------

    def _check_candidate(self, c: Candidate) -> None:
        """The candidate's own consistency: a valid name, an attempt >= 1, a digest that is its
        manifest's."""
        self._check_name(c.lora_name)
        if isinstance(c.attempt, bool) or not isinstance(c.attempt, int) or c.attempt < 1:
            raise self._clean(ErrorCode.BAD_REQUEST, f"attempt {c.attempt!r} must be >= 1")
        if c.digest != c.manifest.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH,
                f"candidate digest {c.digest[:16]} != manifest {c.manifest.digest[:16]}",
            )

    def _read_artifact(self, c: Candidate) -> tuple[str, dict[str, Any]]:
        """Re-hash the artifact directory (the engine will read the same bytes), streamed: one
        chunk in memory whatever the size (``describe_adapter_dir``; this runs in the
        publisher's process, once per engine of a fleet); returns its normalised path and its
        adapter config. Blocking: run it in a thread."""
        if not c.artifact_path:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"{self.engine_name} loads adapters by path: candidate has no artifact_path",
            )
        # The engine takes a relative path that is not an existing directory for a hub repo id
        # and downloads it.
        if not os.path.isabs(c.artifact_path):
            raise self._clean(
                ErrorCode.PATH_OUTSIDE_STORE, f"artifact path {c.artifact_path!r} must be absolute"
            )
        path = os.path.normpath(c.artifact_path)
        base = os.path.basename(path)
        if DIGEST_DIR.match(base) and base != c.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH, f"artifact dir {base[:16]} != digest {c.digest[:16]}"
            )
        try:
            described = describe_adapter_dir(
                path, max_weights_bytes=c.manifest.total_bytes + HEADER_ALLOWANCE
            )
        except ArtifactError as exc:
            raise self._clean(exc.code, f"{path}: {exc.message}") from exc
        found = described.digest
        if found != c.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH,
                f"{path} holds {found[:16]}, candidate is {c.digest[:16]}",
            )
        return path, described.config

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        """Nothing to transfer: the engine reads the artifact directory itself. Buckets sent
        anyway are a caller bug and are refused before any of them is used."""
        self._attempts.prepared(candidate)
        async for bucket in buckets:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"{self.engine_name} uses the artifact transport;"
                f" got bucket {bucket.index} for {candidate.lora_name}",
            )

    async def _confirm_loaded(self, candidate: Candidate, path: str, *, after: str) -> Receipt:
        """The ``ready`` receipt once a fresh inventory lists the name with our path; anything
        else is ambiguous (something happened in between, e.g. a restart)."""
        inventory = await self.inventory()
        held = {e.lora_name: e for e in inventory.adapters}.get(candidate.lora_name)
        if held is None or held.path != path:
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                f"load {candidate.lora_name}: {after}, but /v1/models shows "
                f"{held.path if held else 'no such adapter'}",
            )
        return self._receipt(candidate, inventory.incarnation, "ready")

    async def _already_loaded(self, candidate: Candidate, path: str, *, status: int) -> Receipt:
        """The engine says the name is taken. Success if it holds *our* path (a retried load
        after a lost reply); any other holder is a clean ``ALREADY_LOADED``."""
        inventory = await self.inventory()
        held = {e.lora_name: e for e in inventory.adapters}.get(candidate.lora_name)
        if held is not None and held.path == path:
            return self._receipt(candidate, inventory.incarnation, "ready")
        raise self._clean(
            ErrorCode.ALREADY_LOADED,
            f"{candidate.lora_name} is loaded from {held.path if held else '?'}, not {path}",
            status=status,
        )

    async def _unloaded_receipt(
        self, lora_name: str, *, status: int, was_loaded: bool
    ) -> UnloadReceipt:
        """After the engine answered an unload (HTTP ``status``): prove the name's absence with
        a fresh inventory, drop its prepared candidate, and return the receipt."""
        inventory = await self.inventory()
        if lora_name in inventory.names():
            raise self._ambiguous(
                ErrorCode.MALFORMED_REPLY,
                f"unload {lora_name}: HTTP {status}, but /v1/models still lists it",
            )
        self._attempts.forget(lora_name)
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=inventory.incarnation,
            lora_name=lora_name,
            was_loaded=was_loaded,
        )
