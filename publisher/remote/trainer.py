"""The trainer's HTTP facade: :class:`HttpTrainerClient` publishes through a ``loraledger
serve`` on another host, with no filesystem shared between the two::

    async with HttpTrainerClient(url, token=token) as trainer:
        for step in range(1, steps + 1):
            train_one_step(model)
            model.save_pretrained(f"ckpt/step-{step}")      # any PEFT LoRA directory
            try:
                result = await trainer.publish(f"ckpt/step-{step}", step=step)
            except PublicationError as exc:
                ...                                          # as with TrainerClient

It keeps :class:`~publisher.drivers.trainer.TrainerClient`'s contract: ``step`` is the version
id, ``allow_rollback`` the same, the same :class:`~publisher.drivers.publication.PublicationOutcome`
(``PUBLISHED``, ``NO_OP``, ``SKIPPED``) and the same ``PublicationError`` (``kind``
``RETRYABLE`` or ``FATAL``, the ledger's codes), rebuilt from serve's answer. What it takes is
a directory, not a model: the bytes must be on disk to be streamed.

How the bytes travel (the service side: :mod:`publisher.remote.uploads`):

1. the directory is described here, in bounded memory: its config, and the manifest and digest
   computed by streaming the weights file once (``engines.artifacts.describe_adapter_dir``); a
   missing or bad directory is an ``ArtifactError`` (``INVALID_ADAPTER``) before anything is
   sent;
2. **upload**: an offer tells what serve holds already (nothing is sent for a digest it
   stores), then the weights file is streamed from there in chunks of 1 MiB, never read whole;
   serve checks the digest on arrival;
3. **publish**: ``POST /versions`` names the digest, with a request id made once per
   ``publish`` call.

Retries, until ``retry_for_s`` has passed: a lost connection mid-upload re-offers and sends
only the bytes serve lacks (resumable); a lost reply of the publication asks again with the
same request id, and serve answers what the first ask reached (the ledger records its steps
under that id: published once, never a second attempt). An outage that outlasts the window is
a ``PublicationError`` ``LEDGER_CLOSED``, ``RETRYABLE``, as on Ray: the next step publishes
anew. Bytes that arrive corrupted are refused by serve (``DIGEST_MISMATCH``, ``RETRYABLE``:
nothing was stored or allocated).
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from pathlib import Path
from types import TracebackType

import anyio
import httpx

from engines.artifacts import AdapterFiles, describe_adapter_dir, open_regular
from engines.weights_file import CHUNK_BYTES
from evlog.errors import LoraLedgerError, Unavailable
from projections.status import LedgerStatus
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind, PublicationError, PublicationOutcome
from publisher.logs import get_logger
from publisher.remote import wire
from publisher.remote.http import LedgerUnreachable, ServiceClient

log = get_logger("loraledger.trainer")

# Refusals of an upload that a later step cannot fix by itself (the request is wrong).
_FATAL_UPLOAD_CODES = frozenset({wire.UploadCode.INVALID_ADAPTER, wire.UploadCode.UPLOAD_TOO_LARGE})


class HttpTrainerClient:
    """``TrainerClient`` for a trainer that reaches the ledger over HTTP (see the module
    docstring). ``token`` is serve's bearer token. ``retry_for_s`` bounds how long a call keeps
    retrying an unreachable or busy service; ``timeout_s`` bounds one request, except the
    publication, which waits up to ``publish_timeout_s`` for the engines."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        retry_for_s: float = 60.0,
        timeout_s: float = 30.0,
        publish_timeout_s: float = 3600.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._service = ServiceClient(url, token=token, timeout_s=timeout_s, client=client)
        self.retry_for_s = retry_for_s
        self.publish_timeout_s = publish_timeout_s
        # Set to follow an upload (a progress bar): called with (bytes of the weights file
        # serve holds or was handed, its size), again from serve's count after a resume.
        self.upload_progress: Callable[[int, int], None] | None = None
        self.bytes_sent = 0  # weights bytes handed to a connection, over every upload and try

    @property
    def url(self) -> str:
        return self._service.url

    async def aclose(self) -> None:
        await self._service.aclose()

    async def __aenter__(self) -> HttpTrainerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- the API ------------------------------------------------------------------------------

    async def publish(
        self, adapter_dir: str | os.PathLike[str], *, step: int, allow_rollback: bool = False
    ) -> PublicationOutcome:
        """Upload the PEFT directory ``adapter_dir`` and publish it as version ``step``."""
        files = await self.upload(adapter_dir, step=step)
        return await self.publish_uploaded(files.digest, step=step, allow_rollback=allow_rollback)

    async def upload(
        self, adapter_dir: str | os.PathLike[str], *, step: int | None = None
    ) -> AdapterFiles:
        """Send the directory's bytes to serve (only those it lacks); once this returns, serve
        holds them verified and the directory is no longer needed. ``step`` only names the
        version in a ``PublicationError``. The retry window starts again after each answer:
        a long upload cut late is resumed, not given up."""
        files = await anyio.to_thread.run_sync(describe_adapter_dir, adapter_dir)
        path = f"/adapters/{files.digest}"
        offer = wire.OfferAdapter(config=files.config, size=files.weights_bytes)
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                state = await self._service.post(path, offer, wire.UploadState)
                deadline = time.monotonic() + self.retry_for_s
                self._report(state.received, files.weights_bytes)
                if not state.stored:
                    weights = self._chunks(Path(files.weights), state.received, files.weights_bytes)
                    async with aclosing(weights):
                        state = await self._service.put_bytes(
                            f"{path}/weights?offset={state.received}",
                            weights,
                            files.weights_bytes - state.received,
                            wire.UploadState,
                        )
                if state.stored:
                    log.info("trainer.uploaded", digest=files.digest, bytes=files.weights_bytes)
                    return files
                # the body ended before the file did: offer again and send the rest
            except (LedgerUnreachable, Unavailable) as exc:
                await self._pause_or_give_up(exc, deadline, step)
            except wire.UploadError as exc:
                if exc.code == wire.UploadCode.UPLOAD_OFFSET:
                    continue  # serve holds another count than we thought: ask again
                kind = ErrorKind.FATAL if exc.code in _FATAL_UPLOAD_CODES else ErrorKind.RETRYABLE
                raise PublicationError(
                    exc.code, exc.message, kind=kind, version_id=step, digest=files.digest
                ) from exc

    async def publish_uploaded(
        self, digest: str, *, step: int, allow_rollback: bool = False
    ) -> PublicationOutcome:
        """Publish the adapter serve stores under ``digest`` as version ``step``. A lost reply
        is asked again with the same request id, which answers the outcome the first reached."""
        body = wire.PublishVersion(
            version_id=step,
            digest=digest,
            allow_rollback=allow_rollback,
            request_id=uuid.uuid4().hex,
        )
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                return await self._service.post(
                    "/versions", body, PublicationOutcome, timeout_s=self.publish_timeout_s
                )
            except PublicationError:
                raise
            except (LedgerUnreachable, Unavailable) as exc:
                await self._pause_or_give_up(exc, deadline, step)
            except wire.UploadError as exc:  # ADAPTER_NOT_UPLOADED: nothing was allocated
                raise PublicationError(
                    exc.code, exc.message, kind=ErrorKind.RETRYABLE, version_id=step, digest=digest
                ) from exc

    async def status(self) -> LedgerStatus:
        """The ledger's status (one round trip)."""
        return await self._service.get("/status", LedgerStatus)

    # --- inside -------------------------------------------------------------------------------

    async def _pause_or_give_up(
        self, exc: LedgerUnreachable | LoraLedgerError, deadline: float, step: int | None
    ) -> None:
        """Wait a little before the next try, or end with the trainer's ``RETRYABLE`` error
        once ``retry_for_s`` has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            code = exc.code if isinstance(exc, LoraLedgerError) else Code.LEDGER_CLOSED
            message = exc.message if isinstance(exc, LoraLedgerError) else str(exc)
            raise PublicationError(
                code,
                f"{message} (tried for {self.retry_for_s:g} s)",
                kind=ErrorKind.RETRYABLE,
                version_id=step,
                url=self.url,
            ) from exc
        log.info("trainer.retrying", url=self.url, error=str(exc)[:200])
        await anyio.sleep(min(1.0, left))

    def _report(self, sent: int, size: int) -> None:
        if self.upload_progress is not None:
            self.upload_progress(sent, size)

    async def _chunks(self, weights: Path, offset: int, size: int) -> AsyncGenerator[bytes, None]:
        """The weights file from ``offset``, a chunk at a time, read in a worker thread."""
        fd = await anyio.to_thread.run_sync(open_regular, weights)
        try:
            while True:
                chunk = await anyio.to_thread.run_sync(
                    functools.partial(os.pread, fd, CHUNK_BYTES, offset)
                )
                if not chunk:
                    return
                offset += len(chunk)
                self.bytes_sent += len(chunk)
                yield chunk
                self._report(offset, size)
        finally:
            os.close(fd)
