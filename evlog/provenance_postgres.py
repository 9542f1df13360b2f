"""The provenance store as a table in a PostgreSQL log's own database (through asyncpg, an
optional extra: imported only for a ``postgresql://`` log). What the store is and why it sits
beside the log: :mod:`evlog.provenance_store`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager

import anyio
import asyncpg

from evlog.locations import describe
from evlog.postgres import _check_address as check_address  # the log's own rule, not a copy
from evlog.provenance_rows import POSTGRES_TABLE, StoredRow, failed

_LAYOUT = (
    f"""CREATE TABLE IF NOT EXISTS {POSTGRES_TABLE} (
        row_id text PRIMARY KEY,
        session text NOT NULL,
        started_at double precision NOT NULL,
        body bytea NOT NULL
    )""",
    f"CREATE INDEX IF NOT EXISTS {POSTGRES_TABLE}_by_session "
    f"ON {POSTGRES_TABLE} (session, started_at)",
)
_INSERT = (
    f"INSERT INTO {POSTGRES_TABLE} (row_id, session, started_at, body) "
    "SELECT * FROM unnest($1::text[], $2::text[], $3::double precision[], $4::bytea[]) "
    "ON CONFLICT (row_id) DO NOTHING"
)
_ORDER = " ORDER BY session, started_at, row_id"
# Two openers creating the table at once (a restarted serve overlapping its predecessor's
# exit) are serialised, as the log's own layout is.
_LAYOUT_LOCK = 0x4C4C5052
_FAILURES = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)


class PostgresProvenance:
    """The store as a table in the log's database: one connection, one call at a time, opened
    again after it was lost (a server restart, a failover)."""

    def __init__(self, url: str, conn: asyncpg.Connection, *, read_only: bool) -> None:
        self._url = url
        self._conn = conn
        self._read_only = read_only
        self._lock = anyio.Lock()

    @property
    def location(self) -> str:
        return f"{describe(self._url)} (table {POSTGRES_TABLE})"

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str) -> AsyncIterator[PostgresProvenance]:
        """Open (creating the table) in the database at ``url``."""
        conn = await _connect(url, read_only=False)
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LAYOUT_LOCK)
                for statement in _LAYOUT:
                    await conn.execute(statement)
        except BaseException:
            await conn.close()
            raise
        store = cls(url, conn, read_only=False)
        try:
            yield store
        finally:
            await store._conn.close()

    @classmethod
    @asynccontextmanager
    async def read_only(cls, url: str) -> AsyncIterator[PostgresProvenance | None]:
        """Read the table in the database at ``url`` through a read-only session; None when
        the database has no such table (nothing was ever stored beside that log)."""
        conn = await _connect(url, read_only=True)
        try:
            present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", POSTGRES_TABLE)
            yield cls(url, conn, read_only=True) if present else None
        finally:
            await conn.close()

    async def _connection(self) -> asyncpg.Connection:
        if self._conn.is_closed():
            self._conn = await _connect(self._url, read_only=self._read_only)
        return self._conn

    async def add(self, rows: Sequence[StoredRow]) -> int:
        if not rows:
            return 0
        async with self._lock:
            try:
                conn = await self._connection()
                status: str = await conn.execute(
                    _INSERT,
                    [r.row_id for r in rows],
                    [r.session for r in rows],
                    [r.started_at for r in rows],
                    [r.body for r in rows],
                )
            except _FAILURES as exc:
                raise failed(exc, "storing provenance rows", self.location) from None
        return int(status.rsplit(" ", 1)[-1])  # "INSERT 0 <rows inserted>"

    async def read(self, sessions: Collection[str] | None = None) -> list[bytes]:
        async with self._lock:
            try:
                conn = await self._connection()
                if sessions is None:
                    found = await conn.fetch(f"SELECT body FROM {POSTGRES_TABLE}{_ORDER}")
                else:
                    found = await conn.fetch(
                        f"SELECT body FROM {POSTGRES_TABLE} WHERE session = ANY($1::text[])"
                        f"{_ORDER}",
                        sorted(set(sessions)),
                    )
            except _FAILURES as exc:
                raise failed(exc, "reading provenance rows", self.location) from None
        return [bytes(r[0]) for r in found]

    async def count(self) -> int:
        async with self._lock:
            try:
                conn = await self._connection()
                n = await conn.fetchval(f"SELECT count(*) FROM {POSTGRES_TABLE}")
            except _FAILURES as exc:
                raise failed(exc, "counting provenance rows", self.location) from None
        return int(n)


async def _connect(url: str, *, read_only: bool) -> asyncpg.Connection:
    check_address(url, describe(url))  # an unusable URL is the caller's mistake, said as such
    settings = {"application_name": "loraledger-provenance", "synchronous_commit": "on"}
    if read_only:
        settings["default_transaction_read_only"] = "on"
    try:
        return await asyncpg.connect(url, server_settings=settings, timeout=30.0)
    except _FAILURES as exc:
        raise failed(exc, "connecting", f"{describe(url)} (table {POSTGRES_TABLE})") from None
