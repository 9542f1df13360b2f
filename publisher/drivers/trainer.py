"""The trainer's entry point: one call per weight sync.

A training loop calls :meth:`TrainerClient.publish` once per sync step::

    async with ControlPlane.open(store, fleet, deployment="run7", prefix="policy",
                                 capacity=3, artifact_root="/shared/adapters") as plane:
        trainer = TrainerClient(plane)
        for step in range(1, steps + 1):
            train_one_step(model)
            try:
                result = await trainer.publish(model, step=step)  # a peft model, or
                # await trainer.publish(state_dict, config=lora_config_dict, step=step)
            except PublicationError as exc:
                if exc.code in ("VERSION_CONFLICT", "INVALID_VERSION"):
                    raise          # a trainer bug: the same step with other weights
                if exc.kind == "FATAL":
                    alert(exc)     # FAILED_FATAL, or blocked (see below)
                continue           # a later step publishes again
            if result.status == "SKIPPED":
                ...                # capacity full (old versions still pinned): training goes on
            log(result.lora_name, result.ready_latency())

What it guarantees:

* the adapter is copied (an owned, frozen copy: later optimizer steps cannot change what is
  sent) before anything else, in a worker thread so in-process engines keep generating;
* ``step`` is the version id: publishing the same step again is ``NO_OP`` (or waits for the
  call already publishing it); the same step with other weights is ``VERSION_CONFLICT``;
* ``PUBLISHED`` means every engine of the fleet confirmed the version by inventory and it is
  the default for new sessions; sessions already bound stay on their version;
* ``SKIPPED`` (capacity full after bootstrap) never raises: training goes on, the next step
  tries its own new version;
* every failure is a :class:`~publisher.drivers.publication.PublicationError` with ``kind``,
  ``code`` and ``details``. ``RETRYABLE``: nothing is left behind (the attempt ended
  ``FAILED_RETRYABLE``, capacity or another publication was in the way); the next step simply
  publishes. ``FATAL``: the attempt ended ``FAILED_FATAL`` (an engine reply was ambiguous: the
  candidate may be loaded somewhere, and it keeps its slot), or publication is blocked by such
  an entry, or the request itself is wrong (``VERSION_CONFLICT``, ``INVALID_VERSION``). A
  blocked next ``publish`` runs the reconciler once and goes on if the engines' inventories
  resolve the entry; if they cannot (an engine unreachable), it raises ``PUBLICATION_BLOCKED``
  and an operator must look.

Arguments and results are plain data (a state dict / peft model in, a msgspec struct out, which
:meth:`PublicationOutcome` ``to_builtins`` turns into a dict), so the same API can sit behind a
Ray actor unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec

from projections.status import LedgerStatus
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import ErrorKind, PublicationError, PublicationOutcome

__all__ = [
    "ErrorKind",
    "PublicationError",
    "PublicationOutcome",
    "TrainerClient",
    "copy_adapter",
    "to_builtins",
]


def copy_adapter(
    adapter: Any,
    config: Mapping[str, Any] | None = None,
    *,
    adapter_name: str = "default",
    bucket_bytes: int,
) -> AdapterCopy:
    """An :class:`AdapterCopy` of a peft model or of a state dict + config (an ``AdapterCopy``
    is already one)."""
    if isinstance(adapter, AdapterCopy):
        return adapter
    if hasattr(adapter, "peft_config"):
        if config is not None:
            raise TypeError("a peft model carries its own config: do not pass config=")
        return AdapterCopy.from_peft_model(
            adapter, adapter_name=adapter_name, bucket_bytes=bucket_bytes
        )
    if isinstance(adapter, Mapping):
        if config is None:
            raise TypeError("a state dict needs its PEFT config: pass config=")
        return AdapterCopy.from_state_dict(adapter, config, bucket_bytes=bucket_bytes)
    raise TypeError(
        f"cannot publish a {type(adapter).__name__}: pass a peft model, a state dict with "
        "config=, or an AdapterCopy"
    )


def to_builtins(outcome: PublicationOutcome) -> dict[str, Any]:
    """The outcome as a plain dict (JSON/Ray friendly)."""
    return msgspec.to_builtins(outcome)  # type: ignore[no-any-return]


class TrainerClient:
    """A thin async facade over a :class:`ControlPlane` for the training loop."""

    def __init__(self, plane: ControlPlane, *, adapter_name: str = "default") -> None:
        self._plane = plane
        self.adapter_name = adapter_name

    async def publish(
        self,
        adapter: Any,
        config: Mapping[str, Any] | None = None,
        *,
        step: int,
        allow_rollback: bool = False,
    ) -> PublicationOutcome:
        """Copy ``adapter`` and publish it as version ``step`` (see the module docstring).
        A step lower than the current default is refused (``VERSION_REGRESSION``) unless
        ``allow_rollback=True``: an explicit rollback, recorded as one."""
        frozen = await anyio.to_thread.run_sync(
            functools.partial(
                copy_adapter,
                adapter,
                config,
                adapter_name=self.adapter_name,
                bucket_bytes=self._plane.bucket_bytes,
            )
        )
        return await self._plane.publisher.publish(
            frozen, version_id=step, allow_rollback=allow_rollback
        )

    def status(self) -> LedgerStatus:
        """The ledger's status (default version, versions and their states, engines)."""
        return self._plane.ledger.status()
