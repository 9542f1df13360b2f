"""An adapter whose bytes are already in the artifact store, as the publication driver reads
it: :class:`StoredArtifact`, an :class:`~publisher.drivers.adapter_source.AdapterSource`.

This is how ``serve`` publishes an adapter a trainer uploaded from another host
(:mod:`publisher.remote.uploads`): the bytes landed in the store verified, and the publication
reads them from there, never whole in memory:

* the manifest is recomputed from the stored files when the source is opened (streamed: the
  digest the ledger allocates is the one of the bytes on disk, not what a client claimed);
* the durable copy is the directory itself (the driver's ``ArtifactStore.ensure`` finds it and
  verifies it, without reading ``tensors``);
* a staged engine gets a :class:`StoredBuckets` payload: buckets of at most
  :data:`STREAMED_BUCKET_BYTES` read from the weights file one at a time in a worker thread,
  each tensor checked against the manifest before it is sent (a byte that rotted on disk is
  a clean ``DIGEST_MISMATCH`` refusal: nothing of it reached the engine). Memory per engine is
  one bucket, whatever the adapter's size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from pathlib import Path

import anyio.to_thread

from engines.artifacts import HEADER_ALLOWANCE, ArtifactStore, open_regular
from engines.contract import Bucket, BucketTensor, Candidate, CleanRefusal, Engine, ErrorCode
from engines.manifest import Manifest, TensorData, tensor_checksum
from engines.weights_file import TensorSpan, WeightsLayout, read_layout, read_tensor

# A bucket read from the store: small enough that every staged engine of a fleet holding one
# at a time stays far below a large adapter, large enough that a 64 MiB adapter is 8 requests.
STREAMED_BUCKET_BYTES = 4 * 1024 * 1024


def plan_spans(layout: WeightsLayout, bucket_bytes: int) -> tuple[tuple[TensorSpan, ...], ...]:
    """The spans (in name order) packed greedily into buckets of at most ``bucket_bytes``; a
    tensor is never split, and one larger than a bucket travels alone (as ``plan_buckets``
    packs tensors in memory)."""
    groups: list[tuple[TensorSpan, ...]] = []
    current: list[TensorSpan] = []
    size = 0
    for span in layout.spans:
        if current and size + span.nbytes > bucket_bytes:
            groups.append(tuple(current))
            current, size = [], 0
        current.append(span)
        size += span.nbytes
    if current:
        groups.append(tuple(current))
    return tuple(groups)


@dataclasses.dataclass(frozen=True)
class StoredBuckets:
    """How a stored adapter's bytes reach one staged engine
    (:class:`~publisher.drivers.adapter_source.Payload`): read bucket by bucket, checked
    tensor by tensor against the manifest, sent as the engine's ``transfer`` takes them."""

    weights: Path
    manifest: Manifest
    groups: tuple[tuple[TensorSpan, ...], ...]

    async def send(self, engine: Engine, candidate: Candidate) -> None:
        async with aclosing(self._buckets(engine.engine_id)) as buckets:
            await engine.transfer(candidate, buckets)

    async def _buckets(self, engine_id: str) -> AsyncGenerator[Bucket, None]:
        for index, spans in enumerate(self.groups):
            yield await anyio.to_thread.run_sync(self._read, index, spans, engine_id)

    def _read(self, index: int, spans: tuple[TensorSpan, ...], engine_id: str) -> Bucket:
        fd = open_regular_or_refuse(self.weights, engine_id)
        try:
            tensors = []
            for span in spans:
                tensor = read_tensor(fd, span)
                expected = self.manifest.tensor(span.name).sha256
                if tensor_checksum(tensor.dtype, tensor.shape, tensor.data) != expected:
                    raise CleanRefusal(
                        ErrorCode.DIGEST_MISMATCH,
                        f"tensor {span.name!r} of the stored adapter {self.manifest.digest[:16]} "
                        "no longer matches its manifest (the file changed on disk)",
                        engine_id=engine_id,
                    )
                tensors.append(BucketTensor(span.name, tensor))
            return Bucket(index, tuple(tensors))
        finally:
            os.close(fd)


def open_regular_or_refuse(path: Path, engine_id: str) -> int:
    """The stored weights file, or a clean refusal naming why it cannot be read."""
    try:
        return open_regular(path)
    except (OSError, ValueError) as exc:
        raise CleanRefusal(
            ErrorCode.INVALID_ADAPTER, f"the stored weights {path}: {exc}", engine_id=engine_id
        ) from exc


class StoredArtifact:
    """The adapter of ``digest`` in ``store``. Open it with :meth:`open` (blocking: it hashes
    the weights file once, in bounded memory; call it in a worker thread)."""

    def __init__(
        self, store: ArtifactStore, manifest: Manifest, layout: WeightsLayout, bucket_bytes: int
    ) -> None:
        self._store = store
        self._manifest = manifest
        self._payload = StoredBuckets(
            store.weights_path(manifest.digest),
            manifest,
            plan_spans(layout, min(bucket_bytes, STREAMED_BUCKET_BYTES)),
        )

    @classmethod
    def open(cls, store: ArtifactStore, digest: str, *, bucket_bytes: int) -> StoredArtifact:
        """Verify the stored directory of ``digest`` (``ArtifactError``: ``INVALID_ADAPTER``
        when it is missing or unreadable, ``DIGEST_MISMATCH`` when it changed) and describe
        it."""
        manifest = store.verify(digest)
        fd = open_regular(store.weights_path(digest))
        try:
            layout = read_layout(fd, max_header_bytes=HEADER_ALLOWANCE)
        finally:
            os.close(fd)
        return cls(store, manifest, layout, bucket_bytes)

    @property
    def digest(self) -> str:
        return self._manifest.digest

    @property
    def size_bytes(self) -> int:
        return self._manifest.total_bytes

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def buckets(self) -> StoredBuckets:
        return self._payload

    @property
    def tensors(self) -> Mapping[str, TensorData]:
        """Every tensor, read whole: the driver asks only when the store lost the directory
        (``ensure`` finds it otherwise), and then this read fails as well, cleanly."""
        return self._store.open(self.digest)[1]

    def __repr__(self) -> str:
        return f"StoredArtifact(digest={self.digest[:16]}, bytes={self.size_bytes})"
