"""The trainer's Ray facade: :class:`RayTrainerClient` has the API of
:class:`~publisher.trainer.TrainerClient` (``publish(adapter, config=None, *, step)``) and
publishes through the control plane hosted by the ledger actor.

The adapter is copied HERE, in the trainer's process, before anything crosses Ray: the owned,
frozen copy (docs/publication.md) must be made where the live parameters are, or later
optimizer steps could change what is sent. What travels is plain data (:class:`AdapterWire`:
canonical config, the copied tensors, the digest); the actor rebuilds the copy from it and
refuses it if the digest it computes differs (the bytes changed on the way).

A publish that meets a ledger restart is sent again through the
:class:`~publisher.ray.link.ActorLink`: publication is idempotent per step (``NO_OP`` for a
completed version, the same attempt for one still loading, a new attempt after the restarted
plane ended an orphaned one), so asking again never publishes twice.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio.to_thread
import msgspec

from engines.manifest import TensorData
from evlog.errors import INVALID_INPUT, InvalidInput
from projections.status import LedgerStatus
from publisher.adapter_copy import AdapterCopy
from publisher.ray.link import DEFAULT_NAMESPACE, ActorLink


class AdapterWire(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter copy as plain data, for one trip to the ledger actor."""

    config: dict[str, Any]
    tensors: dict[str, TensorData]
    digest: str


def wire_of(adapter: AdapterCopy) -> AdapterWire:
    return AdapterWire(config=adapter.config, tensors=dict(adapter.tensors), digest=adapter.digest)


def rebuild_copy(wire: AdapterWire, bucket_bytes: int) -> AdapterCopy:
    """The copy again (bucketed for this plane), checked against the sender's digest."""
    adapter = AdapterCopy(wire.config, wire.tensors, bucket_bytes=bucket_bytes)
    if adapter.digest != wire.digest:
        raise InvalidInput(
            INVALID_INPUT,
            f"the adapter hashes to {adapter.digest[:16]} here, the trainer sent "
            f"{wire.digest[:16]}: its bytes changed in transit",
        )
    return adapter


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
        self, adapter: Any, config: Mapping[str, Any] | None = None, *, step: int
    ) -> Any:
        """Copy ``adapter`` here and publish it as version ``step``: a
        ``PublicationOutcome``, or ``PublicationError`` raised as in process."""
        from publisher.trainer import copy_adapter

        frozen = await anyio.to_thread.run_sync(
            functools.partial(
                copy_adapter,
                adapter,
                config,
                adapter_name=self.adapter_name,
                bucket_bytes=2**62,  # bucketing happens in the actor, for its engines
            )
        )
        return await self._link.call("publish", wire_of(frozen), step)

    async def status(self) -> LedgerStatus:
        """The ledger's status (one round trip; in process this read is local)."""
        return await self._link.call("status")  # type: ignore[no-any-return]
