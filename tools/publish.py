"""``loraledger publish --url URL --version N DIR``: a PEFT adapter directory on this host,
published through a running ``loraledger serve`` elsewhere, with no filesystem shared between
the two. The bytes are uploaded (streamed, checked by serve against their digest, resumed after
a lost connection) by :class:`~publisher.remote.trainer.HttpTrainerClient`, the same client a
training loop uses, and the publication answers the ledger's outcome.

Each failure is one line and its exit code: a directory that is missing or not a LoRA adapter
(2, before anything is sent), no service at ``--url`` (10, after the client's retry window), a
refusal (1, with the ledger's code and message: ``VERSION_REGRESSION``, ``DIGEST_MISMATCH``,
``PUBLICATION_FAILED`` with its cause, a bad token).
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from engines.artifacts import ArtifactError
from evlog.errors import LoraLedgerError
from publisher.core.errors import Code
from publisher.drivers.publication import PublicationError, PublicationOutcome
from publisher.remote.trainer import HttpTrainerClient
from tools.exitcodes import Exit, ToolError
from tools.progress import Update


def publish_dir(
    url: str,
    adapter_dir: Path,
    version: int,
    *,
    token: str | None,
    allow_rollback: bool = False,
    retry_for_s: float = 60.0,
    progress: Update | None = None,
) -> PublicationOutcome:
    """Upload ``adapter_dir`` to serve at ``url`` and publish it as ``version``. ``progress``
    (``tools.progress``) hears the bytes uploaded, then the wait for the engines."""
    if not adapter_dir.is_dir():
        what = "does not exist" if not os.path.lexists(adapter_dir) else "is not a directory"
        raise ToolError(Exit.USAGE, f"{adapter_dir} {what}: name a PEFT LoRA adapter directory")

    def uploaded(sent: int, size: int) -> None:
        if progress is not None:
            progress("uploading", sent, size)

    async def run() -> PublicationOutcome:
        async with HttpTrainerClient(url, token=token, retry_for_s=retry_for_s) as trainer:
            trainer.upload_progress = uploaded
            files = await trainer.upload(adapter_dir, step=version)
            if progress is not None:
                progress("publishing", 0, None)  # the engines load it: no count to show
            return await trainer.publish_uploaded(
                files.digest, step=version, allow_rollback=allow_rollback
            )

    try:
        return anyio.run(run)
    except ArtifactError as exc:
        raise ToolError(Exit.USAGE, f"{adapter_dir} is not a usable adapter: {exc}") from None
    except PublicationError as exc:
        if exc.details.get("url") is not None and exc.code == Code.LEDGER_CLOSED:
            raise ToolError(
                Exit.UNREACHABLE, f"{exc.message}; is `loraledger serve` running at {url}?"
            ) from None
        cause = exc.details.get("cause")
        because = f" (cause {cause})" if cause else ""
        raise ToolError(
            Exit.FAILED,
            f"version {version} not published: {exc.code}{because}, {exc.kind}: {exc.message}",
        ) from None
    except LoraLedgerError as exc:
        raise ToolError(Exit.FAILED, f"{url} refused: {exc.code}: {exc.message}") from None
