"""The store contracts on ``PostgresStore`` against a real PostgreSQL server (the session's
throwaway one, tests/conftest.py; raw asyncpg to tamper with the database). What only a
server-backed store has (its URL, its sessions, a server that goes away) is tested by rule in
``test_postgres_connections.py``."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg
import pytest

from evlog.chained_store import ChainedStore
from evlog.postgres import LAYOUT_VERSION, PostgresStore
from evlog.record import Row
from evlog.store import EventStore
from tests.evlog.durable_contract import DurableStoreContract
from tests.evlog.postgres_raw import COLUMNS, execute, sql
from tests.support.fixtures import run_blocking


class _TableWriteLock:
    """Another session holding ``EXCLUSIVE`` on the events table: the store's INSERT (which
    needs ``ROW EXCLUSIVE``) waits on it, so a group stays mid-write meanwhile; reads do not."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: asyncpg.Connection | None = None

    async def take(self) -> None:
        if self._conn is None:
            self._conn = await asyncpg.connect(self._url)
        await self._conn.execute("BEGIN; LOCK TABLE loraledger_events IN EXCLUSIVE MODE")

    async def release(self) -> None:
        assert self._conn is not None
        await self._conn.execute("COMMIT")

    async def close(self) -> None:
        if self._conn is not None:
            if self._conn.is_in_transaction():
                await self._conn.execute("COMMIT")
            await self._conn.close()


class TestPostgresStore(DurableStoreContract):
    store_class: type[ChainedStore] = PostgresStore
    REFUSED_INSERT_CAUSE = "RaiseError"  # a trigger's RAISE EXCEPTION
    MISSING_TABLE = ("UndefinedTableError", "does not exist")

    @pytest.fixture
    def location(self, postgres_url: str) -> str:
        return postgres_url

    def opened(self, location: str) -> AbstractAsyncContextManager[EventStore]:
        return PostgresStore.open(location)

    async def connect(
        self, location: str, store_class: type[ChainedStore] | None = None
    ) -> PostgresStore:
        opener: Any = store_class or PostgresStore
        store: PostgresStore = await opener.connect(location)
        return store

    async def connect_read_only(self, location: str) -> PostgresStore:
        return await PostgresStore.connect(location, read_only=True)

    def raw_row(self, location: str, seq: int) -> Row:
        rows = run_blocking(
            sql, location, f"SELECT {COLUMNS} FROM loraledger_events WHERE seq = $1", seq
        )
        return rows[0]

    def rewrite(self, location: str, seq: int, **columns: Any) -> None:
        sets = ", ".join(f"{name} = ${i}" for i, name in enumerate(columns, start=2))
        status = run_blocking(
            execute,
            location,
            f"UPDATE loraledger_events SET {sets} WHERE seq = $1",
            seq,
            *columns.values(),
        )
        assert status == "UPDATE 1"

    def remove(self, location: str, seq: int) -> None:
        status = run_blocking(
            execute, location, "DELETE FROM loraledger_events WHERE seq = $1", seq
        )
        assert status == "DELETE 1"

    def snapshot_seqs(self, location: str, code_version: str) -> list[int]:
        rows = run_blocking(
            sql,
            location,
            "SELECT seq FROM loraledger_snapshots WHERE code_version = $1 ORDER BY seq",
            code_version,
        )
        return [seq for (seq,) in rows]

    def write_lock(self, location: str) -> _TableWriteLock:
        return _TableWriteLock(location)

    def refuse_inserts(self, location: str) -> None:
        run_blocking(
            execute,
            location,
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'no'; END $$; "
            "CREATE TRIGGER refuse BEFORE INSERT ON loraledger_events "
            "FOR EACH ROW EXECUTE FUNCTION refuse()",
        )

    def allow_inserts(self, location: str) -> None:
        run_blocking(
            execute,
            location,
            "DROP TRIGGER refuse ON loraledger_events; DROP FUNCTION refuse()",
        )

    def drop_tables(self, location: str) -> None:
        run_blocking(
            execute, location, "DROP TABLE loraledger_snapshots; DROP TABLE loraledger_events"
        )

    def plant_foreign_tables(self, location: str) -> None:
        run_blocking(execute, location, "CREATE TABLE loraledger_events (id integer)")

    def mark_newer_layout(self, location: str) -> None:
        run_blocking(
            execute, location, f"UPDATE loraledger_layout SET layout = {LAYOUT_VERSION + 1}"
        )
