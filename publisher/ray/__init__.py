"""The Ray deployment of loraledger: the ledger in one named, detached actor; clients with
the in-process API for trainers and rollout workers; engines as actors.

=========================================  =================================================
:func:`~publisher.ray.ledger_actor.start_ledger`  start (or find) the ledger actor; it hosts a
                                                bare ledger or a whole control plane
:class:`~publisher.ray.client.RayLedger`       rollout side: ``LedgerPort`` + ``LedgerView``
:class:`~publisher.ray.rollout.RayRollout`     a rollout worker for a Ray actor's whole life:
                                                connect once, call from any method
:class:`~publisher.ray.trainer.RayTrainerClient`  trainer side: ``publish(adapter, step=)``
:func:`~publisher.ray.engine.start_engine`     an engine in its own actor, as a ``RayEngine``
:func:`~publisher.ray.gateway.start_gateway`   an OpenAI gateway actor (``start_gateways``: one
                                                per node); returns its HTTP address
:func:`~publisher.ray.local.local_ray`         a loopback-only local Ray instance (tests, bench)
:class:`~publisher.ray.hosting.PortalHost`     keep an ``async with`` open for an actor's life
=========================================  =================================================

Names are imported lazily, every one of them (each loads Ray): ``import publisher.ray`` does
not import Ray until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ActorLink": "publisher.ray.link",
    "AdapterDescriptor": "publisher.ray.adapter_objects",
    "DEFAULT_NAMESPACE": "publisher.ray.link",
    "DEFAULT_LEDGER_NAME": "publisher.ray.ledger_actor",
    "EngineActor": "publisher.ray.engine",
    "GatewayActor": "publisher.ray.gateway",
    "GatewayConfig": "publisher.ray.gateway",
    "LOOPBACK": "publisher.ray.local",
    "LedgerActor": "publisher.ray.ledger_actor",
    "LedgerConfig": "publisher.ray.ledger_actor",
    "PlaneConfig": "publisher.ray.ledger_actor",
    "PortalHost": "publisher.ray.hosting",
    "RayEngine": "publisher.ray.engine",
    "RayLedger": "publisher.ray.client",
    "RayRollout": "publisher.ray.rollout",
    "RayTrainerClient": "publisher.ray.trainer",
    "local_ray": "publisher.ray.local",
    "put_adapter": "publisher.ray.adapter_objects",
    "start_engine": "publisher.ray.engine",
    "start_gateway": "publisher.ray.gateway",
    "start_gateways": "publisher.ray.gateway",
    "start_ledger": "publisher.ray.ledger_actor",
    "stop_engine": "publisher.ray.engine",
    "stop_gateway": "publisher.ray.gateway",
    "stop_ledger": "publisher.ray.ledger_actor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'publisher.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value
