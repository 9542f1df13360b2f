"""Adapter uploads: how ``serve`` receives an adapter's bytes from a trainer on another host, so
that a publication needs no filesystem shared between trainer and service.

An upload is named by the adapter's digest, which the trainer computes from its directory
(``engines.artifacts.describe_adapter_dir``):

1. **offer** (``POST /adapters/{digest}``: the adapter config and the weights file's size):
   answers how many bytes of the weights file are here already (``received``), or that the
   artifact store holds the digest (``stored``: nothing is sent again, whoever sent it);
2. **send** (``PUT /adapters/{digest}/weights?offset=N``: the weights file from byte N): the
   bytes are appended to a partial file beside the store as they arrive (streamed: never held
   whole), and once the last byte is in, the file is checked against the digest
   (``ArtifactStore.adopt``, in bounded memory) and moved into the store, or thrown away with
   ``DIGEST_MISMATCH`` (naming the digest sent and the one the bytes have) or
   ``INVALID_ADAPTER``;
3. **publish** (``POST /versions`` with the digest): the publication reads the stored bytes
   (:class:`~publisher.drivers.stored_artifact.StoredArtifact`, :meth:`AdapterUploads.stored`).

**Resumable.** A connection lost mid-upload leaves the bytes that arrived in the partial file
(a prefix of the file: TCP delivers in order, and the digest check at the end catches anything
else); the trainer offers again, hears ``received`` and sends the rest. Bytes already stored
are never sent or stored twice (the store is content-addressed and never overwritten). Offers
and partial files are files under ``<artifact root>/.uploads``, so an upload resumes across a
restart of ``serve`` too; one untouched for ``stale_after_s`` is removed by the next offer.

**One sender per digest.** A send while another is receiving the same digest is refused
``UPLOAD_IN_PROGRESS`` (retry shortly: the first ends with its connection), and so is an offer
that would change its terms meanwhile.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from engines.artifacts import (
    HEADER_ALLOWANCE,
    MAX_CONFIG_BYTES,
    MAX_WEIGHTS_BYTES,
    ArtifactError,
    ArtifactStore,
)
from publisher.drivers.stored_artifact import StoredArtifact
from publisher.logs import get_logger
from publisher.remote.wire import OfferAdapter, UploadCode, UploadError, UploadState

log = get_logger("loraledger.uploads")

UPLOADS_DIR = ".uploads"  # inside the artifact root: the same filesystem, so adoption is a rename


class AdapterUploads:
    """The uploads into ``store`` (see the module docstring). ``max_bytes`` bounds a weights
    file (the store's own bound by default)."""

    def __init__(
        self,
        store: ArtifactStore,
        *,
        max_bytes: int = MAX_WEIGHTS_BYTES + HEADER_ALLOWANCE,
        stale_after_s: float = 24 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._dir = store.root / UPLOADS_DIR
        self._receiving: set[str] = set()

    # --- the steps -----------------------------------------------------------------------

    async def offer(self, digest: str, config: dict[str, Any], size: int) -> UploadState:
        """Open (or find) the upload of ``digest``: how many bytes are here, or ``stored``."""
        self._check_digest(digest)
        if not 0 < size <= self.max_bytes:
            raise UploadError(
                UploadCode.UPLOAD_TOO_LARGE,
                f"a weights file of {size} bytes: this service takes 1 to {self.max_bytes}",
            )
        if len(json.dumps(config)) > MAX_CONFIG_BYTES:
            raise UploadError(UploadCode.INVALID_ADAPTER, "the adapter config is over 1 MiB")
        if digest in self._receiving:
            raise UploadError(
                UploadCode.UPLOAD_IN_PROGRESS, f"the upload of {digest} is receiving bytes now"
            )
        return await anyio.to_thread.run_sync(
            self._offer, digest, OfferAdapter(config=config, size=size)
        )

    async def receive(self, digest: str, offset: int, chunks: AsyncIterable[bytes]) -> UploadState:
        """Append ``chunks`` (the weights file from byte ``offset``) to the upload of
        ``digest``; once complete, check and store it. A connection lost meanwhile raises
        from ``chunks`` after every byte that arrived was written (the next offer resumes
        there)."""
        self._check_digest(digest)
        if digest in self._receiving:
            raise UploadError(
                UploadCode.UPLOAD_IN_PROGRESS, f"another send of {digest} is receiving bytes now"
            )
        self._receiving.add(digest)
        try:
            return await self._receive(digest, offset, chunks)
        finally:
            self._receiving.discard(digest)

    async def stored(self, digest: str, *, bucket_bytes: int) -> StoredArtifact:
        """The stored adapter of ``digest``, verified, for a publication."""
        self._check_digest(digest)
        if not self.store.contains(digest):
            raise UploadError(
                UploadCode.ADAPTER_NOT_UPLOADED,
                f"no adapter {digest} is stored here: upload it first (offer, then send)",
            )
        try:
            return await anyio.to_thread.run_sync(
                lambda: StoredArtifact.open(self.store, digest, bucket_bytes=bucket_bytes)
            )
        except ArtifactError as exc:
            raise _refusal(exc) from None

    # --- inside ----------------------------------------------------------------------------

    def _check_digest(self, digest: str) -> None:
        try:
            self.store.path_for(digest)
        except ArtifactError as exc:
            raise UploadError(UploadCode.INVALID_ADAPTER, exc.message) from None

    def _part(self, digest: str) -> Path:
        return self._dir / f"{digest}.part"

    def _terms(self, digest: str) -> Path:
        return self._dir / f"{digest}.offer.json"

    def _offer(self, digest: str, offer: OfferAdapter) -> UploadState:
        if self.store.contains(digest):
            return UploadState(digest=digest, size=offer.size, received=offer.size, stored=True)
        self._dir.mkdir(exist_ok=True)
        self._drop_stale()
        part, terms = self._part(digest), self._terms(digest)
        if self._read_terms(digest) != offer:  # new, or other terms: start from byte 0
            tmp = terms.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(msgspec.json.encode(offer))
            tmp.replace(terms)
            part.unlink(missing_ok=True)
        received = part.stat().st_size if part.exists() else 0
        if received > offer.size:  # cannot be a prefix: start again
            part.unlink()
            received = 0
        os.utime(terms)  # touched: not stale while its trainer comes back
        return UploadState(digest=digest, size=offer.size, received=received)

    def _read_terms(self, digest: str) -> OfferAdapter | None:
        try:
            return msgspec.json.decode(self._terms(digest).read_bytes(), type=OfferAdapter)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def _drop_stale(self) -> None:
        """Remove uploads nobody touched for ``stale_after_s`` (a trainer that never came
        back): their partial files would hold disk space forever."""
        horizon = self._clock() - self.stale_after_s
        for path in self._dir.iterdir():
            digest = path.name.split(".", 1)[0]
            if digest in self._receiving:
                continue
            try:
                if path.stat().st_mtime < horizon:
                    path.unlink()
                    log.info("upload.dropped_stale", file=path.name)
            except FileNotFoundError:
                continue

    async def _receive(self, digest: str, offset: int, chunks: AsyncIterable[bytes]) -> UploadState:
        offer = await anyio.to_thread.run_sync(self._read_terms, digest)
        if self.store.contains(digest):  # stored meanwhile (another trainer): nothing to add
            size = offer.size if offer is not None else 0
            return UploadState(digest=digest, size=size, received=size, stored=True)
        if offer is None:
            raise UploadError(
                UploadCode.UNKNOWN_UPLOAD, f"no upload of {digest} was offered: offer it first"
            )
        part = self._part(digest)
        received = part.stat().st_size if part.exists() else 0
        if offset != received:
            raise UploadError(
                UploadCode.UPLOAD_OFFSET,
                f"the upload of {digest} holds {received} bytes: send from there, not {offset}",
                received=received,
            )
        async with await anyio.open_file(part, "ab") as f:
            # Each chunk is in the file before the next is read: what arrived before a lost
            # connection counts (memory holds one chunk of the server's, whatever the size).
            async for chunk in chunks:
                received += len(chunk)
                if received > offer.size:
                    break
                await anyio.to_thread.run_sync(_write_through, f.wrapped, chunk)
        if received > offer.size:
            await anyio.to_thread.run_sync(self._discard, digest)
            raise UploadError(
                UploadCode.UPLOAD_TOO_LARGE,
                f"more than the {offer.size} bytes offered for {digest}: the upload starts over",
            )
        if received < offer.size:  # the body ended early: resumable from here
            return UploadState(digest=digest, size=offer.size, received=received)
        try:
            await anyio.to_thread.run_sync(self.store.adopt, offer.config, part, digest)
        except ArtifactError as exc:
            await anyio.to_thread.run_sync(self._discard, digest)
            log.warning("upload.refused", digest=digest, code=exc.code, reason=exc.message)
            raise _refusal(exc) from None
        self._terms(digest).unlink(missing_ok=True)
        log.info("upload.stored", digest=digest, bytes=offer.size)
        return UploadState(digest=digest, size=offer.size, received=offer.size, stored=True)

    def _discard(self, digest: str) -> None:
        self._part(digest).unlink(missing_ok=True)
        self._terms(digest).unlink(missing_ok=True)


def _write_through(f: IO[bytes], chunk: bytes) -> None:
    f.write(chunk)
    f.flush()


def _refusal(exc: ArtifactError) -> UploadError:
    code = exc.code if exc.code == UploadCode.DIGEST_MISMATCH else UploadCode.INVALID_ADAPTER
    return UploadError(code, exc.message)
