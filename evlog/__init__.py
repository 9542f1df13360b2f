"""The append-only log: event vocabulary, record envelope, hash chain and stores.

The backends are imported on first use (``evlog.SQLiteStore``, ``evlog.open_store``), so the
pure parts of the package (events, records, the store contract) stay free of I/O imports for
the projections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from evlog.errors import (
    Ambiguous,
    Corrupt,
    InvalidInput,
    LoraLedgerError,
    Refused,
    StoreCode,
    StoreError,
    Unavailable,
)
from evlog.record import GENESIS_HASH, Pending, Record, pending
from evlog.store import EventStore, Snapshot, VerifyReport

if TYPE_CHECKING:
    from evlog.memory import MemoryLog, MemoryStore
    from evlog.postgres import PostgresStore
    from evlog.sqlite import SQLiteStore
    from evlog.stores import open_store

__all__ = [
    "GENESIS_HASH",
    "Ambiguous",
    "Corrupt",
    "EventStore",
    "InvalidInput",
    "LoraLedgerError",
    "MemoryLog",
    "MemoryStore",
    "Pending",
    "PostgresStore",
    "Record",
    "Refused",
    "SQLiteStore",
    "Snapshot",
    "StoreCode",
    "StoreError",
    "Unavailable",
    "VerifyReport",
    "open_store",
    "pending",
]

_LAZY = {
    "MemoryLog": "evlog.memory",
    "MemoryStore": "evlog.memory",
    "PostgresStore": "evlog.postgres",
    "SQLiteStore": "evlog.sqlite",
    "open_store": "evlog.stores",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evlog' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
