"""SGLang's second transport: adapters sent as tensors, no filesystem shared with the engine.

:class:`SGLangTensorEngine` is :class:`~engines.sglang.SGLangEngine` (same generation, unload,
incarnation and inventory) whose publication goes through ``POST
/load_lora_adapter_from_tensors`` (SGLang >= 0.5.17; the wire is :mod:`engines.tensor_wire`).
Its ``transport`` is ``"staged"``: the publication driver streams the adapter's buckets to
``transfer`` as it does for the local engine, and ``load`` sends them in one request.

Rules, each from a recorded fact (docs/engines.md, SGLang's tensor route):

* **Verify before sending.** Every bucket's tensors are checked against the manifest on
  arrival (``transfer``) and ``load`` recomputes the digest from them, all before a byte
  leaves: SGLang checks ``expected_checksums`` in its TP worker *without* a ``try``, so a bad
  payload does not come back as a 400 but probably kills the server.
* **A failed send is ambiguous plus a probable restart.** A 5xx, a dropped connection or a
  timeout on the tensor route is followed by an incarnation probe: an unreachable server or a
  new incarnation is ``ENGINE_STOPPED`` (the reconciler repairs a restarted engine), otherwise
  the original ambiguous error.
* **By value only.** Payloads are plain pickles of CPU tensors, never shared-memory or
  CUDA-IPC handles (those only work on one host, while the producer keeps them alive).
* **One payload per TP rank**, TP size read from ``/server_info``.
* **Refused configurations** (clean ``BAD_REQUEST`` at ``prepare``): ``dp_size > 1`` (SGLang
  asserts it for every dynamic LoRA operation and nothing reaches the other replicas),
  ``--max-loaded-loras`` set (SGLang would LRU-unload a tensor adapter inside another load,
  and a tensor adapter cannot be reloaded: it would be lost), and a server older than 0.5.17.
* **Encoded once.** Every engine of a fleet that takes the same bytes (same digest, name and
  TP size) sends the same request body: the first load builds it (:func:`~engines.tensor_wire.
  encode_request_body`, one pass, one buffer), the others wait for it and send those bytes;
  it is dropped once no staging refers to it. The digest is what makes sharing safe: every
  engine verified its own buckets against it before its load reads the body.
* **Listed with ``root == "__tensor__"``**: the server knows no digest, so this adapter vouches
  for the digests of what *it* loaded in the current incarnation, and reports the others
  without one. Such an adapter is never implicitly reloaded after an unload (SGLang fails the
  request instead), so the implicit-reload hazard of the path transport is gone.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    ErrorCode,
    Inventory,
    Receipt,
    Transport,
    UnloadReceipt,
)
from engines.manifest import ManifestError, TensorData, TensorInfo, compute_digest, tensor_checksum
from engines.sglang import _ALREADY_LOADED, _LOAD_REFUSALS, SGLangEngine
from engines.tensor_wire import (
    FIRST_VERSION,
    ROUTE,
    TENSOR_ROOT,
    encode_request_body,
)

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


class _SharedBody:
    """The request body of one (digest, name, TP size), built by the first load that needs it
    and reused by every other; it lives as long as a staging refers to it."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.body: bytes | None = None


# Weak values: a body disappears with the last staging that holds it (loaded, unloaded,
# replaced by a new attempt), so nothing outlives the loads that needed it.
_BODIES: weakref.WeakValueDictionary[tuple[str, str, int], _SharedBody] = (
    weakref.WeakValueDictionary()
)


def _shared_body(digest: str, lora_name: str, tp_size: int) -> _SharedBody:
    key = (digest, lora_name, tp_size)
    shared = _BODIES.get(key)
    if shared is None:
        shared = _BODIES[key] = _SharedBody()
    return shared


@dataclass
class _Staging:
    """The buckets received for one attempt, each tensor verified on arrival, and the request
    body its load sends (shared with every engine staging the same bytes)."""

    attempt: int
    digest: str
    tp_size: int
    incarnation: str
    shared: _SharedBody
    tensors: dict[str, TensorData] = field(default_factory=dict)
    sums: dict[str, str] = field(default_factory=dict)  # the manifest's checksums, verified


class SGLangTensorEngine(SGLangEngine):
    """An SGLang >= 0.5.17 server fed through its tensor route (no shared filesystem)."""

    transport: Transport = "staged"

    def __init__(self, base_url: str, engine_id: str, **kwargs: Any) -> None:
        super().__init__(base_url, engine_id, **kwargs)
        self._staging: dict[str, _Staging] = {}
        self._digests: dict[str, tuple[str, str]] = {}  # name -> (incarnation, digest)

    # --- prepare: the server's configuration ---------------------------------------------------

    def _refuse_config(self, info: Mapping[str, Any]) -> None:
        version = _VERSION.match(str(info.get("version", "")))
        if version and tuple(int(x) for x in version.groups()) < FIRST_VERSION:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"SGLang {info.get('version')} has no per-rank tensor route (needs >= "
                f"{'.'.join(map(str, FIRST_VERSION))}); use the path transport",
            )
        if int(info.get("dp_size") or 1) != 1:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"dp_size {info.get('dp_size')}: SGLang's dynamic LoRA supports one data-parallel "
                "replica (nothing is broadcast to the others)",
            )
        if info.get("max_loaded_loras") is not None:
            raise self._clean(
                ErrorCode.BAD_REQUEST,
                f"--max-loaded-loras {info.get('max_loaded_loras')}: SGLang would evict an "
                "adapter inside another load, and a tensor-loaded adapter cannot be reloaded",
            )

    async def prepare(self, candidate: Candidate) -> Receipt:
        self._check_candidate(candidate)
        try:
            recomputed = compute_digest(candidate.manifest.config, candidate.manifest.tensors)
        except ManifestError as exc:
            raise self._clean(ErrorCode.INVALID_ADAPTER, str(exc)) from exc
        if recomputed != candidate.digest:
            raise self._clean(
                ErrorCode.DIGEST_MISMATCH,
                f"manifest hashes to {recomputed[:16]}, candidate says {candidate.digest[:16]}",
            )
        self._attempts.check(candidate.lora_name, candidate.attempt)
        info = await self.server_info()
        incarnation = self._incarnation_of(info)
        self._refuse_config(info)
        self._check_limits(candidate.manifest.config, info)
        self._attempts.stage(candidate, TENSOR_ROOT)
        tp_size = int(info.get("tp_size") or 1)
        self._staging[candidate.lora_name] = _Staging(
            candidate.attempt,
            candidate.digest,
            tp_size,
            incarnation,
            _shared_body(candidate.digest, candidate.lora_name, tp_size),
        )
        return self._receipt(candidate, incarnation, "prepared")

    def _check_limits(self, config: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        limit = self.max_lora_rank if self.max_lora_rank is not None else info.get("max_lora_rank")
        rank = config.get("r")
        if isinstance(limit, int) and isinstance(rank, int) and rank > limit:
            raise self._clean(
                ErrorCode.RANK_UNSUPPORTED,
                f"adapter rank {rank} exceeds the server's --max-lora-rank {limit}",
            )

    def _staged(self, candidate: Candidate) -> _Staging:
        self._attempts.prepared(candidate)
        staging = self._staging.get(candidate.lora_name)
        if staging is None or (staging.attempt, staging.digest) != (
            candidate.attempt,
            candidate.digest,
        ):
            raise self._clean(
                ErrorCode.NOT_PREPARED,
                f"{candidate.lora_name} attempt {candidate.attempt} was not prepared here",
            )
        return staging

    # --- transfer: verify on arrival ------------------------------------------------------------

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        staging = self._staged(candidate)
        expected = {t.name: t for t in candidate.manifest.tensors}
        async for bucket in buckets:
            for item in bucket.tensors:
                sums = await anyio.to_thread.run_sync(
                    tensor_checksum, item.tensor.dtype, item.tensor.shape, item.tensor.data
                )
                problem = _mismatch(expected.get(item.name), item.name, item.tensor, sums)
                if problem is not None:
                    self._staging.pop(candidate.lora_name, None)
                    code, message = problem
                    raise self._clean(code, message)
                staging.tensors[item.name] = item.tensor
                staging.sums[item.name] = sums

    # --- load: one request, then proof ----------------------------------------------------------

    async def load(self, candidate: Candidate) -> Receipt:
        staging = self._staged(candidate)
        name = candidate.lora_name
        missing = sorted({t.name for t in candidate.manifest.tensors} - set(staging.tensors))
        if missing:
            raise self._clean(
                ErrorCode.INVALID_ADAPTER,
                f"{len(missing)} manifest tensors never arrived, e.g. {missing[:3]}",
            )
        infos = [
            TensorInfo(n, t.dtype, tuple(t.shape), t.nbytes, staging.sums[n])
            for n, t in staging.tensors.items()
        ]
        if compute_digest(candidate.manifest.config, infos) != candidate.digest:
            raise self._clean(ErrorCode.DIGEST_MISMATCH, f"{name}: received content differs")
        body = await self._body(candidate, staging)
        try:
            response = await self._send(
                "POST",
                ROUTE,
                timeout=self.timeouts.control,
                content=body,
                headers={"content-type": "application/json"},
            )
        except AmbiguousReply as exc:
            raise await self._probable_restart(exc, staging) from exc
        status, reply = response.status_code, self._lora_update(response, f"load {name}")
        if status == 200 and reply.get("success") is True:
            receipt = await self._confirm_loaded(candidate, TENSOR_ROOT, after="success")
            self._digests[name] = (receipt.incarnation, candidate.digest)
            self._staging.pop(name, None)
            return receipt
        message = str(reply.get("error_message") or "")
        if status == 400:
            if any(text in message for text in _ALREADY_LOADED):
                return await self._tensor_already_loaded(candidate)
            code = self._prefixed(message) or next(
                (code for text, code in _LOAD_REFUSALS if text in message), None
            )
            if code is not None:
                raise self._clean(code, message, status=400)
        raise self._unrecognised(f"load {name}", response)

    @staticmethod
    async def _body(candidate: Candidate, staging: _Staging) -> bytes:
        """The shared body, built here if no other engine built it yet (in a worker thread:
        seconds of CPU for a large adapter)."""
        shared = staging.shared
        async with shared.lock:
            if shared.body is None:
                shared.body = await anyio.to_thread.run_sync(
                    encode_request_body,
                    candidate.lora_name,
                    candidate.manifest.config,
                    staging.tensors,
                    staging.tp_size,
                )
            return shared.body

    async def _probable_restart(self, exc: AmbiguousReply, staging: _Staging) -> AmbiguousReply:
        """SGLang does not catch a payload failure in its TP worker: the server may be gone."""
        try:
            now = await self.incarnation()
        except AmbiguousReply:
            now = None
        if now == staging.incarnation:
            return exc
        return self._ambiguous(
            ErrorCode.ENGINE_STOPPED,
            f"the tensor load failed ({exc.code}) and the server "
            + ("does not answer" if now is None else f"restarted ({staging.incarnation} -> {now})")
            + ": a payload failure probably killed it",
        )

    async def _tensor_already_loaded(self, candidate: Candidate) -> Receipt:
        """The name is taken: ours only if this adapter loaded this digest there, in this
        incarnation (a retry after a lost reply)."""
        inventory = await self.inventory()
        held = {e.lora_name: e for e in inventory.adapters}.get(candidate.lora_name)
        if held is not None and held.path == TENSOR_ROOT and held.digest == candidate.digest:
            self._staging.pop(candidate.lora_name, None)
            return self._receipt(candidate, inventory.incarnation, "ready")
        raise self._clean(
            ErrorCode.ALREADY_LOADED,
            f"{candidate.lora_name} is already loaded (from {held.path if held else '?'})",
            status=400,
        )

    # --- inventory and unload -------------------------------------------------------------------

    async def inventory(self) -> Inventory:
        """``/v1/models``; a ``__tensor__`` entry carries the digest this adapter loaded under
        that name in this incarnation (the server itself knows none)."""
        inventory = await super().inventory()
        adapters = tuple(
            msgspec.structs.replace(e, digest=self._vouched(e.lora_name, inventory.incarnation))
            if e.path == TENSOR_ROOT
            else e
            for e in inventory.adapters
        )
        return msgspec.structs.replace(inventory, adapters=adapters)

    def _vouched(self, name: str, incarnation: str) -> str | None:
        known = self._digests.get(name)
        return known[1] if known is not None and known[0] == incarnation else None

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        receipt = await super().unload(lora_name, attempt=attempt)
        self._digests.pop(lora_name, None)
        self._staging.pop(lora_name, None)
        return receipt


def _mismatch(
    info: TensorInfo | None, name: str, tensor: TensorData, checksum: str
) -> tuple[str, str] | None:
    if info is None:
        return ErrorCode.INVALID_ADAPTER, f"tensor {name!r} is not in the manifest"
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return (
            ErrorCode.INVALID_ADAPTER,
            f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, manifest says "
            f"{info.dtype}{list(info.shape)}",
        )
    if info.sha256 != checksum:
        return ErrorCode.DIGEST_MISMATCH, f"tensor {name!r} bytes do not match the manifest"
    return None
