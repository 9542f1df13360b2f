"""``PostgresStore``: the ``EventStore`` contract on a PostgreSQL database, through asyncpg.

Why PostgreSQL beside SQLite: a SQLite log lives on one node's disk and dies with it; a
PostgreSQL log lives on a server (replicated, backed up, managed) that any node reaches, so
the ledger can be started on another node and resume the same log (docs/stores.md).

Layout (created in an empty database, checked in an existing one): ``loraledger_events`` with
``seq bigint PRIMARY KEY`` and ``event_id bytea UNIQUE`` (idempotency and positions live in
the database, so a duplicate is recognised forever and two writers can never both commit the
same seq), ``loraledger_snapshots`` keyed by ``(code_version, seq)``, and a one-row
``loraledger_layout`` that marks the database as a loraledger log and names its layout
version.

Durability: an append is answered only after its transaction's COMMIT returned, with
``synchronous_commit = on`` set on the writer's session (PostgreSQL's default; set explicitly
so a server configured otherwise cannot weaken it): the commit's WAL is flushed to the
server's disk (and to the synchronous standbys, if the server names any) before the answer.
A server running with ``fsync = off`` cannot keep that promise; nothing a client sets can.

The write path is the one :class:`~evlog.chained_store.ChainedStore` holds for both durable
stores (group commit through :mod:`evlog.group_commit`: every call queued while a group is
written becomes ONE transaction of the next); this module supplies its SQL. The common
group is one statement (an INSERT over ``unnest`` of one array per column) in autocommit mode:
one round trip, atomic and durable when it returns. Positions and the hash chain are computed
from the cached tail; the seq primary key and the event_id unique index turn every wrong
assumption (a duplicate id, another writer having moved the tail) into a unique violation that
leaves nothing written, after which the group is re-planned on the slow path: inside a
transaction that first takes ``EXCLUSIVE`` on the events table (other writers wait, readers do
not), reads the tail and looks the ids up.

A second writer on the same log is therefore detected and handled correctly, only slowly,
exactly as with SQLite; the ledger above fences a stale one by ``expected_seq``
(``SEQ_CONFLICT`` from here becomes ``FENCED`` there, after the newer ledger's
``ControllerStarted``). No lock is held for the store's life on purpose: a writer whose node
vanished keeps its session (and any session lock) until TCP notices, minutes later, and the
successor must not wait for that to resume the log.

Reads run on a small pool of their own connections, so followers and replays never queue
behind the writer. ``follow`` wakes on this store's commits (as SQLite's does); records
another process appends are read when this store next commits or a follower re-reads.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any
from urllib.parse import urlsplit

import anyio
import asyncpg
from asyncpg.transaction import Transaction

from evlog.chained_store import ChainedStore, verified_tail
from evlog.errors import INVALID_INPUT, StoreCode, StoreError
from evlog.locations import backend_of, describe
from evlog.record import GENESIS_HASH, Row
from evlog.store import SNAPSHOTS_KEPT, Snapshot

APPLICATION = "loraledger"
LAYOUT_VERSION = 1

_COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"
_LAYOUT = (
    """CREATE TABLE loraledger_layout (
        application text NOT NULL,
        layout integer NOT NULL
    )""",
    """CREATE TABLE loraledger_events (
        seq bigint PRIMARY KEY,
        event_id bytea NOT NULL UNIQUE,
        stream text NOT NULL,
        type text NOT NULL,
        schema integer NOT NULL,
        recorded_at double precision NOT NULL,
        payload bytea NOT NULL,
        prev_hash bytea NOT NULL,
        hash bytea NOT NULL
    )""",
    """CREATE TABLE loraledger_snapshots (
        code_version text NOT NULL,
        seq bigint NOT NULL,
        state bytea NOT NULL,
        PRIMARY KEY (code_version, seq)
    )""",
)
_TABLES = ("loraledger_layout", "loraledger_events", "loraledger_snapshots")
# Serialises creating the layout between two stores opening an empty database at once.
_LAYOUT_LOCK = 0x4C4C4752
_INSERT_GROUP = (
    f"INSERT INTO loraledger_events ({_COLUMNS}) SELECT * FROM unnest("
    "$1::bigint[], $2::bytea[], $3::text[], $4::text[], $5::integer[], "
    "$6::double precision[], $7::bytea[], $8::bytea[], $9::bytea[])"
)
_RANGE = (
    f"SELECT {_COLUMNS} FROM loraledger_events WHERE seq > $1 AND seq <= $2 ORDER BY seq LIMIT $3"
)
# From the predecessor on (``seq >= after``): its hash anchors the first record's link.
_RANGE_FROM = (
    f"SELECT {_COLUMNS} FROM loraledger_events WHERE seq >= $1 AND seq <= $2 ORDER BY seq LIMIT $3"
)
_TAIL2 = f"SELECT {_COLUMNS} FROM loraledger_events ORDER BY seq DESC LIMIT 2"
_TAIL = "SELECT seq, hash FROM loraledger_events ORDER BY seq DESC LIMIT 1"
_LOOKUP = "SELECT event_id, seq FROM loraledger_events WHERE event_id = ANY($1::bytea[])"
_SAVE_SNAPSHOT = (
    "INSERT INTO loraledger_snapshots (code_version, seq, state) VALUES ($1, $2, $3) "
    "ON CONFLICT (code_version, seq) DO UPDATE SET state = EXCLUDED.state"
)
_PRUNE_SNAPSHOTS = (
    "DELETE FROM loraledger_snapshots WHERE code_version = $1 AND seq NOT IN "
    "(SELECT seq FROM loraledger_snapshots WHERE code_version = $1 ORDER BY seq DESC LIMIT $2)"
)
_LOAD_SNAPSHOT = (
    "SELECT code_version, seq, state FROM loraledger_snapshots WHERE code_version = $1 "
    "ORDER BY seq DESC LIMIT 1"
)

_READERS = 4  # pooled read connections
_SESSION = {"synchronous_commit": "on", "application_name": "loraledger"}
# The read pool runs only the range reads below (``seq > a ORDER BY seq LIMIT n``). Without
# fresh statistics (a log that just grew) or under a generic plan, PostgreSQL estimates such a
# range at a few rows and scans the whole tail then sorts it, per chunk: a replay becomes
# quadratic (the benchmark's 200k-event replay: 17,000 events/s that way, 127,000 with these).
# Only the primary key's index scan yields seq order directly; these make it the plan.
_READ_PLANS = {"enable_bitmapscan": "off", "enable_seqscan": "off", "enable_sort": "off"}
_CONNECT_TIMEOUT_S = 30.0
# How long a close waits for the server to end a session before dropping the connection: a
# server that stopped answering (hung, or cut off by a partition that drops packets) would
# otherwise hold the close until TCP gives up, minutes later; asyncpg's own close has no bound.
_CLOSE_TIMEOUT_S = 5.0


def redact(url: str) -> str:
    """``url`` without its password, for logs, messages and ``describe`` replies."""
    return describe(url)


def _columns(rows: list[Row]) -> list[list[Any]]:
    return [list(column) for column in zip(*rows, strict=True)]


def _store_error(exc: BaseException, doing: str) -> StoreError:
    return StoreError(StoreCode.STORE_FAILED, f"{doing}: {exc}", cause=type(exc).__name__)


_FAILURES = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, asyncio.TimeoutError)


class PostgresStore(ChainedStore):
    """An ``EventStore`` on a PostgreSQL database (see the module docstring).

    Open with ``async with PostgresStore.open(url) as store`` (or ``await
    PostgresStore.connect(url)`` and ``await store.close()``), ``url`` a libpq-style
    ``postgresql://user[:password]@host[:port]/database[?options]``. Opening creates the layout
    in a database without one, checks it otherwise (a database holding other tables named
    like ours, or a newer layout, is refused: ``CORRUPT_STORE``/``UNKNOWN_SCHEMA``) and
    verifies the tail record's hash and link (``CORRUPT_RECORD``/``CHAIN_BROKEN``).
    """

    def __init__(
        self,
        url: str,
        writer: asyncpg.Connection,
        readers: asyncpg.Pool,
        last_seq: int,
        head_hash: bytes,
    ) -> None:
        # Use connect()/open(): the constructor only assembles already-checked parts.
        super().__init__(last_seq, head_hash)
        self._url = url
        self._writer = writer
        self._readers = readers

    # --- opening and closing ---------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, *, read_only: bool = False) -> PostgresStore:
        """Open the log in the database ``url`` names; see the class docstring.

        ``read_only`` (the forensic tools: replay, audit, verify): every session is read-only
        (``default_transaction_read_only``, so the server itself refuses a write), no layout is
        created (a database without one is refused: ``CORRUPT_STORE``), appends are refused
        with ``INVALID_INPUT``.
        """
        if backend_of(url)[0] != "postgres":
            raise StoreError(INVALID_INPUT, f"not a postgresql:// URL: {redact(url)}")
        where = redact(url)
        _check_address(url, where)
        session = {**_SESSION, "default_transaction_read_only": "on"} if read_only else _SESSION
        writer: asyncpg.Connection | None = None
        readers: asyncpg.Pool | None = None
        try:
            writer = await _connect(url, session)
            await _prepare(writer, where, create=not read_only)
            last_seq, head_hash = await _check_tail(writer)
            readers = await asyncpg.create_pool(
                url,
                min_size=1,
                max_size=_READERS,
                server_settings={**session, **_READ_PLANS},
                timeout=_CONNECT_TIMEOUT_S,
            )
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                if writer is not None:
                    with suppress(Exception):
                        await writer.close(timeout=_CLOSE_TIMEOUT_S)
            if isinstance(exc, _FAILURES):
                raise _store_error(exc, f"cannot open {where}") from exc
            raise
        store = cls(url, writer, readers, last_seq, head_hash)
        store._read_only = read_only
        return store

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str) -> AsyncIterator[PostgresStore]:
        store = await cls.connect(url)
        try:
            yield store
        finally:
            await store.close()

    async def _close_connections(self) -> None:
        # Each close is bounded: at the deadline asyncpg drops the connections it was closing
        # (the writer's, or the whole pool: ``Pool.close`` terminates when interrupted) and the
        # TimeoutError is swallowed like any other failed close.
        with suppress(Exception):
            await self._writer.close(timeout=_CLOSE_TIMEOUT_S)
        with suppress(Exception):
            await asyncio.wait_for(self._readers.close(), _CLOSE_TIMEOUT_S)

    # --- state -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The database's URL without its password."""
        return redact(self._url)

    @property
    def name(self) -> str:
        return self.url

    # --- writes: the SQL of ChainedStore's write path ----------------------------------------

    CONSTRAINT_REFUSED = asyncpg.UniqueViolationError
    ONE_STATEMENT_ROWS = sys.maxsize  # one array per column: any group is one statement
    _error = staticmethod(_store_error)

    async def _renew_writer(self) -> None:
        if self._writer.is_closed():  # the server went away and came back, or a failover
            self._writer = await _connect(self._url)
            self._suspect = True

    async def _insert_committed(self, rows: list[Row]) -> None:
        await self._insert(rows)

    def _transaction(self) -> Transaction:
        return self._writer.transaction()

    async def _insert(self, rows: list[Row]) -> None:
        await self._writer.execute(_INSERT_GROUP, *_columns(rows))

    async def _read_tail(self) -> tuple[int, bytes]:
        # Writers wait for each other from here to the end of the transaction; readers
        # (ACCESS SHARE) never do.
        await self._writer.execute("LOCK TABLE loraledger_events IN EXCLUSIVE MODE")
        tail = await self._writer.fetchrow(_TAIL)
        return (tail[0], tail[1]) if tail else (0, GENESIS_HASH)

    async def _stored_seqs(self, event_ids: list[bytes]) -> dict[bytes, int]:
        found = await self._writer.fetch(_LOOKUP, event_ids) if event_ids else []
        return {eid: seq for eid, seq in found}

    async def _save_snapshots(self, snapshots: list[Snapshot]) -> None:
        w = self._writer
        await w.executemany(_SAVE_SNAPSHOT, [(s.code_version, s.seq, s.state) for s in snapshots])
        await w.executemany(_PRUNE_SNAPSHOTS, {(s.code_version, SNAPSHOTS_KEPT) for s in snapshots})

    # --- reads -----------------------------------------------------------------------------

    async def load_snapshot(self, code_version: str) -> Snapshot | None:
        self._check_open()
        try:
            row = await self._readers.fetchrow(_LOAD_SNAPSHOT, code_version)
        except _FAILURES as exc:
            raise self._read_error(exc, "cannot read snapshots") from exc
        if row is None:
            return None
        return Snapshot(code_version=row[0], seq=row[1], state=row[2])

    async def _fetch(
        self, after: int, upto: int, limit: int | None, *, with_predecessor: bool = False
    ) -> list[Row]:
        if with_predecessor:
            sql, limit = _RANGE_FROM, None if limit is None else limit + 1
        else:
            sql = _RANGE
        try:
            rows = await self._readers.fetch(sql, after, upto, limit)
        except _FAILURES as exc:
            raise self._read_error(exc, f"cannot read records after {after}") from exc
        return [tuple(r) for r in rows]

    def _read_error(self, exc: BaseException, doing: str) -> StoreError:
        if self._closed:  # the pool closed under the call
            return StoreError(StoreCode.STORE_CLOSED, "the store is closed")
        return _store_error(exc, doing)


def _check_address(url: str, where: str) -> None:
    """A host and port that cannot be parsed are the caller's mistake (``INVALID_INPUT``),
    found before any connection: asyncpg raises them as a bare ``ValueError`` or
    ``OverflowError`` ("port must be 0-65535") from inside its connect."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise StoreError(
            INVALID_INPUT, f"{where}: not a usable postgresql:// URL ({exc})"
        ) from None
    if port == 0:
        raise StoreError(INVALID_INPUT, f"{where}: port 0 is not a TCP port to connect to")


async def _connect(url: str, session: dict[str, str] = _SESSION) -> asyncpg.Connection:
    return await asyncpg.connect(url, server_settings=session, timeout=_CONNECT_TIMEOUT_S)


async def _prepare(w: asyncpg.Connection, where: str, *, create: bool) -> None:
    """The layout: created in a database without any of our tables (unless ``create`` is
    False: then such a database is refused), checked otherwise."""
    async with w.transaction():
        if create:
            await w.execute("SELECT pg_advisory_xact_lock($1)", _LAYOUT_LOCK)
        present = {
            r[0]
            for r in await w.fetch(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_name = ANY($1::text[])",
                list(_TABLES),
            )
        }
        if not present and not create:
            raise StoreError(
                StoreCode.CORRUPT_STORE, f"{where} holds no loraledger log (no tables)", empty=True
            )
        if not present:
            for statement in _LAYOUT:
                await w.execute(statement)
            await w.execute(
                "INSERT INTO loraledger_layout (application, layout) VALUES ($1, $2)",
                APPLICATION,
                LAYOUT_VERSION,
            )
            return
        marks = (
            await w.fetch("SELECT application, layout FROM loraledger_layout")
            if "loraledger_layout" in present
            else []
        )
        if len(present) != len(_TABLES) or len(marks) != 1 or marks[0][0] != APPLICATION:
            raise StoreError(
                StoreCode.CORRUPT_STORE,
                f"{where} holds tables named like a loraledger log's but is not one "
                f"(found {sorted(present)})",
            )
        if marks[0][1] != LAYOUT_VERSION:
            raise StoreError(
                StoreCode.UNKNOWN_SCHEMA,
                f"{where} has store layout {marks[0][1]}; this code reads layout {LAYOUT_VERSION}",
            )


async def _check_tail(w: asyncpg.Connection) -> tuple[int, bytes]:
    """The newest record's seq and hash, verified (:func:`~evlog.chained_store.verified_tail`)."""
    return verified_tail([tuple(r) for r in await w.fetch(_TAIL2)])
