"""The provenance store: every generation's row, kept by the ledger's process beside its log.

Every face (``serve``'s own OpenAI routes, ``loraledger gateway`` processes, Ray gateway
actors, the Python face over a remote ledger) sends its provenance rows to the ledger's
process, which keeps them here: one place, whichever process served a turn, so ``loraledger
audit LOG --session S`` finds every turn of S from the log's location alone.

Its location follows from the log's (docs/stores.md):

* a SQLite log ``PATH`` -> the SQLite file ``PATH.provenance.sqlite`` next to it. A file of its
  own, not a table in the log's file: a row written never waits for, nor delays, the log's
  write lock (group commit), and the log's layout and file checks stay exactly as they are;
* a PostgreSQL log -> the table ``loraledger_provenance`` in the same database (a server every
  node reaches, as the log is).

Rows are opaque here (``evlog`` knows no generation): a :class:`StoredRow` is a row id, the
session it belongs to and when it started (to read one session's rows in order), and its body
(the row's JSON, encoded and decoded by ``publisher/gateway/provenance.py``). The row id is
the primary key and a row already stored is skipped, so a batch sent again after a lost reply
(at least once, by design) is stored once. Each :meth:`add` is one durable transaction
(``synchronous=FULL`` / ``synchronous_commit = on``): a face drops the rows it sent only once
they are acknowledged, so the acknowledgement must mean "on disk".
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from contextlib import asynccontextmanager, closing

import anyio
import anyio.to_thread

from evlog.errors import StoreCode, StoreError
from evlog.locations import backend_of, describe
from evlog.provenance_rows import POSTGRES_TABLE, ProvenanceStore, StoredRow, failed

__all__ = [
    "ProvenanceStore",
    "SQLiteProvenance",
    "StoredRow",
    "open_provenance",
    "provenance_location",
]

SQLITE_SUFFIX = ".provenance.sqlite"
APPLICATION_ID = 0x4C4C5052  # "LLPR": marks a file as a loraledger provenance store
_CHUNK = 500  # sessions per IN (...) list: under SQLite's bound-parameter limit


def provenance_location(log: str | os.PathLike[str]) -> str:
    """Where the provenance of the log at ``log`` lives, for people: a file path, or the
    table's name in the (redacted) database URL."""
    backend, where = backend_of(log)
    if backend == "sqlite":
        return f"{where}{SQLITE_SUFFIX}"
    return f"{describe(where)} (table {POSTGRES_TABLE})"


@asynccontextmanager
async def open_provenance(log: str | os.PathLike[str]) -> AsyncIterator[ProvenanceStore]:
    """The writer's door (the ledger's process): the store beside the log at ``log``, created
    when absent, for the block."""
    backend, where = backend_of(log)
    if backend == "postgres":
        from evlog.provenance_postgres import PostgresProvenance

        async with PostgresProvenance.open(where) as pg:
            yield pg
        return
    async with SQLiteProvenance.open(f"{where}{SQLITE_SUFFIX}") as lite:
        yield lite


# --- SQLite ------------------------------------------------------------------------------------

_SQLITE_LAYOUT = (
    """CREATE TABLE IF NOT EXISTS provenance (
        row_id TEXT PRIMARY KEY,
        session TEXT NOT NULL,
        started_at REAL NOT NULL,
        body BLOB NOT NULL
    ) STRICT, WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS provenance_by_session ON provenance (session, started_at)",
)


class SQLiteProvenance:
    """The store as a SQLite file (WAL, ``synchronous=FULL``), one connection used from worker
    threads one call at a time."""

    def __init__(self, conn: sqlite3.Connection, location: str) -> None:
        self._conn = conn
        self._location = location
        self._lock = anyio.Lock()

    @property
    def location(self) -> str:
        return self._location

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str | os.PathLike[str]) -> AsyncIterator[SQLiteProvenance]:
        """Open (creating) the file at ``path``; another application's database is refused."""
        where = os.fspath(path)
        conn = await anyio.to_thread.run_sync(_open_sqlite, where)
        try:
            yield cls(conn, where)
        finally:
            await anyio.to_thread.run_sync(conn.close)

    @classmethod
    @asynccontextmanager
    async def read_only(cls, uri: str, label: str) -> AsyncIterator[SQLiteProvenance]:
        """Read the store at the SQLite ``uri`` (``mode=ro``: the tools' door, which writes
        nothing); ``label`` names it in messages."""
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            with closing(conn.execute("PRAGMA application_id")) as cursor:
                (app_id,) = cursor.fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(StoreCode.CORRUPT_STORE, f"{label}: cannot read: {exc}") from None
        try:
            if app_id != APPLICATION_ID:
                raise StoreError(
                    StoreCode.CORRUPT_STORE,
                    f"{label}: a SQLite database, but not a loraledger provenance store",
                )
            yield cls(conn, label)
        finally:
            conn.close()

    async def add(self, rows: Sequence[StoredRow]) -> int:
        if not rows:
            return 0
        async with self._lock:
            return await anyio.to_thread.run_sync(self._add, rows)

    def _add(self, rows: Sequence[StoredRow]) -> int:
        conn = self._conn
        before = conn.total_changes
        try:
            conn.execute("BEGIN IMMEDIATE")  # one transaction: every row lands, or none
            try:
                conn.executemany(
                    "INSERT OR IGNORE INTO provenance (row_id, session, started_at, body) "
                    "VALUES (?, ?, ?, ?)",
                    [(r.row_id, r.session, r.started_at, r.body) for r in rows],
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise failed(exc, "storing provenance rows", self._location) from None
        return conn.total_changes - before

    async def read(self, sessions: Collection[str] | None = None) -> list[bytes]:
        async with self._lock:
            return await anyio.to_thread.run_sync(self._read, sessions)

    def _read(self, sessions: Collection[str] | None) -> list[bytes]:
        order = " ORDER BY session, started_at, row_id"
        try:
            if sessions is None:
                with closing(self._conn.execute(f"SELECT body FROM provenance{order}")) as cur:
                    return [bytes(body) for (body,) in cur]
            found: list[tuple[str, float, str, bytes]] = []
            for chunk in _chunks(sorted(set(sessions))):
                marks = ", ".join("?" * len(chunk))
                query = (
                    "SELECT session, started_at, row_id, body FROM provenance "
                    f"WHERE session IN ({marks})"
                )
                with closing(self._conn.execute(query, chunk)) as cur:
                    found.extend((s, t, i, bytes(b)) for s, t, i, b in cur)
        except sqlite3.Error as exc:
            raise failed(exc, "reading provenance rows", self._location) from None
        found.sort(key=lambda r: r[:3])
        return [body for *_, body in found]

    async def count(self) -> int:
        async with self._lock:
            return await anyio.to_thread.run_sync(self._count)

    def _count(self) -> int:
        with closing(self._conn.execute("SELECT count(*) FROM provenance")) as cur:
            (n,) = cur.fetchone()
        return int(n)


def _open_sqlite(where: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(where, check_same_thread=False, isolation_level=None)
    except sqlite3.Error as exc:
        raise failed(exc, "opening the provenance store", where) from None
    try:
        (app_id,) = conn.execute("PRAGMA application_id").fetchone()
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        if tables and app_id != APPLICATION_ID:
            raise StoreError(
                StoreCode.CORRUPT_STORE,
                f"{where}: a SQLite database, but not a loraledger provenance store "
                f"(application id {app_id:#x}): move it away, or name another log",
            )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        for statement in _SQLITE_LAYOUT:
            conn.execute(statement)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise StoreError(StoreCode.CORRUPT_STORE, f"{where}: cannot open: {exc}") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]
