"""The writer side of loraledger, and its public face: what a training loop and a rollout
worker import (``from publisher import ControlPlane, TrainerClient, ...``).

The package holds the commands, the pure decider, the single-writer ledger service, the
publication/reclaim/reconcile drivers, the control plane that composes them, and the rollout
side (gateway, sessions, provenance). The Ray deployment has its own face, ``publisher.ray``.

``_FACE`` below is the one map from each public name to the module that defines it. Names are
imported on first use, as in ``publisher.ray``: ``import publisher`` (or ``import
publisher.core.decider``, which runs this file first) imports nothing else, so the pure core stays
cheap and no engine stack, torch or Ray is loaded until a name that needs it is used.
``tests/test_faces.py`` checks that every name resolves and that the import stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    # the control plane: ledger + drivers over a fleet of engines
    "ControlPlane": "publisher.plane",
    "EngineTimeouts": "publisher.engine_ops",
    "Fleet": "publisher.fleet",
    "InFlightSource": "publisher.fleet",
    "Ledger": "publisher.ledger",
    "LedgerStatus": "projections.status",
    # the trainer side
    "AdapterCopy": "publisher.adapter_copy",
    "copy_adapter": "publisher.trainer",
    "ErrorKind": "publisher.publication",
    "PublicationError": "publisher.publication",
    "PublicationOutcome": "publisher.publication",
    "PublicationStatus": "publisher.publication",
    "TrainerClient": "publisher.trainer",
    # the rollout side
    "Gateway": "publisher.gateway",
    "LedgerPort": "publisher.sessions",
    "LedgerView": "publisher.gateway",
    "LocalView": "publisher.gateway",
    "RolloutWorker": "publisher.sessions",
    "Served": "publisher.gateway",
    "SessionBinder": "publisher.sessions",
    # provenance: which version produced which generation
    "JsonlSink": "publisher.gateway.provenance",
    "MemorySink": "publisher.gateway.provenance",
    "ProvenanceRecorder": "publisher.gateway.provenance",
    "ProvenanceRow": "publisher.gateway.provenance",
    "read_rows": "publisher.gateway.provenance",
    # errors: every one is a LoraLedgerError with a stable machine code; the family (the class)
    # says whether and how to retry (docs/errors.md)
    "Ambiguous": "evlog.errors",
    "Code": "publisher.errors",
    "Corrupt": "evlog.errors",
    "DispatchCode": "publisher.gateway",
    "DispatchError": "publisher.gateway",
    "InvalidInput": "evlog.errors",
    "LedgerError": "publisher.errors",
    "LoraLedgerError": "evlog.errors",
    "Refused": "evlog.errors",
    "Unavailable": "evlog.errors",
}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'publisher' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
