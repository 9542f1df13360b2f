"""What a provenance store is, whichever backend keeps it (:mod:`evlog.provenance_store`
says where and why): the row as stored, the store's protocol, and its one failure. Apart from
the backends so that each backend and the door that opens them depend on this, not on each
other."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import msgspec

from evlog.errors import StoreCode, StoreError

POSTGRES_TABLE = "loraledger_provenance"  # evlog/provenance_postgres.py


class StoredRow(msgspec.Struct, frozen=True, kw_only=True):
    """One row as the store keeps it: key, session, start time, and the opaque body."""

    row_id: str
    session: str
    started_at: float
    body: bytes


class ProvenanceStore(Protocol):
    """What the ledger's process writes and the read-only tools read."""

    @property
    def location(self) -> str: ...

    async def add(self, rows: Sequence[StoredRow]) -> int:
        """Store ``rows`` in one durable transaction, skipping ids already stored; returns
        how many were new."""
        ...

    async def read(self, sessions: Collection[str] | None = None) -> list[bytes]:
        """The bodies of ``sessions``' rows (every row when None), by session, then start."""
        ...

    async def count(self) -> int: ...


def failed(exc: BaseException, doing: str, where: str) -> StoreError:
    """``STORE_FAILED``: the batch may or may not be stored; sent again, it is stored once."""
    return StoreError(StoreCode.STORE_FAILED, f"{where}: {doing} failed: {exc!r}")
