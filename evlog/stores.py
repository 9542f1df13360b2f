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
from evlog.store import EventStore

SQLITE_PREFIX = "sqlite://"
POSTGRES_SCHEMES = ("postgresql", "postgres")

Backend = Literal["sqlite", "postgres"]


def backend_of(location: str | os.PathLike[str]) -> tuple[Backend, str]:
    """Which backend ``location`` names, and what that backend opens (a path or a URL)."""
    where = os.fspath(location)
    if where.startswith(SQLITE_PREFIX):
        return "sqlite", where[len(SQLITE_PREFIX) :]
    scheme, sep, _ = where.partition("://")
    if not sep:
        return "sqlite", where
    if scheme.lower() in POSTGRES_SCHEMES:
        return "postgres", where
    raise StoreError(
        INVALID_INPUT,
        f"unknown store location scheme {scheme!r}: use a file path, sqlite:// or postgresql://",
    )


def is_shared(location: str | os.PathLike[str]) -> bool:
    """True when the log lives on a server any node reaches (not on this node's disk)."""
    return backend_of(location)[0] == "postgres"


def describe(location: str | os.PathLike[str]) -> str:
    """``location`` fit for logs and messages (a URL's password removed)."""
    backend, where = backend_of(location)
    if backend == "sqlite":
        return where
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(where)
    if parts.password is None:
        return where
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}"))


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
