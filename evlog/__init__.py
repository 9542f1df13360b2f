"""The append-only log: event vocabulary, record envelope, hash chain and stores.

Every name is imported here except the PostgreSQL store, which needs the optional ``postgres``
extra (asyncpg): it is imported on first use of ``evlog.PostgresStore`` (``open_store`` of a
``postgresql://`` URL imports it too).
"""

from __future__ import annotations

import importlib
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
from evlog.memory import MemoryLog, MemoryStore
from evlog.record import GENESIS_HASH, Pending, Record, pending
from evlog.sqlite import SQLiteStore
from evlog.store import EventStore, Snapshot, VerifyReport
from evlog.stores import open_store

if TYPE_CHECKING:
    from evlog.postgres import PostgresStore

_LAZY = {"PostgresStore": "evlog.postgres"}  # needs asyncpg (the postgres extra)

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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'evlog' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value
