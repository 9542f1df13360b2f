"""The store contracts on ``SQLiteStore``: real files, raw sqlite3 to tamper with them.

The every-backend contract runs twice (``synchronous=FULL`` and ``NORMAL``: only durability
differs), the durable-store contract once. What only a SQLite file has is tested by rule in
``test_sqlite_file_checks.py`` and ``test_sqlite_connections.py``.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from evlog.chained_store import ChainedStore
from evlog.record import Row
from evlog.sqlite import LAYOUT_VERSION, SQLiteStore
from evlog.store import EventStore
from tests.evlog.contract import StoreContract
from tests.evlog.durable_contract import DurableStoreContract
from tests.evlog.sqlite_raw import COLUMNS, another_applications_database, raw, run


class _FileWriteLock:
    """Another connection holding the file's write lock (``BEGIN IMMEDIATE``): the store's
    writer waits on it (its busy timeout, 5 s), so a group stays mid-write meanwhile."""

    def __init__(self, path: Path) -> None:
        self._raw = raw(path)

    async def take(self) -> None:
        self._raw.execute("BEGIN IMMEDIATE")

    async def release(self) -> None:
        self._raw.execute("COMMIT")

    async def close(self) -> None:
        if self._raw.in_transaction:
            self._raw.execute("COMMIT")
        self._raw.close()


class SQLiteFile:
    """The hooks of both contracts for a SQLite file."""

    synchronous = "FULL"
    store_class: type[ChainedStore] = SQLiteStore
    REFUSED_INSERT_CAUSE = "IntegrityError"  # a trigger's RAISE(ABORT)
    MISSING_TABLE = ("OperationalError", "no such table")

    @pytest.fixture
    def location(self, tmp_path: Path) -> Path:
        return tmp_path / "log.db"

    def opened(self, location: Path) -> AbstractAsyncContextManager[EventStore]:
        return SQLiteStore.open(location, synchronous=self.synchronous)  # type: ignore[arg-type]

    async def connect(
        self, location: Path, store_class: type[ChainedStore] | None = None
    ) -> SQLiteStore:
        opener: Any = store_class or SQLiteStore
        store: SQLiteStore = await opener.connect(location, synchronous=self.synchronous)
        return store

    async def connect_read_only(self, location: Path) -> SQLiteStore:
        return await SQLiteStore.connect_read_only(f"{location.as_uri()}?mode=ro")

    def raw_row(self, location: Path, seq: int) -> Row:
        conn = raw(location)
        try:
            row: Row = conn.execute(
                f"SELECT {COLUMNS} FROM events WHERE seq = ?", (seq,)
            ).fetchone()
            return row
        finally:
            conn.close()

    def rewrite(self, location: Path, seq: int, **columns: Any) -> None:
        sets = ", ".join(f"{name} = ?" for name in columns)
        conn = raw(location)
        try:
            cur = conn.execute(f"UPDATE events SET {sets} WHERE seq = ?", (*columns.values(), seq))
            assert cur.rowcount == 1
        finally:
            conn.close()

    def remove(self, location: Path, seq: int) -> None:
        conn = raw(location)
        try:
            assert conn.execute("DELETE FROM events WHERE seq = ?", (seq,)).rowcount == 1
        finally:
            conn.close()

    def snapshot_seqs(self, location: Path, code_version: str) -> list[int]:
        conn = raw(location)
        try:
            rows = conn.execute(
                "SELECT seq FROM snapshots WHERE code_version = ? ORDER BY seq", (code_version,)
            )
            return [seq for (seq,) in rows]
        finally:
            conn.close()

    def write_lock(self, location: Path) -> _FileWriteLock:
        return _FileWriteLock(location)

    def refuse_inserts(self, location: Path) -> None:
        run(
            location,
            "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no'); END",
        )

    def allow_inserts(self, location: Path) -> None:
        run(location, "DROP TRIGGER refuse")

    def drop_tables(self, location: Path) -> None:
        run(location, "DROP TABLE snapshots", "DROP TABLE events")

    def plant_foreign_tables(self, location: Path) -> None:
        another_applications_database(location)

    def mark_newer_layout(self, location: Path) -> None:
        run(location, f"PRAGMA user_version = {LAYOUT_VERSION + 1}")


class TestSQLiteStore(SQLiteFile, DurableStoreContract):
    pass


class TestSQLiteStoreNormal(SQLiteFile, StoreContract):
    """The every-backend contract again with ``synchronous=NORMAL``: only durability differs."""

    synchronous = "NORMAL"
