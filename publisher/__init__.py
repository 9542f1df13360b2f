"""The writer side of loraledger, and its public face: what a training loop and a rollout
worker import (``from publisher import ControlPlane, TrainerClient, ...``).

The package's rooms (docs/architecture.md): ``core`` (commands, outcomes, errors, the pure
decider, the single-writer ledger, leases), ``drivers`` (the engine protocol, publication,
reclaim, the reconciler, the control plane that composes them, the trainer's side),
``gateway`` (the read view, the one dispatch executor, provenance), ``sessions`` (binders and
the rollout worker), ``openai`` (the OpenAI-compatible face), ``remote`` (the ledger across a
process boundary: wire, service, client) and ``ray`` (the Ray deployment, with its own face,
``publisher.ray``, which alone loads Ray). Nothing imported here loads torch or Ray
(``tests/test_faces.py`` checks it): ``PublishCallback``, whose module imports ``transformers``,
is listed in ``_LAZY`` and imported on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

from evlog.errors import Ambiguous, Corrupt, InvalidInput, LoraLedgerError, Refused, Unavailable
from projections.status import LedgerStatus
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet, InFlightSource
from publisher.drivers.plane import ControlPlane
from publisher.drivers.publication import (
    ErrorKind,
    PublicationError,
    PublicationOutcome,
    PublicationStatus,
)
from publisher.drivers.trainer import TrainerClient, copy_adapter
from publisher.gateway import (
    DispatchCode,
    DispatchError,
    Gateway,
    LedgerView,
    LocalView,
    Served,
)
from publisher.gateway.provenance import (
    JsonlSink,
    MemorySink,
    ProvenanceRecorder,
    ProvenanceRow,
    StoreSink,
    Tee,
    read_rows,
)
from publisher.remote import HttpLedger
from publisher.sessions import LedgerPort, RolloutWorker, SessionBinder

if TYPE_CHECKING:
    from publisher.remote.trainer_callback import PublishCallback

_LAZY = {"PublishCallback": "publisher.remote.trainer_callback"}  # loads transformers

__all__ = [  # noqa: RUF022 -- grouped by who uses them, as the docs present them
    # the control plane: ledger + drivers over a fleet of engines
    "ControlPlane",
    "EngineTimeouts",
    "Fleet",
    "InFlightSource",
    "Ledger",
    "LedgerStatus",
    # the trainer side
    "AdapterCopy",
    "ErrorKind",
    "PublicationError",
    "PublicationOutcome",
    "PublicationStatus",
    "PublishCallback",
    "TrainerClient",
    "copy_adapter",
    # the rollout side, in process or against a ledger elsewhere
    "Gateway",
    "HttpLedger",
    "LedgerPort",
    "LedgerView",
    "LocalView",
    "RolloutWorker",
    "Served",
    "SessionBinder",
    # provenance: which version produced which generation
    "JsonlSink",
    "MemorySink",
    "ProvenanceRecorder",
    "ProvenanceRow",
    "StoreSink",
    "Tee",
    "read_rows",
    # errors: every one is a LoraLedgerError with a stable machine code; the family (the class)
    # says whether and how to retry (docs/errors.md)
    "Ambiguous",
    "Code",
    "Corrupt",
    "DispatchCode",
    "DispatchError",
    "InvalidInput",
    "LedgerError",
    "LoraLedgerError",
    "Refused",
    "Unavailable",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'publisher' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value
