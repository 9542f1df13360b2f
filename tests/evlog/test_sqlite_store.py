"""The store contract on ``SQLiteStore`` (real files, raw sqlite3 for tampering), plus what only
a file-backed, group-committing store has: refusing bad files, merged transactions, a second
writer, cancellation inside the group commit, closing while appends are queued."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.group_commit import WriteStats
from evlog.record import Row
from evlog.sqlite import SQLiteStore, _store_error
from evlog.store import EventStore, Snapshot
from tests.evlog.contract import StoreContract, batch_of, bound, raises_code, rehashed

_COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"


def _raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


class TestSQLiteStore(StoreContract):
    synchronous = "FULL"

    @pytest.fixture
    def location(self, tmp_path: Path) -> Path:
        return tmp_path / "log.db"

    def opened(self, location: Path) -> AbstractAsyncContextManager[EventStore]:
        return SQLiteStore.open(location, synchronous=self.synchronous)  # type: ignore[arg-type]

    def raw_row(self, location: Path, seq: int) -> Row:
        conn = _raw(location)
        try:
            row: Row = conn.execute(
                f"SELECT {_COLUMNS} FROM events WHERE seq = ?", (seq,)
            ).fetchone()
            return row
        finally:
            conn.close()

    def rewrite(self, location: Path, seq: int, **columns: Any) -> None:
        sets = ", ".join(f"{name} = ?" for name in columns)
        conn = _raw(location)
        try:
            cur = conn.execute(f"UPDATE events SET {sets} WHERE seq = ?", (*columns.values(), seq))
            assert cur.rowcount == 1
        finally:
            conn.close()

    def remove(self, location: Path, seq: int) -> None:
        conn = _raw(location)
        try:
            assert conn.execute("DELETE FROM events WHERE seq = ?", (seq,)).rowcount == 1
        finally:
            conn.close()

    def snapshot_seqs(self, location: Path, code_version: str) -> list[int]:
        conn = _raw(location)
        try:
            rows = conn.execute(
                "SELECT seq FROM snapshots WHERE code_version = ? ORDER BY seq", (code_version,)
            )
            return [seq for (seq,) in rows]
        finally:
            conn.close()


class TestSQLiteStoreNormal(TestSQLiteStore):
    """The whole contract again with ``synchronous=NORMAL``: only durability differs."""

    synchronous = "NORMAL"


# --- files that are not (good) logs -----------------------------------------------------------


@asynccontextmanager
async def _opened(path: Path, **kw: Any) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore.open(path, **kw) as store:
        yield store


@pytest.mark.anyio
async def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database, just some text " * 200)
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect(path)
    assert path.read_bytes().startswith(b"this is not a database")  # untouched


@pytest.mark.anyio
async def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, what TEXT)")
    conn.commit()
    conn.close()
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect(path)


@pytest.mark.anyio
async def test_a_damaged_page_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with _opened(path) as store:
        await store.append(batch_of(400))
    conn = sqlite3.connect(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    # the root page of the event_id index: damage its b-tree page header
    (root,) = conn.execute(
        "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
    ).fetchone()
    conn.close()
    with path.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 16)
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect(path)
    # Without the integrity check only the tail is verified, and this damage goes unseen.
    store = await SQLiteStore.connect(path, quick_check=False)
    assert store.last_seq == 400
    await store.close()


@pytest.mark.anyio
async def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with raises_code(INVALID_INPUT):
        await SQLiteStore.connect(tmp_path / "a.db", synchronous="OFF")  # type: ignore[arg-type]
    for name in (":memory:", f"file:{tmp_path / 'a.db'}"):  # a reader must share the file
        with raises_code(INVALID_INPUT):
            await SQLiteStore.connect(name)
    missing = tmp_path / "missing-dir" / "a.db"
    with raises_code(StoreCode.STORE_FAILED) as info:
        await SQLiteStore.connect(missing)
    assert info.value.message == f"cannot open {missing}: unable to open database file"
    assert info.value.details == {"cause": "OperationalError"}


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["FULL", "NORMAL"])
async def test_the_synchronous_mode_is_applied(tmp_path: Path, mode: str) -> None:
    async with _opened(tmp_path / "a.db", synchronous=mode) as store:
        assert store.synchronous == mode
        # the writer connection's setting, read through it (FULL = 2, NORMAL = 1)
        rows = await store._writer.execute_fetchall("PRAGMA synchronous")
        assert next(iter(rows))[0] == {"FULL": 2, "NORMAL": 1}[mode]
        journal = await store._writer.execute_fetchall("PRAGMA journal_mode")
        assert next(iter(journal))[0] == "wal"


# --- group commit ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_queued_appends_are_merged_into_few_transactions(tmp_path: Path) -> None:
    async with _opened(tmp_path / "a.db") as store:
        got: list[list[int]] = []

        async def appender(k: int) -> None:
            got.append(await store.append(batch_of(2, f"w{k}")))

        async with anyio.create_task_group() as tg:
            for k in range(50):
                tg.start_soon(appender, k)
        stats = store.stats
        assert stats.events == 100 and store.last_seq == 100
        # one by one would be 50 transactions; combining writes what queued meanwhile at once
        assert stats.transactions <= 5, stats
        assert stats.slow_paths == 0
        assert sorted(s for seqs in got for s in seqs) == list(range(1, 101))


@pytest.mark.anyio
async def test_the_write_statistics_count_transactions_events_and_slow_paths(
    tmp_path: Path,
) -> None:
    async with _opened(tmp_path / "a.db") as store:
        assert store.stats == WriteStats(transactions=0, events=0, slow_paths=0)
        await store.append(batch_of(3, "a"))
        await store.append(batch_of(2, "b"))
        await store.append([bound(1, "c")])
        assert store.stats == WriteStats(transactions=3, events=6, slow_paths=0)
        first = batch_of(2, "d")
        await store.append(first)
        assert await store.append(first) == [7, 8]  # a duplicate: its ids collide, re-planned
        await store.save_snapshot(Snapshot(code_version="v", seq=8, state=b""))
        assert store.stats == WriteStats(transactions=6, events=8, slow_paths=1)


@pytest.mark.anyio
async def test_a_second_writer_on_the_same_file_is_detected_and_handled(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with _opened(path) as one, _opened(path) as two:
        assert await one.append(batch_of(3, "one")) == [1, 2, 3]
        # ``two`` believes the log is empty: its seq 1 collides, it re-reads the tail.
        assert await two.append(batch_of(2, "two")) == [4, 5]
        assert await one.append(batch_of(1, "one-again")) == [6]
        with raises_code(StoreCode.SEQ_CONFLICT):
            await two.append(batch_of(1, "stale"), expected_seq=5)
        assert one.stats.slow_paths >= 1 and two.stats.slow_paths >= 1
        report = await two.verify()
        assert report.ok and report.records == 6


@pytest.mark.anyio
async def test_cancelled_callers_never_strand_the_others(tmp_path: Path) -> None:
    async with _opened(tmp_path / "a.db") as store:
        done: dict[int, list[int]] = {}
        scopes: dict[int, anyio.CancelScope] = {}

        async def appender(k: int) -> None:
            with anyio.CancelScope() as scope:
                scopes[k] = scope
                done[k] = await store.append(batch_of(3, f"w{k}"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for k in range(30):
                    tg.start_soon(appender, k)
                await anyio.lowlevel.checkpoint()  # every appender queued; the first one leads
                for k in range(0, 30, 4):  # the leader and waiters, cancelled mid-flight
                    scopes[k].cancel()
        assert all(k in done for k in range(30) if k % 4)
        # the log holds whole batches only, gap-free, and stays writable
        records = await store.read()
        assert len(records) % 3 == 0 and len(records) >= 3 * len(done)
        assert await store.append(batch_of(1, "after")) == [len(records) + 1]
        assert (await store.verify()).ok


@pytest.mark.anyio
async def test_close_lets_queued_appends_finish_and_refuses_new_ones(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    answered: dict[int, list[int] | str] = {}

    async def appender(store: SQLiteStore, k: int) -> None:
        try:
            answered[k] = await store.append(batch_of(2, f"w{k}"))
        except LoraLedgerError as exc:
            answered[k] = exc.code

    store = await SQLiteStore.connect(path)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for k in range(20):
                tg.start_soon(appender, store, k)
            await anyio.lowlevel.checkpoint()
            await store.close()
            tg.start_soon(appender, store, 99)
    assert answered.pop(99) == StoreCode.STORE_CLOSED
    acked = {s for v in answered.values() if isinstance(v, list) for s in v}
    async with _opened(path) as again:
        assert again.last_seq == len(acked) and acked == set(range(1, len(acked) + 1))
        assert (await again.verify()).ok


@pytest.mark.anyio
async def test_a_large_batch_spanning_many_statements_is_atomic(tmp_path: Path) -> None:
    async with _opened(tmp_path / "a.db") as store:
        await store.append(batch_of(1, "first"))
        big = batch_of(3000, "big")
        big[2500] = big[10]  # a duplicate inside: the store keeps one, answers its seq twice
        got = await store.append(big, expected_seq=1)
        assert got[2500] == got[10] and store.last_seq == 3000
        with raises_code(StoreCode.SEQ_CONFLICT):
            await store.append(batch_of(3000, "late"), expected_seq=1)
        assert store.last_seq == 3000
        assert (await store.verify()).ok


@pytest.mark.anyio
async def test_verify_notices_a_head_truncated_or_rewritten_behind_its_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        await store.append(batch_of(6))
        raw = _raw(path)
        try:
            row = raw.execute(f"SELECT {_COLUMNS} FROM events WHERE seq = 6").fetchone()
            raw.execute("DELETE FROM events WHERE seq = 6")
            report = await store.verify()
            assert (report.ok, report.first_bad_seq, report.code) == (
                False,
                6,
                StoreCode.CHAIN_BROKEN,
            )
            assert report.records == 5
            assert report.message == "the log ends at record 5 but record 6 was committed"
            # put back a different record 6, consistently hashed onto record 5
            forged = rehashed(row, payload=bound(77).payload)
            raw.execute(
                f"INSERT INTO events ({_COLUMNS}) VALUES (6, ?, ?, ?, ?, ?, ?, ?, ?)",
                tuple(forged.values()),
            )
        finally:
            raw.close()
        report = await store.verify()
        assert (report.ok, report.first_bad_seq, report.code) == (False, 6, StoreCode.CHAIN_BROKEN)
        assert report.message == "record 6 is not the one that was committed (rewritten)"


# --- read-only opens and crafted rows ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_read_only_store_reads_refuses_appends_and_changes_no_byte(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(3))
    before = path.read_bytes()
    with raises_code(INVALID_INPUT):
        await SQLiteStore.connect_read_only(str(path))  # a plain path: not a read-only URI
    store = await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro&immutable=1")
    try:
        assert [r.seq for r in await store.read()] == [1, 2, 3]
        assert (await store.verify()).ok
        with raises_code(INVALID_INPUT):
            await store.append(batch_of(1, "x"))
    finally:
        await store.close()
    assert path.read_bytes() == before
    assert not path.with_name("log.db-wal").exists() and not path.with_name("log.db-shm").exists()


@pytest.mark.anyio
async def test_text_that_is_not_utf8_is_a_corrupt_record_naming_its_seq(tmp_path: Path) -> None:
    """Before: sqlite3 failed the whole read (``STORE_FAILED``, no seq); the STRICT table
    takes such TEXT (SQLite does not check the encoding), so a hand edit can put it there."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(5))
    conn = _raw(path)
    try:
        conn.execute("UPDATE events SET stream = CAST(x'ff00fe' AS TEXT) WHERE seq = 4")
    finally:
        conn.close()
    store = await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro&immutable=1")
    try:
        report = await store.verify()
        assert (report.ok, report.code, report.first_bad_seq) == (
            False,
            StoreCode.CORRUPT_RECORD,
            4,
        )
        assert "not UTF-8" in report.message and report.last_seq == 3
        with raises_code(StoreCode.CORRUPT_RECORD, seq=4):
            await store.read()
    finally:
        await store.close()


@pytest.mark.anyio
async def test_a_missing_record_is_named_before_its_successors_bad_text(tmp_path: Path) -> None:
    """Record 3 removed and record 4's text damaged: the first thing wrong in chain order is the
    missing position, so both the read and the verify name record 3 (not record 4)."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(5))
    conn = _raw(path)
    try:
        conn.execute("DELETE FROM events WHERE seq = 3")
        conn.execute("UPDATE events SET stream = CAST(x'ff00fe' AS TEXT) WHERE seq = 4")
    finally:
        conn.close()
    store = await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro&immutable=1")
    try:
        with raises_code(StoreCode.CHAIN_BROKEN, seq=3):
            await store.read()
        report = await store.verify()
        assert (report.ok, report.code, report.first_bad_seq, report.last_seq) == (
            False,
            StoreCode.CHAIN_BROKEN,
            3,
            2,
        )
        assert "record 3 is missing" in report.message
    finally:
        await store.close()


# --- connection settings, and files that open but cannot be read (mutation campaign) ---------


async def _pragma(conn: Any, name: str) -> object:
    rows = await conn.execute_fetchall(f"PRAGMA {name}")
    return next(iter(rows))[0]


@pytest.mark.anyio
async def test_the_connections_keep_their_settings(tmp_path: Path) -> None:
    """The writer: WAL, a 5 s lock wait, a WAL bounded to 64 MiB after checkpoints. The reader:
    query-only (a bug that wrote through it fails loudly instead of racing the writer), the
    same lock wait, reads through a 256 MiB map. A read-only open is query-only too."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        assert store.path == str(path)
        await store.append(batch_of(2))
        writer, reader = store._writer, store._reader
        assert await _pragma(writer, "journal_mode") == "wal"
        assert await _pragma(writer, "busy_timeout") == 5000
        assert await _pragma(writer, "journal_size_limit") == 67108864
        assert await _pragma(reader, "query_only") == 1
        assert await _pragma(reader, "busy_timeout") == 5000
        assert await _pragma(reader, "mmap_size") == 268435456
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            await reader.execute("DELETE FROM events")
        assert [r.seq for r in await store.read()] == [1, 2]
    store = await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro")
    try:
        assert await _pragma(store._reader, "query_only") == 1
    finally:
        await store.close()


@pytest.mark.anyio
async def test_a_read_only_open_needs_a_read_only_uri_and_names_its_label(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(2))
    for uri in (str(path), path.as_uri(), f"{path}?mode=ro"):  # a path, or no mode=ro
        with raises_code(INVALID_INPUT) as info:
            await SQLiteStore.connect_read_only(uri)
        assert uri in info.value.message
    uri = f"{path.as_uri()}?mode=ro"
    store = await SQLiteStore.connect_read_only(uri)
    assert store.path == uri  # no label: the URI names it
    await store.close()
    store = await SQLiteStore.connect_read_only(uri, label="the copy")
    assert (store.path, store.synchronous, store.last_seq) == ("the copy", "FULL", 2)
    await store.close()
    missing = f"{(tmp_path / 'missing.db').as_uri()}?mode=ro"
    with raises_code(StoreCode.STORE_FAILED) as failed:
        await SQLiteStore.connect_read_only(missing, label="lost.db")
    assert failed.value.message.startswith("cannot open lost.db: ")
    assert failed.value.details == {"cause": "OperationalError"}


def _foreign(path: Path, *, application_id: int, user_version: int, events: bool = False) -> None:
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA application_id = {application_id}")
    conn.execute(f"PRAGMA user_version = {user_version}")
    conn.execute("CREATE TABLE other (x)" if not events else "CREATE TABLE events (x)")
    conn.commit()
    conn.close()


@pytest.mark.anyio
@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
async def test_a_file_that_is_not_this_layout_is_refused_naming_it(
    tmp_path: Path, read_only: bool
) -> None:
    """Another application's database, a newer layout of ours, a damaged page, and our identity
    over tables that are not ours: each refused at open with its own code, naming the file."""

    async def open_and_close(path: Path, **kw: Any) -> None:
        if read_only:
            uri = f"{path.as_uri()}?mode=ro"
            store = await SQLiteStore.connect_read_only(uri, label=f"<{path.name}>", **kw)
        else:
            store = await SQLiteStore.connect(path, **kw)
        await store.close()

    def named(path: Path) -> str:
        return f"<{path.name}>" if read_only else str(path)

    other = tmp_path / "other.db"
    _foreign(other, application_id=7, user_version=1)
    newer = tmp_path / "newer.db"
    _foreign(newer, application_id=0x4C4C4752, user_version=2)
    hollow = tmp_path / "hollow.db"
    _foreign(hollow, application_id=0x4C4C4752, user_version=1)
    for path, code in (
        (other, StoreCode.CORRUPT_STORE),
        (newer, StoreCode.UNKNOWN_SCHEMA),
        (hollow, StoreCode.STORE_FAILED),  # no events table: the tail cannot be read
    ):
        with raises_code(code) as info:
            await open_and_close(path)
        assert named(path) in info.value.message, info.value.message
    assert "no such table: events" in info.value.message
    assert info.value.details == {"cause": "OperationalError"}

    damaged = tmp_path / "damaged.db"
    async with _opened(damaged) as store:
        await store.append(batch_of(400))
    conn = sqlite3.connect(damaged)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute(
        "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
    ).fetchone()
    conn.close()
    with damaged.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 16)
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await open_and_close(damaged)  # the integrity check runs by default
    assert named(damaged) in info.value.message and "integrity" in info.value.message
    problems = info.value.details["problems"]
    assert problems and all(isinstance(p, str) for p in problems)
    await open_and_close(damaged, quick_check=False)  # only the tail is checked


@pytest.mark.anyio
async def test_reads_that_fail_below_the_store_are_store_failed(tmp_path: Path) -> None:
    """A table dropped behind the store's back: a read and a snapshot load fail with
    STORE_FAILED naming what was being read and the cause; verify reports it, before record 1."""
    path = tmp_path / "log.db"
    async with _opened(path) as store:
        await store.append(batch_of(3))
        raw = _raw(path)
        try:
            raw.execute("DROP TABLE snapshots")
            raw.execute("DROP TABLE events")
        finally:
            raw.close()
        with raises_code(StoreCode.STORE_FAILED) as info:
            await store.read()
        assert info.value.message.startswith("cannot read records after 0: no such table")
        assert info.value.details == {"cause": "OperationalError"}
        with raises_code(StoreCode.STORE_FAILED) as info:
            await store.load_snapshot("v1")
        assert info.value.message.startswith("cannot read snapshots: no such table")
        assert info.value.details == {"cause": "OperationalError"}
        report = await store.verify()
        assert (report.ok, report.code, report.first_bad_seq, report.records) == (
            False,
            StoreCode.STORE_FAILED,
            1,
            0,
        )
        assert "no such table" in report.message


@pytest.mark.anyio
async def test_after_a_failed_write_the_next_group_rereads_the_tail_then_trusts_it_again(
    tmp_path: Path,
) -> None:
    """A write that fails below the store (here a trigger that aborts every insert: a real
    SQLite error) answers STORE_FAILED, outcome unknown, naming the cause; the cached tail is
    then suspect, so the next group reads it inside its transaction (the slow path), and the
    one after trusts it again. On an empty log: the slow path starts the chain at seq 1."""
    path = tmp_path / "log.db"
    async with _opened(path) as store:
        raw = _raw(path)
        try:
            raw.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no'); END"
            )
        finally:
            raw.close()
        with raises_code(StoreCode.STORE_FAILED) as info:
            await store.append(batch_of(2, "lost"))
        assert info.value.message.startswith("append failed, outcome unknown: ")
        assert info.value.details == {"cause": "IntegrityError"}
        assert store.last_seq == 0
        failed_slow = store.stats.slow_paths  # the fast path's error is retried slowly first
        raw = _raw(path)
        try:
            raw.execute("DROP TRIGGER refuse")
        finally:
            raw.close()
        # the next group (a snapshot save) takes the slow path, which writes saves too
        await store.save_snapshot(Snapshot(code_version="v", seq=0, state=b"s"))
        assert store.stats.slow_paths == failed_slow + 1
        assert await store.append(batch_of(2, "a"), expected_seq=0) == [1, 2]
        assert store.stats.slow_paths == failed_slow + 1
        assert await store.load_snapshot("v") == Snapshot(code_version="v", seq=0, state=b"s")
        assert [r.event.owner for r in await store.read()] == ["a", "a"]  # type: ignore[union-attr]
        assert await store.append(batch_of(2, "b"), expected_seq=2) == [3, 4]
        assert store.stats.slow_paths == failed_slow + 1
        assert (await store.verify()).ok


def test_sqlite_errors_are_classified_by_their_sqlite_code() -> None:
    """A damaged file's codes (SQLITE_CORRUPT, SQLITE_NOTADB) are CORRUPT_STORE; any other
    error, including one sqlite3 raises without an SQLite code (a ProgrammingError), is
    STORE_FAILED; both name what was being done, the error and its class."""
    corrupt = sqlite3.DatabaseError("database disk image is malformed")
    corrupt.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
    notadb = sqlite3.DatabaseError("file is not a database")
    notadb.sqlite_errorcode = sqlite3.SQLITE_NOTADB
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY
    cases = [
        (corrupt, StoreCode.CORRUPT_STORE),
        (notadb, StoreCode.CORRUPT_STORE),
        (busy, StoreCode.STORE_FAILED),
        (sqlite3.ProgrammingError("Cannot operate on a closed database."), StoreCode.STORE_FAILED),
        (OSError("disk full"), StoreCode.STORE_FAILED),
    ]
    for exc, code in cases:
        err = _store_error(exc, "reading x")
        assert (err.code, err.message) == (code, f"reading x: {exc}")
        assert err.details == {"cause": type(exc).__name__}


def _connection_threads() -> set[threading.Thread]:
    """aiosqlite's one thread per open connection (it ends just after the connection closes).
    Compared as sets, not counts: a thread of an earlier test may still be ending, and a count
    taken before it ends would be off by one (a flaky failure the mutation runs found)."""
    return {t for t in threading.enumerate() if "_connection_worker_thread" in t.name}


async def _all_end(threads: set[threading.Thread]) -> None:
    with anyio.fail_after(5):
        while any(t.is_alive() for t in threads):  # noqa: ASYNC110 -- threads have no event
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_refused_open_leaves_no_connection_open(tmp_path: Path) -> None:
    before = _connection_threads()
    newer = tmp_path / "newer.db"
    _foreign(newer, application_id=0x4C4C4752, user_version=2)
    with raises_code(StoreCode.UNKNOWN_SCHEMA):
        await SQLiteStore.connect_read_only(f"{newer.as_uri()}?mode=ro")
    with raises_code(StoreCode.UNKNOWN_SCHEMA):
        await SQLiteStore.connect(newer)
    hollow = tmp_path / "hollow.db"  # fails after both connections opened: at the tail
    _foreign(hollow, application_id=0x4C4C4752, user_version=1)
    with raises_code(StoreCode.STORE_FAILED):
        await SQLiteStore.connect(hollow)
    await _all_end(_connection_threads() - before)


@contextmanager
def _write_lock(path: Path) -> Iterator[None]:
    """Another connection holds the file's write lock: the store's writer waits on it (its
    busy timeout), so a group stays mid-write for as long as the test says."""
    raw = _raw(path)
    raw.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        raw.execute("COMMIT")
        raw.close()


@pytest.mark.anyio
async def test_a_caller_cancelled_before_its_call_was_taken_is_never_written(
    tmp_path: Path,
) -> None:
    """While the leader writes, w1 and w2 queue; w1 is cancelled: it is dropped (never written)
    and the leadership passes to w2, which writes its own batch."""
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        answered: dict[str, list[int]] = {}
        scope = anyio.CancelScope()

        async def append(tag: str, scope: anyio.CancelScope | None = None) -> None:
            with scope or anyio.CancelScope():
                answered[tag] = await store.append(batch_of(2, tag))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                with _write_lock(path):
                    tg.start_soon(append, "leader")
                    await _until_queued(store, 0)  # the leader took its call, waits on the lock
                    tg.start_soon(append, "w1", scope)
                    tg.start_soon(append, "w2")
                    await _until_queued(store, 2)
                    scope.cancel()
                    await _until_queued(store, 1)
        assert answered == {"leader": [1, 2], "w2": [3, 4]}
        owners = [r.event.owner for r in await store.read()]  # type: ignore[union-attr]
        assert owners == ["leader", "leader", "w2", "w2"]


@pytest.mark.anyio
async def test_a_leader_cancelled_while_it_writes_still_answers_its_group(tmp_path: Path) -> None:
    """The group is written for every caller in it: the leader's cancellation does not
    interrupt the write (a shielded scope), so the others in its group get their seqs."""
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        answered: dict[str, list[int] | str] = {}
        scopes = {tag: anyio.CancelScope() for tag in ("first", "second", "w1", "w2", "w3")}

        async def append(tag: str) -> None:
            with scopes[tag]:
                try:
                    answered[tag] = await store.append(batch_of(2, tag))
                except LoraLedgerError as exc:
                    answered[tag] = exc.code
                if tag == "first":
                    scopes["second"].cancel()  # the next leader, woken but not yet writing

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                with _write_lock(path):
                    tg.start_soon(append, "first")
                    await _until_queued(store, 0)
                    for tag in ("second", "w1", "w2", "w3"):
                        tg.start_soon(append, tag)
                    await _until_queued(store, 4)
        assert answered["first"] == [1, 2]
        assert {tag: answered.get(tag) for tag in ("w1", "w2", "w3")} == {
            "w1": [5, 6],
            "w2": [7, 8],
            "w3": [9, 10],
        }
        assert store.last_seq == 10 and (await store.verify()).ok


async def _until_queued(store: SQLiteStore, n: int) -> None:
    """Let the event loop run until a leader writes and ``n`` calls wait in the queue."""
    while not store._group.leading or store._group.queued != n:
        await anyio.lowlevel.checkpoint()


class _SecondGroup:
    """Stages a group of several calls mid-write: ``first`` writes alone while ``second``, w1 and
    w2 queue; when ``first`` is answered it takes the file's write lock again, so ``second``
    leads [second, w1, w2] and waits on the lock inside its write until :meth:`release`."""

    def __init__(self, path: Path, store: SQLiteStore) -> None:
        self.store = store
        self.raw = _raw(path)
        self.answered: dict[str, list[int] | str] = {}
        self.scopes = {tag: anyio.CancelScope() for tag in ("first", "second", "w1", "w2")}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.batches = {tag: batch_of(2, tag) for tag in self.scopes}

    async def append(self, tag: str) -> None:
        self.tasks[tag] = asyncio.current_task()  # type: ignore[assignment]
        with self.scopes[tag]:
            try:
                self.answered[tag] = await self.store.append(self.batches[tag])
            except LoraLedgerError as exc:
                self.answered[tag] = f"{exc.code}: {exc.message}"
            except asyncio.CancelledError:
                if self.scopes[tag].cancel_called:
                    raise  # anyio's own cancellation: its scope catches it
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                self.answered[tag] = "cancelled under the shield"
            if tag == "first":
                self.raw.execute("BEGIN IMMEDIATE")

    async def stage(self, tg: anyio.abc.TaskGroup) -> None:
        self.raw.execute("BEGIN IMMEDIATE")
        tg.start_soon(self.append, "first")
        await _until_queued(self.store, 0)
        for tag in ("second", "w1", "w2"):
            tg.start_soon(self.append, tag)
        await _until_queued(self.store, 3)
        self.raw.execute("COMMIT")  # first writes; second then takes its group and waits
        while "first" not in self.answered or self.store._group.queued:  # noqa: ASYNC110 -- store state
            await anyio.sleep(0.001)

    def release(self) -> None:
        self.raw.execute("COMMIT")
        self.raw.close()


@pytest.mark.anyio
async def test_a_caller_cancelled_after_its_call_was_taken_is_written_anyway(
    tmp_path: Path,
) -> None:
    """w1 is cancelled while the group holding its call is being written: its events land (it
    cannot know, and a retry with the same ids is answered with their seqs)."""
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        staged = _SecondGroup(path, store)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await staged.stage(tg)
                staged.scopes["w1"].cancel()
                await anyio.sleep(0.01)
                staged.release()
        assert staged.answered == {"first": [1, 2], "second": [3, 4], "w2": [7, 8]}
        owners = [r.event.owner for r in await store.read()]  # type: ignore[union-attr]
        assert owners == ["first"] * 2 + ["second"] * 2 + ["w1"] * 2 + ["w2"] * 2
        assert await store.append(staged.batches["w1"]) == [5, 6]  # the retry


@pytest.mark.anyio
async def test_a_group_interrupted_under_the_shield_answers_store_failed(tmp_path: Path) -> None:
    """A bare asyncio cancellation of the leader reaches through anyio's shield: the others in
    its group are answered STORE_FAILED (the write may have landed), never left waiting or told
    they were written, and the next group re-reads the tail."""
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        staged = _SecondGroup(path, store)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await staged.stage(tg)
                staged.tasks["second"].cancel()
                while len(staged.answered) < 4:  # noqa: ASYNC110 -- answers, no event
                    await anyio.sleep(0.001)
                staged.release()
        interrupted = "STORE_FAILED: the write was interrupted"
        assert staged.answered == {
            "first": [1, 2],
            "second": "cancelled under the shield",
            "w1": interrupted,
            "w2": interrupted,
        }
        slow = store.stats.slow_paths
        with anyio.fail_after(10):
            got = await store.append(batch_of(1, "after"))
        assert store.stats.slow_paths == slow + 1  # the tail was suspect: re-read
        assert got == [store.last_seq] and (await store.verify()).ok


@pytest.mark.anyio
async def test_close_cancelled_still_closes_both_connections(tmp_path: Path) -> None:
    """close() is shielded: a caller cancelled while closing leaves no connection open."""
    before = _connection_threads()
    store = await SQLiteStore.connect(tmp_path / "a.db")
    mine = _connection_threads() - before
    assert len(mine) == 2
    with anyio.CancelScope() as scope:
        scope.cancel()
        await store.close()
    await _all_end(mine)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sizes", "groups"),
    [((4096, 4095, 1), 1), ((4096, 4096, 1), 2), ((8193,), 1)],
    ids=["8192 events merge", "8193 split", "one call over the bound"],
)
async def test_a_group_holds_at_most_8192_events_but_always_its_first_call(
    tmp_path: Path, sizes: tuple[int, ...], groups: int
) -> None:
    """Calls queued behind a write are merged up to 8,192 events per transaction (bounding the
    first caller's wait and the memory of a group); a single call above the bound is written
    alone, whole."""
    path = tmp_path / "a.db"
    async with _opened(path) as store:
        answered: dict[int, list[int]] = {}

        async def append(k: int, size: int) -> None:
            answered[k] = await store.append(batch_of(size, f"c{k}"))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                with _write_lock(path):
                    tg.start_soon(append, -1, 1)
                    await _until_queued(store, 0)  # the first caller writes alone, held
                    for k, size in enumerate(sizes):
                        tg.start_soon(append, k, size)
                    await _until_queued(store, len(sizes))
        assert store.stats.transactions == 1 + groups
        assert [len(answered[k]) for k in range(len(sizes))] == list(sizes)
        assert store.last_seq == 1 + sum(sizes) and (await store.verify()).ok
