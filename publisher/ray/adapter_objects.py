"""Adapter bytes in Ray's object store: put once by the trainer, pulled by each engine actor.

Why: the ledger actor is one process. If every publication carried the adapter into it and out
again to every engine, that one actor would move (engines + 1) x the adapter's bytes per
publication, on the node of the log. Instead the trainer puts the snapshot's tensors into the
object store ONCE (:func:`put_adapter`) and sends the ledger a small
:class:`AdapterDescriptor` (the manifest: digest, config, every tensor's name, dtype, shape,
size and checksum; plus the ObjectRef). The ledger decides and records as before; each engine
actor pulls the bytes itself (:func:`pull_tensors`: Ray moves them node to node) and checks
them against the candidate's digest before anything is staged (:func:`verified_buckets`), so an
engine never reports READY for bytes that are not the digest's.

**Ownership.** The object is owned by the trainer process that put it (Ray's default), and it
lives while that process holds the ref: :class:`~publisher.ray.trainer.RayTrainerClient` holds
it for the whole ``publish`` call, i.e. until the publication ended. Why not give it to the
ledger actor (``ray.put(..., _owner=...)``): an owner that restarts loses its objects, so a
ledger restart mid-publication would leave the trainer's retry (:class:`ActorLink` resends the
same call) pointing at a lost object, while the trainer, which is still waiting, keeps its own
alive across the ledger's restart. The price: if the trainer process dies mid-publication, its
objects die with it; the engines' pulls then fail cleanly (:data:`ADAPTER_BYTES_LOST`: nothing
was staged), the attempt ends ``FAILED_RETRYABLE`` and the restarted trainer publishes the step
again. After a publication, nothing needs the trainer's objects: repair and restore read the
ledger's durable copy (the artifact store), written from the same object (docs/publication.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError

from engines.artifacts import ArtifactError
from engines.contract import Bucket, Candidate, CleanRefusal, ErrorCode
from engines.manifest import Manifest, ManifestError, TensorData, build_manifest, compute_digest
from evlog.errors import INVALID_INPUT, InvalidInput
from publisher.drivers.adapter_copy import AdapterCopy, plan_buckets

# A clean refusal from an engine actor: the adapter's object could not be fetched (its owner,
# the trainer, died; or the object store lost it). Nothing was staged on the engine.
ADAPTER_BYTES_LOST = "ADAPTER_BYTES_LOST"


@dataclasses.dataclass(frozen=True)
class AdapterDescriptor:
    """What a trainer sends the ledger actor for one publication: the manifest (kilobytes)
    and the ref of the tensors in the object store (``dict[str, TensorData]``)."""

    manifest: Manifest
    ref: ray.ObjectRef

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def size_bytes(self) -> int:
        return self.manifest.total_bytes


def put_adapter(adapter: AdapterCopy) -> AdapterDescriptor:
    """Put the copy's tensors into the object store once (owned by the calling process: keep
    the descriptor until the publication ended). Blocking: call it off the event loop."""
    return AdapterDescriptor(manifest=adapter.manifest, ref=ray.put(dict(adapter.tensors)))


def check_descriptor(descriptor: Any) -> AdapterDescriptor:
    """Refuse a descriptor that is not one, or whose manifest does not hash to its digest (the
    ledger records the digest; the engines check the bytes against it)."""
    if not isinstance(descriptor, AdapterDescriptor) or not isinstance(
        descriptor.ref, ray.ObjectRef
    ):
        raise InvalidInput(
            INVALID_INPUT,
            f"publish takes an AdapterDescriptor (put_adapter), not {type(descriptor).__name__}",
        )
    m = descriptor.manifest
    try:
        recomputed = compute_digest(m.config, m.tensors)
    except ManifestError as exc:
        raise InvalidInput(INVALID_INPUT, f"the adapter's manifest is invalid: {exc}") from exc
    if recomputed != m.digest:
        raise InvalidInput(
            INVALID_INPUT,
            f"the manifest hashes to {recomputed[:16]}, it claims {m.digest[:16]}",
        )
    return descriptor


def _refused(engine_id: str, code: str, message: str) -> CleanRefusal:
    return CleanRefusal(code, message, engine_id=engine_id)


def _as_tensors(value: Any, engine_id: str) -> dict[str, TensorData]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(t, TensorData) for k, t in value.items()
    ):
        raise _refused(
            engine_id,
            ErrorCode.INVALID_ADAPTER,
            f"the adapter's object holds a {type(value).__name__}, not tensors by name",
        )
    return dict(value)


async def pull_tensors(ref: ray.ObjectRef, engine_id: str) -> dict[str, TensorData]:
    """The tensors behind ``ref``, fetched to this node by Ray. A lost object (its owner died,
    the store lost it) is a clean refusal: nothing reached the engine."""
    try:
        value = await ref
    except ObjectLostError as exc:
        raise _refused(
            engine_id, ADAPTER_BYTES_LOST, f"the adapter's bytes are gone: {type(exc).__name__}"
        ) from exc
    return _as_tensors(value, engine_id)


def fetch_tensors(ref: ray.ObjectRef, timeout: float) -> dict[str, TensorData]:
    """Blocking :func:`pull_tensors` for a worker thread (the ledger's durable copy). A lost,
    late or malformed object raises :class:`~engines.artifacts.ArtifactError` (the artifact
    write fails, and the attempt with it)."""
    try:
        return _as_tensors(ray.get(ref, timeout=timeout), "")
    except (ObjectLostError, GetTimeoutError) as exc:
        raise ArtifactError(
            ADAPTER_BYTES_LOST, f"the adapter's bytes are gone: {type(exc).__name__}"
        ) from exc
    except CleanRefusal as exc:
        raise ArtifactError(exc.code, exc.message) from exc


def verified_buckets(
    tensors: Mapping[str, TensorData], candidate: Candidate, bucket_bytes: int, engine_id: str
) -> tuple[Bucket, ...]:
    """The pulled tensors, bucketed, once their digest (recomputed from these bytes and the
    candidate's config) is the candidate's. Hashes every byte: run it in a worker thread."""
    try:
        digest = build_manifest(candidate.manifest.config, tensors).digest
    except ManifestError as exc:
        raise _refused(engine_id, ErrorCode.INVALID_ADAPTER, str(exc)) from exc
    if digest != candidate.digest:
        raise _refused(
            engine_id,
            ErrorCode.DIGEST_MISMATCH,
            f"the bytes pulled for {candidate.lora_name} hash to {digest[:16]}, "
            f"the candidate is {candidate.digest[:16]}",
        )
    return plan_buckets(tensors, bucket_bytes)
