"""``SQLiteStore``: the ``EventStore`` contract on one SQLite file (WAL), through aiosqlite.

Layout: one STRICT table of records, ``seq INTEGER PRIMARY KEY`` (the rowid: positions are
allocated inside the write transaction, so a reader can never see seq n+1 before n) and
``event_id BLOB UNIQUE`` (idempotency lives in the file, so a duplicate is recognised forever,
across restarts). Snapshots live beside the log, keyed by ``(code_version, seq)``.

Writes go through ONE writer connection and are group-committed by *combining*, without a
background task (:mod:`evlog.group_commit`: the first caller leads and writes every queued
call as one transaction; the others are answered after its COMMIT). So concurrent appenders
share fsyncs (the only way to be fast with ``synchronous=FULL``) and nothing outlives the
callers.

The write path (fast path, slow path, planning, snapshot checks, failure rules) is
:class:`~evlog.chained_store.ChainedStore`'s, shared with PostgreSQL; this module supplies its
SQL. A group costs ONE aiosqlite thread hop on the fast path (a hop is ~24 us on an idle 2-core
VM, several times that under load): the whole group is one multi-row INSERT run in autocommit
mode, which SQLite executes as its own atomic, durable transaction. A wrong assumption of the
fast path (a duplicate id, another writer having moved the tail) is an IntegrityError that
leaves nothing written; the slow path then re-plans inside an explicit ``BEGIN IMMEDIATE``
transaction, which holds the file's write lock from its start.

Why one module of ~500 lines: the connections, the file checks at open and the SQL share one
discipline (who may touch the writer connection, which settings each connection keeps); split
across files, those invariants would have no single place to be read.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, closing, suppress
from itertools import chain
from typing import Literal

import aiosqlite
import anyio
import anyio.to_thread

from evlog.chained_store import ChainedStore, verified_tail
from evlog.errors import INVALID_INPUT, StoreCode, StoreError
from evlog.record import GENESIS_HASH, Row
from evlog.store import SNAPSHOTS_KEPT, Snapshot

Synchronous = Literal["FULL", "NORMAL"]

APPLICATION_ID = 0x4C4C4752  # "LLGR": marks a file as a loraledger log
LAYOUT_VERSION = 1  # PRAGMA user_version: the table layout below

_COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"
_LAYOUT = (
    """CREATE TABLE events (
        seq INTEGER PRIMARY KEY,
        event_id BLOB NOT NULL UNIQUE,
        stream TEXT NOT NULL,
        type TEXT NOT NULL,
        schema INTEGER NOT NULL,
        recorded_at REAL NOT NULL,
        payload BLOB NOT NULL,
        prev_hash BLOB NOT NULL,
        hash BLOB NOT NULL
    ) STRICT""",
    """CREATE TABLE snapshots (
        code_version TEXT NOT NULL,
        seq INTEGER NOT NULL,
        state BLOB NOT NULL,
        PRIMARY KEY (code_version, seq)
    ) STRICT, WITHOUT ROWID""",
    f"PRAGMA application_id = {APPLICATION_ID}",
    f"PRAGMA user_version = {LAYOUT_VERSION}",
)
_INSERT = f"INSERT INTO events ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
# One statement inserting a whole group. Its size is rounded up to a power of two and padded
# with all-NULL rows that the WHERE drops: preparing a multi-row INSERT costs ~6 us per row, so
# the sizes must stay few enough to remain in the statement cache (11 texts), and padding
# costs only the binding of NULLs.
_ONE_STATEMENT_ROWS = 1024
_ONE_STATEMENT = {
    size: (
        f"INSERT INTO events ({_COLUMNS}) SELECT * FROM (VALUES "
        + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * size)
        + ") WHERE column1 IS NOT NULL"
    )
    for size in (2**k for k in range(11))
}
_PAD_ROW = (None,) * 9
_RANGE = f"SELECT {_COLUMNS} FROM events WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?"
# From the predecessor on (``seq >= after``): its hash anchors the first record's link.
_RANGE_FROM = f"SELECT {_COLUMNS} FROM events WHERE seq >= ? AND seq <= ? ORDER BY seq LIMIT ?"
_TAIL2 = f"SELECT {_COLUMNS} FROM events ORDER BY seq DESC LIMIT 2"
_TAIL = "SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1"
_SAVE_SNAPSHOT = "INSERT OR REPLACE INTO snapshots (code_version, seq, state) VALUES (?, ?, ?)"
_PRUNE_SNAPSHOTS = (
    "DELETE FROM snapshots WHERE code_version = ?1 AND seq NOT IN "
    "(SELECT seq FROM snapshots WHERE code_version = ?1 ORDER BY seq DESC LIMIT ?2)"
)
_LOAD_SNAPSHOT = (
    "SELECT code_version, seq, state FROM snapshots WHERE code_version = ? "
    "ORDER BY seq DESC LIMIT 1"
)

_ID_LOOKUP = 500  # ids per ``IN (...)`` on the slow path
_CORRUPTION = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


def _one_statement(rows: list[Row]) -> tuple[str, list[object]]:
    size = 1 << (len(rows) - 1).bit_length()
    params: list[object] = list(chain.from_iterable(rows))
    if size > len(rows):
        params.extend(_PAD_ROW * (size - len(rows)))
    return _ONE_STATEMENT[size], params


def _store_error(exc: BaseException, doing: str) -> StoreError:
    code = (
        StoreCode.CORRUPT_STORE
        if isinstance(exc, sqlite3.DatabaseError)
        and getattr(exc, "sqlite_errorcode", None) in _CORRUPTION
        else StoreCode.STORE_FAILED
    )
    return StoreError(code, f"{doing}: {exc}", cause=type(exc).__name__)


class SQLiteStore(ChainedStore):
    """An ``EventStore`` on one SQLite file.

    ``synchronous="FULL"`` (default) fsyncs the WAL at every commit: an acknowledged append
    survives process crashes, OS crashes and power loss (given storage that honours flushes).
    ``synchronous="NORMAL"`` syncs only at checkpoints: an acknowledged append survives a
    process crash (kill -9), but the last commits may roll back after an OS crash or power
    loss; the file stays consistent either way. Choose NORMAL only where the callers can
    replay what they were told was recorded.

    Open with ``async with SQLiteStore.open(path) as store`` (or ``await SQLiteStore.connect``
    and ``await store.close()``). Opening runs ``PRAGMA quick_check`` and verifies the tail
    record's hash and link; a file that is not a loraledger database or fails those checks is
    refused with a ``StoreError`` (``CORRUPT_STORE``, ``CORRUPT_RECORD`` or ``CHAIN_BROKEN``).
    One process should write a file at a time; a second writer is detected (the explicit seq
    collides) and handled correctly, only slowly.
    """

    def __init__(
        self,
        path: str,
        writer: aiosqlite.Connection,
        reader: aiosqlite.Connection,
        last_seq: int,
        head_hash: bytes,
        synchronous: Synchronous,
    ) -> None:
        # Use connect()/open(): the constructor only assembles already-checked parts.
        super().__init__(last_seq, head_hash)
        self._path = path
        self._writer = writer
        self._reader = reader
        self._synchronous = synchronous

    # --- opening and closing ---------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: Synchronous = "FULL",
        quick_check: bool = True,
    ) -> SQLiteStore:
        """Open (creating if absent) the log at ``path``; see the class docstring.

        ``quick_check=False`` skips ``PRAGMA quick_check``, which reads every page (about
        0.4 s per million events here): for restarting a large log from a snapshot quickly
        when the file is known good. The tail record is verified either way.
        """
        path = os.fspath(path)
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(
                INVALID_INPUT, f"synchronous must be FULL or NORMAL, got {synchronous!r}"
            )
        if path in ("", ":memory:") or path.startswith("file:"):
            raise StoreError(
                INVALID_INPUT, "SQLiteStore needs a file path (a reader shares the file)"
            )
        try:
            # A plain open first: an aiosqlite connection that fails to open leaves its thread
            # to report into a loop that may be gone; this surfaces the same error cleanly.
            await anyio.to_thread.run_sync(_probe, path)
        except sqlite3.Error as exc:
            raise _store_error(exc, f"cannot open {path}") from exc
        opened: list[aiosqlite.Connection] = []
        try:
            writer = await aiosqlite.connect(path, isolation_level=None)
            opened.append(writer)
            await _prepare_writer(writer, path, synchronous, quick_check)
            last_seq, head_hash = await _check_tail(writer)
            reader = await aiosqlite.connect(path, isolation_level=None)
            opened.append(reader)
            for pragma in ("query_only = ON", "busy_timeout = 5000", "mmap_size = 268435456"):
                await reader.execute(f"PRAGMA {pragma}")
        except BaseException as exc:
            await _close_quietly(opened)
            if isinstance(exc, sqlite3.Error):
                raise _store_error(exc, f"cannot open {path}") from exc
            raise
        return cls(path, writer, reader, last_seq, head_hash, synchronous)

    @classmethod
    async def connect_read_only(
        cls, uri: str, *, label: str | None = None, quick_check: bool = True
    ) -> SQLiteStore:
        """Open an existing log through a read-only SQLite URI, for the forensic tools.

        ``uri`` must be a ``file:`` URI with ``mode=ro`` (``tools/logfile.py`` chooses it, and
        ``immutable=1`` where that is safe): no journal-mode switch, no layout, no write of any
        kind, and SQLite refuses one if a bug tried. The same checks as :meth:`connect`
        (integrity, layout, tail record) refuse a damaged file. ``label`` names the file in
        messages (the URI may point at a private copy). Appends raise ``INVALID_INPUT``.
        """
        if not uri.startswith("file:") or "mode=ro" not in uri:
            raise StoreError(
                INVALID_INPUT, f"a read-only open needs a file: URI with mode=ro: {uri}"
            )
        where = label or uri
        try:
            await anyio.to_thread.run_sync(_probe_uri, uri)
        except sqlite3.Error as exc:
            raise _store_error(exc, f"cannot open {where}") from exc
        opened: list[aiosqlite.Connection] = []
        try:
            conn = await aiosqlite.connect(uri, uri=True, isolation_level=None)
            opened.append(conn)
            await conn.execute("PRAGMA query_only = ON")
            await _check_readable(conn, where, quick_check)
            last_seq, head_hash = await _check_tail(conn)
        except BaseException as exc:
            await _close_quietly(opened)
            if isinstance(exc, sqlite3.Error):
                raise _store_error(exc, f"cannot open {where}") from exc
            raise
        store = cls(where, conn, conn, last_seq, head_hash, "FULL")
        store._read_only = True
        return store

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: Synchronous = "FULL",
        quick_check: bool = True,
    ) -> AsyncIterator[SQLiteStore]:
        store = await cls.connect(path, synchronous=synchronous, quick_check=quick_check)
        try:
            yield store
        finally:
            await store.close()

    async def _close_connections(self) -> None:
        await _close_quietly([self._writer, self._reader])

    # --- state -----------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def name(self) -> str:
        return self._path

    @property
    def synchronous(self) -> Synchronous:
        return self._synchronous

    # --- writes: the SQL of ChainedStore's write path ----------------------------------------

    CONSTRAINT_REFUSED = sqlite3.IntegrityError
    ONE_STATEMENT_ROWS = _ONE_STATEMENT_ROWS
    _error = staticmethod(_store_error)

    async def _insert_committed(self, rows: list[Row]) -> None:
        # SQLite runs a statement outside a transaction as its own write transaction (the
        # INSERT takes the write lock as it starts, like BEGIN IMMEDIATE): one thread hop.
        await self._writer.execute(*_one_statement(rows))

    def _transaction(self) -> _Transaction:
        return _Transaction(self._writer)

    async def _insert(self, rows: list[Row]) -> None:
        await self._writer.executemany(_INSERT, rows)

    async def _read_tail(self) -> tuple[int, bytes]:
        # The transaction began IMMEDIATE: it holds the file's write lock already.
        tail = list(await self._writer.execute_fetchall(_TAIL))
        return (tail[0][0], tail[0][1]) if tail else (0, GENESIS_HASH)

    async def _stored_seqs(self, event_ids: list[bytes]) -> dict[bytes, int]:
        stored: dict[bytes, int] = {}
        for i in range(0, len(event_ids), _ID_LOOKUP):
            chunk = event_ids[i : i + _ID_LOOKUP]
            marks = ", ".join("?" * len(chunk))
            found = await self._writer.execute_fetchall(
                f"SELECT event_id, seq FROM events WHERE event_id IN ({marks})", chunk
            )
            stored.update((eid, seq) for eid, seq in found)
        return stored

    async def _save_snapshots(self, snapshots: list[Snapshot]) -> None:
        await self._writer.executemany(
            _SAVE_SNAPSHOT, [(s.code_version, s.seq, s.state) for s in snapshots]
        )
        versions = {(s.code_version, SNAPSHOTS_KEPT) for s in snapshots}
        await self._writer.executemany(_PRUNE_SNAPSHOTS, versions)

    async def _abandon_write(self) -> None:
        await _roll_back_quietly(self._writer)

    # --- reads -----------------------------------------------------------------------------

    async def load_snapshot(self, code_version: str) -> Snapshot | None:
        self._check_open()
        try:
            rows = list(await self._reader.execute_fetchall(_LOAD_SNAPSHOT, (code_version,)))
        except sqlite3.Error as exc:
            raise _store_error(exc, "cannot read snapshots") from exc
        if not rows:
            return None
        version, seq, state = rows[0]
        return Snapshot(code_version=version, seq=seq, state=state)

    async def _fetch(
        self, after: int, upto: int, limit: int | None, *, with_predecessor: bool = False
    ) -> list[Row]:
        if with_predecessor:
            sql, limit = _RANGE_FROM, None if limit is None else limit + 1
        else:
            sql = _RANGE
        try:
            return await _fetch_rows(
                self._reader, sql, (after, upto, -1 if limit is None else limit)
            )
        except sqlite3.Error as exc:
            raise _store_error(exc, f"cannot read records after {after}") from exc
        except ValueError as exc:  # aiosqlite: the connection closed under the call
            raise StoreError(StoreCode.STORE_CLOSED, "the store is closed") from exc


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` on the writer connection. IMMEDIATE takes the file's
    write lock at once, so every other writer waits from the first statement on (the slow
    path's reads stay true while it writes). A block that fails is rolled back here; a COMMIT
    that fails, by the store's ``_abandon_write``, which every failed group runs next."""

    __slots__ = ("_w",)

    def __init__(self, w: aiosqlite.Connection) -> None:
        self._w = w

    async def __aenter__(self) -> None:
        await self._w.execute("BEGIN IMMEDIATE")

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self._w.execute("COMMIT")
        else:
            await _roll_back_quietly(self._w)


_TEXT_COLUMNS = "CAST(stream AS BLOB), CAST(type AS BLOB)"
_NOT_UTF8 = "Could not decode to UTF-8"


async def _fetch_rows(conn: aiosqlite.Connection, sql: str, params: Sequence[object]) -> list[Row]:
    """Rows of ``sql`` (which selects ``_COLUMNS``). Text that is not UTF-8 (never written by
    the ledger: its strings are Python's) makes sqlite3 fail the whole query without naming
    the row; the query is then run again with those columns as blobs, a text that decodes
    comes back as ``str`` and one that does not stays ``bytes``, for :func:`open_row` to
    refuse as ``CORRUPT_RECORD`` naming its seq, in chain order."""
    try:
        return list(await conn.execute_fetchall(sql, params))  # type: ignore[arg-type]
    except sqlite3.OperationalError as exc:
        if _NOT_UTF8 not in str(exc):
            raise
    lenient = sql.replace("stream, type", _TEXT_COLUMNS, 1)
    rows: list[Row] = []
    for row in await conn.execute_fetchall(lenient, params):
        fixed = list(row)
        for i in (2, 3):
            with suppress(UnicodeDecodeError):
                fixed[i] = fixed[i].decode() if isinstance(fixed[i], bytes) else fixed[i]
        rows.append(tuple(fixed))
    return rows


def _probe(path: str) -> None:
    sqlite3.connect(path).close()


def _probe_uri(uri: str) -> None:
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()


async def _check_readable(conn: aiosqlite.Connection, where: str, quick_check: bool) -> None:
    """The read-only twin of :func:`_prepare_writer`'s checks: integrity, then the layout."""
    if quick_check:
        problems = [str(r[0]) for r in await conn.execute_fetchall("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise StoreError(
                StoreCode.CORRUPT_STORE,
                f"{where} fails its integrity check: {'; '.join(problems[:5])}",
                problems=problems[:20],
            )
    (app_id,) = next(iter(await conn.execute_fetchall("PRAGMA application_id")))
    (layout,) = next(iter(await conn.execute_fetchall("PRAGMA user_version")))
    if app_id != APPLICATION_ID:
        raise StoreError(
            StoreCode.CORRUPT_STORE, f"{where} is a SQLite database but not a loraledger log"
        )
    if layout != LAYOUT_VERSION:
        raise StoreError(
            StoreCode.UNKNOWN_SCHEMA,
            f"{where} has store layout {layout}; this code reads layout {LAYOUT_VERSION}",
        )


async def _prepare_writer(
    w: aiosqlite.Connection, path: str, synchronous: Synchronous, quick_check: bool
) -> None:
    """Settings, then the layout: created on an empty file, checked on an existing one.
    Another application's database is refused before anything is set: switching it to WAL
    would rewrite its header and leave ``-wal`` and ``-shm`` files beside it. The same checks
    run again inside the transaction that creates the layout, for a file another process
    changed in between."""
    await w.execute("PRAGMA busy_timeout = 5000")
    (app_id,) = next(iter(await w.execute_fetchall("PRAGMA application_id")))
    if app_id not in (0, APPLICATION_ID) or (
        app_id == 0 and await w.execute_fetchall("SELECT 1 FROM sqlite_master")
    ):  # marked as another application's, or holding someone's tables: not ours to touch
        raise StoreError(
            StoreCode.CORRUPT_STORE,
            f"{path} is a SQLite database but not a loraledger log (left untouched)",
        )
    mode = list(await w.execute_fetchall("PRAGMA journal_mode = WAL"))
    if not mode or str(mode[0][0]).lower() != "wal":
        raise StoreError(StoreCode.STORE_FAILED, f"{path}: cannot use WAL journal mode ({mode})")
    await w.execute(f"PRAGMA synchronous = {synchronous}")
    await w.execute("PRAGMA journal_size_limit = 67108864")
    problems = (
        [str(r[0]) for r in await w.execute_fetchall("PRAGMA quick_check")]
        if quick_check
        else ["ok"]
    )
    if problems != ["ok"]:
        raise StoreError(
            StoreCode.CORRUPT_STORE,
            f"{path} fails its integrity check: {'; '.join(problems[:5])}",
            problems=problems[:20],
        )
    await w.execute("BEGIN IMMEDIATE")
    try:
        (app_id,) = next(iter(await w.execute_fetchall("PRAGMA application_id")))
        (layout,) = next(iter(await w.execute_fetchall("PRAGMA user_version")))
        tables = list(await w.execute_fetchall("SELECT name FROM sqlite_master"))
        if app_id == 0 and not tables:
            for statement in _LAYOUT:
                await w.execute(statement)
        elif app_id != APPLICATION_ID:
            raise StoreError(
                StoreCode.CORRUPT_STORE, f"{path} is a SQLite database but not a loraledger log"
            )
        elif layout != LAYOUT_VERSION:
            raise StoreError(
                StoreCode.UNKNOWN_SCHEMA,
                f"{path} has store layout {layout}; this code reads layout {LAYOUT_VERSION}",
            )
        await w.execute("COMMIT")
    except BaseException:
        await _roll_back_quietly(w)
        raise


async def _close_quietly(conns: Sequence[aiosqlite.Connection]) -> None:
    """Close every connection of ``conns``, on a path that is already failing or closing.

    Shielded: a close interrupted by a cancellation would leave the remaining connections'
    threads running (and the file open) for the life of the process. Quiet: a close that
    fails must neither hide the error being reported nor stop the next connection's close.
    """
    with anyio.CancelScope(shield=True):
        for conn in conns:
            with suppress(Exception):
                await conn.close()


async def _roll_back_quietly(w: aiosqlite.Connection) -> None:
    """End the writer's open transaction, if any, after a failed write or layout check.

    Without it the next group would run inside the failed one's transaction. Quiet: the
    write's own error is the one to report (a rollback that fails too leaves the store
    ``_suspect``, so the next group re-reads the tail). Not shielded: a group is written under
    the group-commit leader's shield, and an open that fails closes the connection next, which
    rolls back as well.
    """
    if w.in_transaction:
        with suppress(Exception):
            await w.rollback()


async def _check_tail(w: aiosqlite.Connection) -> tuple[int, bytes]:
    """The newest record's seq and hash, verified (:func:`~evlog.chained_store.verified_tail`)."""
    return verified_tail(await _fetch_rows(w, _TAIL2, ()))
