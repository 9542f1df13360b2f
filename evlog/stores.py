"""Open an event store by location: one string names both the backend and where the log is.

* ``postgresql://user@host:5432/db`` (or ``postgres://``): :class:`~evlog.postgres.PostgresStore`,
  a log on a PostgreSQL server that outlives any one node;
* ``sqlite:///abs/path.db``, ``sqlite://relative.db`` or a plain path: a
  :class:`~evlog.sqlite.SQLiteStore` file on this node's disk.

Anything else with a ``scheme://`` is refused (``INVALID_INPUT``) rather than taken for a
file name. The backends are imported on first use (asyncpg is an optional extra).
docs/stores.md says what each backend guarantees.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from evlog.errors import INVALID_INPUT, StoreError
from evlog.locations import (
    POSTGRES_SCHEMES,
    SQLITE_PREFIX,
    Backend,
    backend_of,
    describe,
    is_shared,
)
from evlog.store import EventStore

__all__ = [
    "POSTGRES_SCHEMES",
    "SQLITE_PREFIX",
    "Backend",
    "backend_of",
    "describe",
    "is_shared",
    "open_store",
]


@asynccontextmanager
async def open_store(
    location: str | os.PathLike[str], *, synchronous: Literal["FULL", "NORMAL"] = "FULL"
) -> AsyncIterator[EventStore]:
    """Open the log at ``location`` for the block, closing it after.

    ``synchronous`` is SQLite's durability setting; a PostgreSQL store always commits with
    ``synchronous_commit = on``, so ``NORMAL`` is refused for it rather than silently ignored.
    """
    backend, where = backend_of(location)
    if backend == "postgres":
        if synchronous != "FULL":
            raise StoreError(
                INVALID_INPUT,
                "synchronous=NORMAL is a SQLite setting; a PostgreSQL store always commits "
                "durably (synchronous_commit = on)",
            )
        try:
            from evlog.postgres import PostgresStore
        except ImportError as exc:
            raise StoreError(
                INVALID_INPUT,
                f"a postgresql:// store needs asyncpg (pip install 'loraledger[postgres]'): {exc}",
            ) from None
        async with PostgresStore.open(where) as pg:
            yield pg
        return
    from evlog.sqlite import SQLiteStore

    async with SQLiteStore.open(where, synchronous=synchronous) as lite:
        yield lite
