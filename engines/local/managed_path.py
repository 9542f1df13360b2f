"""The ledger's path into the local engine: ``prepare``, ``transfer``, ``load`` and ``unload``.

Managed names (anything that went through ``prepare``) are fenced by attempt and protected from
the ordinary SGLang-style calls (:mod:`engines.local.name_table` holds those rules). What this
room adds is the order of a staged load and what each step proves:

* ``prepare`` validates everything it can before a byte moves (name, attempt, the manifest's
  digest recomputed, the artifact path, the adapter's admission) and fences the attempt.
* ``transfer`` verifies each tensor of each bucket against the manifest on arrival; any mismatch
  drops the whole staging area, so nothing half-received survives a refusal.
* ``load`` recomputes the digest from what was received (or read from the artifact path), builds
  the adapter and registers it under its immutable name; a refusal leaves nothing.
* ``unload`` unregisters at once and answers when the adapter is physically gone; an absent name
  answers ``was_loaded=False`` (an idempotent retry), a stale attempt is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

import anyio

from engines.contract import (
    Bucket,
    Candidate,
    CleanRefusal,
    EngineError,
    ErrorCode,
    Receipt,
    UnloadReceipt,
    attempt_required,
    check_name,
)
from engines.local.admission import AdapterPlan, TensorShape, plan_adapter, shapes_of
from engines.local.name_table import Resident
from engines.local.residency import Residency, resolve_under
from engines.manifest import (
    ManifestError,
    TensorData,
    TensorInfo,
    compute_digest,
    tensor_checksum,
)


class ManagedPath(Residency):
    """The staged protocol the ledger drives (module docstring)."""

    def _check_candidate(self, c: Candidate) -> AdapterPlan:
        check_name(c.lora_name)
        if isinstance(c.attempt, bool) or not isinstance(c.attempt, int) or c.attempt < 1:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, f"attempt {c.attempt!r} must be >= 1")
        try:
            recomputed = compute_digest(c.manifest.config, c.manifest.tensors)
        except ManifestError as exc:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, str(exc)) from exc
        if c.manifest.digest != c.digest or recomputed != c.digest:
            raise CleanRefusal(
                ErrorCode.DIGEST_MISMATCH,
                f"candidate digest {c.digest[:16]} does not match its manifest "
                f"({c.manifest.digest[:16]}, recomputed {recomputed[:16]})",
            )
        if c.artifact_path is not None and self.transport == "artifact":
            resolve_under(self.artifact_root, c.artifact_path)
        return plan_adapter(
            c.manifest.config,
            (TensorShape(t.name, t.dtype, tuple(t.shape)) for t in c.manifest.tensors),
            self._module_shapes,
            self.limits,
        )

    async def prepare(self, candidate: Candidate) -> Receipt:
        """Validate what we can before any byte moves, and fence the attempt."""
        self._require_runner()
        try:
            self._check_candidate(candidate)
            async with self._control_lock:
                self._names.begin_prepare(candidate)
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "prepared")

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        async for bucket in buckets:
            await self.receive_bucket(
                candidate.lora_name, candidate.attempt, candidate.digest, bucket
            )

    async def receive_bucket(
        self, lora_name: str, attempt: int, digest: str, bucket: Bucket
    ) -> int:
        """Verify each tensor of one bucket against the manifest on arrival. Any mismatch
        drops the whole staging area (nothing half-received survives a refusal). Returns the
        number of tensors received so far."""
        self._require_runner()
        try:
            replayed = self._names.resident_replay(lora_name, attempt, digest)
            if replayed is not None:  # a retried transfer of a loaded attempt: nothing to do
                return len(bucket.tensors)
            staging = self._names.staging_for(lora_name, attempt, digest)
            sums = await anyio.to_thread.run_sync(
                lambda: [
                    tensor_checksum(b.tensor.dtype, b.tensor.shape, b.tensor.data)
                    for b in bucket.tensors
                ]
            )
            async with self._control_lock:
                if self._names.staging_for(lora_name, attempt, digest) is not staging:
                    raise CleanRefusal(ErrorCode.NOT_PREPARED, f"{lora_name} was prepared again")
                expected = {t.name: t for t in staging.candidate.manifest.tensors}
                for item, checksum in zip(bucket.tensors, sums, strict=True):
                    refusal = _bucket_refusal(
                        expected.get(item.name), item.name, item.tensor, checksum
                    )
                    if refusal is not None:
                        self._names.drop_staging(lora_name)
                        raise refusal
                    staging.tensors[item.name] = item.tensor
                    staging.checksums[item.name] = checksum
                return len(staging.tensors)
        except EngineError as exc:
            raise self._tag(exc) from None

    async def load(self, candidate: Candidate) -> Receipt:
        """Recompute the digest from what was received (or read from the artifact path), build
        the adapter and register it under its immutable name. A refusal leaves nothing."""
        self._require_runner()
        try:
            check_name(candidate.lora_name)
            await self._submit(lambda: self._load_job(candidate))
        except EngineError as exc:
            raise self._tag(exc) from None
        return self._receipt(candidate, "ready")

    async def _load_job(self, c: Candidate) -> None:
        async with self._control_lock:
            if self._names.resident_replay(c.lora_name, c.attempt, c.digest) is not None:
                return
            staging = self._names.staging_for(c.lora_name, c.attempt, c.digest)
            try:
                if staging.tensors or c.artifact_path is None:
                    missing = sorted({t.name for t in c.manifest.tensors} - set(staging.tensors))
                    if missing:
                        raise CleanRefusal(
                            ErrorCode.INVALID_ADAPTER,
                            f"{len(missing)} manifest tensors never arrived, e.g. {missing[:3]}",
                        )
                    # the config fenced at prepare; the digest below proves it is the candidate's
                    config = staging.candidate.manifest.config
                    tensors, path = dict(staging.tensors), None
                    digest = compute_digest(
                        config,
                        [
                            TensorInfo(n, t.dtype, tuple(t.shape), t.nbytes, staging.checksums[n])
                            for n, t in tensors.items()
                        ],
                    )
                else:
                    resolved = resolve_under(self.artifact_root, c.artifact_path)
                    config, tensors, digest = await self._read_dir(resolved, c.manifest.total_bytes)
                    path = str(resolved)
                if digest != c.digest:
                    raise CleanRefusal(
                        ErrorCode.DIGEST_MISMATCH,
                        f"received content hashes to {digest[:16]}, candidate says {c.digest[:16]}",
                    )
                plan = plan_adapter(config, shapes_of(tensors), self._module_shapes, self.limits)
                await self._install(
                    c.lora_name,
                    plan,
                    tensors,
                    digest=digest,
                    path=path,
                    managed=True,
                    attempt=c.attempt,
                )
            finally:
                self._names.drop_staging(c.lora_name)

    async def unload(
        self, lora_name: str, *, attempt: int | None = None, fenced_only: bool = False
    ) -> UnloadReceipt:
        """Managed unload (reclaim, or cleanup of ``attempt``). An absent name answers
        ``was_loaded=False`` (idempotent retry); a stale attempt is refused (STALE_ATTEMPT).
        ``fenced_only`` (the HTTP face, where any caller may knock): a managed name without an
        attempt is refused (ATTEMPT_REQUIRED), checked under the control lock so that a name
        managed meanwhile cannot slip through."""
        self._require_runner()
        try:
            check_name(lora_name)
            was_loaded = await self._submit(
                lambda: self._unload_job(lora_name, attempt, fenced_only)
            )
        except EngineError as exc:
            raise self._tag(exc) from None
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=lora_name,
            was_loaded=was_loaded,
        )

    async def _unload_job(self, name: str, attempt: int | None, fenced_only: bool) -> bool:
        resident: Resident | None = None
        earlier: Resident | None = None
        async with self._control_lock:
            if attempt is None and fenced_only and name in self._names.managed:
                raise attempt_required(name)
            if attempt is not None:
                self._names.fence_cleanup(name, attempt)
            else:
                self._names.drop_staging(name)
            if name in self._names.residents:
                resident = self._names.unregister(name)
            else:
                earlier = self._names.draining_name(name)  # an earlier unload's drain
        if resident is not None:
            await self._free_when_drained(resident)
            return True
        if earlier is not None:
            await self._wait_freed(earlier)
        return False

    def _receipt(self, c: Candidate, phase: Any) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=c.lora_name,
            digest=c.digest,
            attempt=c.attempt,
            phase=phase,
        )


def _bucket_refusal(
    info: TensorInfo | None, name: str, tensor: TensorData, checksum: str
) -> CleanRefusal | None:
    if info is None:
        return CleanRefusal(ErrorCode.INVALID_ADAPTER, f"tensor {name!r} is not in the manifest")
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return CleanRefusal(
            ErrorCode.INVALID_ADAPTER,
            f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, manifest says "
            f"{info.dtype}{list(info.shape)}",
        )
    if info.sha256 != checksum:
        return CleanRefusal(
            ErrorCode.DIGEST_MISMATCH, f"tensor {name!r} bytes do not match the manifest checksum"
        )
    return None
