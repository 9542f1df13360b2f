"""The trainer's Ray facade: :class:`RayTrainerClient` has the API of
:class:`~publisher.drivers.trainer.TrainerClient` (``publish(adapter, config=None, *, step)``) and
publishes through the control plane hosted by the ledger actor.

The adapter is copied HERE, in the trainer's process, before anything crosses Ray: the owned,
frozen copy (docs/publication.md) must be made where the live parameters are, or later
optimizer steps could change what is sent. Its tensors then go into Ray's object store once
(:func:`~publisher.ray.adapter_objects.put_adapter`, owned by this process), and the ledger
actor gets only a descriptor (manifest + ref): the engine actors pull the bytes themselves and
refuse them unless they hash to the digest. The ref is held until ``publish`` returns, i.e.
until the publication ended (why this process owns it: :mod:`publisher.ray.adapter_objects`).

A publish that meets a ledger restart is sent again through the
:class:`~publisher.ray.link.ActorLink`, with the same descriptor (this process still owns the
object): publication is idempotent per step (``NO_OP`` for a completed version, the same
attempt for one still loading, a new attempt after the restarted plane ended an orphaned one),
so asking again never publishes twice.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio.to_thread

from evlog.errors import LoraLedgerError
from projections.status import LedgerStatus
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.ray.adapter_objects import put_adapter
from publisher.ray.link import DEFAULT_NAMESPACE, ActorLink


class RayTrainerClient:
    """``TrainerClient`` for a trainer in another process than the ledger actor."""

    def __init__(
        self,
        name: str = "ledger",
        *,
        namespace: str = DEFAULT_NAMESPACE,
        adapter_name: str = "default",
        reconnect_timeout: float = 120.0,
    ) -> None:
        self._link = ActorLink(name, namespace=namespace, reconnect_timeout=reconnect_timeout)
        self.adapter_name = adapter_name

    @property
    def reconnects(self) -> int:
        return self._link.reconnects

    async def publish(
        self,
        adapter: Any,
        config: Mapping[str, Any] | None = None,
        *,
        step: int,
        allow_rollback: bool = False,
    ) -> Any:
        """Copy ``adapter`` here and publish it as version ``step``: a
        ``PublicationOutcome``, or ``PublicationError`` raised as in process (``allow_rollback``
        too). A ledger actor that stays unreachable past ``reconnect_timeout`` is a
        ``PublicationError`` as well (``LEDGER_CLOSED``, ``RETRYABLE``: the ledger settles an
        attempt it had begun once it is back, and a later step publishes anew), so a loop that
        skips a failed publication goes on training through a ledger outage."""
        from publisher.drivers.trainer import copy_adapter

        frozen = await anyio.to_thread.run_sync(
            functools.partial(
                copy_adapter,
                adapter,
                config,
                adapter_name=self.adapter_name,
                bucket_bytes=2**62,  # bucketing happens in the actor, for its engines
            )
        )
        descriptor = await anyio.to_thread.run_sync(put_adapter, frozen)
        del frozen  # the object store holds the bytes now; the descriptor keeps them alive
        try:
            return await self._link.call("publish", descriptor, step, allow_rollback)
        except PublicationError:
            raise
        except LoraLedgerError as exc:
            if exc.code != Code.LEDGER_CLOSED:
                raise
            raise PublicationError(
                exc.code, exc.message, kind=ErrorKind.RETRYABLE, version_id=step, **exc.details
            ) from exc

    async def status(self) -> LedgerStatus:
        """The ledger's status (one round trip; in process this read is local)."""
        return await self._link.call("status")  # type: ignore[no-any-return]
