"""The ledger actor's side of an adapter in the object store: an
:class:`~publisher.drivers.adapter_source.AdapterSource` built from the trainer's
:class:`~publisher.ray.adapter_objects.AdapterDescriptor`, so the unchanged publication driver
publishes it while the bytes stay out of the ledger actor's calls.

* Engines get an :class:`ObjectPayload`: an engine actor is handed the ref and pulls the bytes
  itself (:meth:`~publisher.ray.engine.RayEngine.transfer_object`); only the ref leaves the
  ledger's process.
* A repair goes the same way: a version the reconciler reloads from the durable copy (an engine
  added, replaced or restarted) is put in the object store once, owned by the ledger actor
  for the restore's duration, and the engine actor pulls it (:func:`restore_payload`).
* The durable copy still needs the bytes where the artifact store is (the ledger's node, or the
  shared volume it lives on): repair and restore read it long after the trainer's objects are
  gone, and path-loading engines read its directories. So the ledger pulls the object ONCE,
  from the object store, in a worker thread, concurrently with the engines' pulls
  (``tensors``), never inline in a call. :class:`PullStats` counts those bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import anyio.to_thread
import ray

from engines.contract import Candidate, Engine
from engines.manifest import Manifest, TensorData
from publisher.drivers.adapter_copy import aiter_buckets
from publisher.ray.adapter_objects import (
    AdapterDescriptor,
    fetch_tensors,
    pull_tensors,
    verified_buckets,
)
from publisher.ray.engine import RayEngine


@dataclasses.dataclass
class PullStats:
    """Adapter bytes the ledger's process fetched from the object store (for the durable
    copy), and what publish calls carried (descriptors: manifests and refs, no tensor)."""

    descriptors: int = 0
    pulled_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ObjectPayload:
    """How the bytes behind ``ref`` reach one engine
    (:class:`~publisher.drivers.adapter_source.Payload`).

    An engine actor pulls them; any other engine in this process (not the Ray deployment's
    usual fleet, but the contract allows it) gets them fetched here, verified and bucketed."""

    ref: object
    bucket_bytes: int

    async def send(self, engine: Engine, candidate: Candidate) -> None:
        if isinstance(engine, RayEngine):
            await engine.transfer_object(candidate, self.ref, self.bucket_bytes)
            return
        tensors = await pull_tensors(self.ref, engine.engine_id)
        buckets = await anyio.to_thread.run_sync(
            verified_buckets, tensors, candidate, self.bucket_bytes, engine.engine_id
        )
        await engine.transfer(candidate, aiter_buckets(buckets))


def restore_payload(tensors: Mapping[str, TensorData], bucket_bytes: int) -> ObjectPayload:
    """How the ledger actor's reconciler sends a restore's bytes (read from its artifact store)
    to an engine (``ControlPlane.open(restore_bytes=...)``): put in the object store once and
    pulled and verified by the engine actor, like a publication's, instead of carried inline
    in the ledger actor's ``transfer_bucket`` calls. The ref is the ledger actor's: it lives as
    long as the restore holds the payload. Blocking (``ray.put``): called in a worker thread."""
    return ObjectPayload(ray.put(dict(tensors)), bucket_bytes)


class StoredAdapter:
    """An adapter whose bytes are in the object store, as the publication driver reads it."""

    def __init__(
        self,
        descriptor: AdapterDescriptor,
        *,
        bucket_bytes: int,
        stats: PullStats,
        fetch_timeout_s: float = 300.0,
    ) -> None:
        self._descriptor = descriptor
        self._payload = ObjectPayload(descriptor.ref, bucket_bytes)
        self._stats = stats
        self._fetch_timeout_s = fetch_timeout_s

    @property
    def digest(self) -> str:
        return self._descriptor.digest

    @property
    def size_bytes(self) -> int:
        return self._descriptor.size_bytes

    @property
    def manifest(self) -> Manifest:
        return self._descriptor.manifest

    @property
    def buckets(self) -> ObjectPayload:
        return self._payload

    @property
    def tensors(self) -> Mapping[str, TensorData]:
        """Fetched from the object store (blocking; the driver reads it in a worker thread).
        The artifact store recomputes the digest from these bytes before writing them."""
        tensors = fetch_tensors(self._descriptor.ref, self._fetch_timeout_s)
        self._stats.pulled_bytes += sum(t.nbytes for t in tensors.values())
        return tensors

    def __repr__(self) -> str:
        return f"StoredAdapter(digest={self.digest[:16]}, bytes={self.size_bytes})"
