"""A SQLite file is opened only when it is a sound loraledger log, a read-only open changes no
byte of it, and a record the file damaged is named in chain order.

Each refusal names the file and comes before anything is written (another application's
database is not switched to WAL, a file system without WAL is refused before the layout is
written), with its own code: ``CORRUPT_STORE`` for what is not a sound log, ``UNKNOWN_SCHEMA``
for a newer layout, ``STORE_FAILED`` for what cannot be read, ``INVALID_INPUT`` for the
caller's mistakes. The damage is real SQLite damage (a page overwritten, text that is not
UTF-8, NULLs in a NOT NULL column), made with raw sqlite3.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from evlog.errors import INVALID_INPUT, StoreCode
from evlog.sqlite import SQLiteStore, _prepare_writer, _store_error
from tests.evlog.contract import batch_of, raises_code
from tests.evlog.sqlite_raw import (
    another_applications_database,
    damage_an_index_page,
    foreign,
    run,
)

pytestmark = pytest.mark.anyio


# --- what is refused at open -----------------------------------------------------------------


async def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database, just some text " * 200)
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect(path)
    assert path.read_bytes().startswith(b"this is not a database")  # untouched


async def test_another_applications_database_is_left_untouched(tmp_path: Path) -> None:
    """Refused before any setting: switching it to WAL rewrote its header (its bytes changed,
    its journal mode became ``wal``) and left ``-wal`` and ``-shm`` files beside it."""
    path = another_applications_database(tmp_path / "other.db")
    before = path.read_bytes()
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await SQLiteStore.connect(path)
    assert "not a loraledger log" in info.value.message
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["other.db"]


async def test_a_database_marked_as_another_applications_is_left_untouched_even_empty(
    tmp_path: Path,
) -> None:
    """An ``application_id`` that is not the log's says whose file it is, tables or not: it is
    refused before any setting (it was switched to WAL, then refused inside the transaction)."""
    path = tmp_path / "theirs.db"
    run(path, "PRAGMA application_id = 1234")
    before = path.read_bytes()
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await SQLiteStore.connect(path)
    assert "not a loraledger log" in info.value.message
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["theirs.db"]


async def test_a_damaged_page_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(400))
    damage_an_index_page(path)
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect(path)
    # Without the integrity check only the tail is verified, and this damage goes unseen.
    store = await SQLiteStore.connect(path, quick_check=False)
    assert store.last_seq == 400
    await store.close()


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
    foreign(other, application_id=7, user_version=1)
    newer = tmp_path / "newer.db"
    foreign(newer, application_id=0x4C4C4752, user_version=2)
    hollow = tmp_path / "hollow.db"
    foreign(hollow, application_id=0x4C4C4752, user_version=1)
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
    async with SQLiteStore.open(damaged) as store:
        await store.append(batch_of(400))
    damage_an_index_page(damaged)
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await open_and_close(damaged)  # the integrity check runs by default
    assert named(damaged) in info.value.message and "integrity" in info.value.message
    problems = info.value.details["problems"]
    assert problems and all(isinstance(p, str) for p in problems)
    await open_and_close(damaged, quick_check=False)  # only the tail is checked


async def test_a_file_system_without_wal_is_refused(tmp_path: Path) -> None:
    """Where SQLite cannot keep a WAL (no shared-memory locking, as on some network file
    systems; ``nolock=1`` makes a local file behave so), it answers the mode it kept: the store
    must refuse, since its reader and its crash guarantees rest on WAL."""
    path = tmp_path / "log.db"
    conn = await aiosqlite.connect(f"{path.as_uri()}?nolock=1", uri=True, isolation_level=None)
    try:
        with raises_code(StoreCode.STORE_FAILED) as info:
            await _prepare_writer(conn, str(path), "FULL", True)
        assert "WAL" in info.value.message and str(path) in info.value.message
    finally:
        await conn.close()
    assert path.stat().st_size == 0  # refused before the layout was written


def _with_null_streams(path: Path, count: int) -> None:
    """Damage the file the way only a hand edit can: NULL in a NOT NULL column of ``count``
    rows (the schema is loosened for the edit and restored), which quick_check reports once
    per row."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()
        loose = sql.replace("stream TEXT NOT NULL", "stream TEXT")
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'events'", (loose,))
    finally:
        conn.close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("UPDATE events SET stream = NULL WHERE seq <= ?", (count,))
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'events'", (sql,))
    finally:
        conn.close()


async def test_an_integrity_report_keeps_the_first_twenty_problems(tmp_path: Path) -> None:
    """A badly damaged file must not turn the error into a megabyte of details."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(40))
    _with_null_streams(path, 30)
    openers: list[Callable[[], Awaitable[SQLiteStore]]] = [
        lambda: SQLiteStore.connect(path),
        lambda: SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro"),
    ]
    for open_it in openers:
        with raises_code(StoreCode.CORRUPT_STORE) as info:
            await open_it()
        problems = info.value.details["problems"]
        assert problems == ["NULL value in events.stream"] * 20
        assert info.value.message.count("NULL value in events.stream") == 5


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


async def test_a_path_that_names_no_file_is_refused(tmp_path: Path) -> None:
    """The empty path is SQLite's private temporary database: a reader could not share it."""
    for path in ("", ":memory:", f"{(tmp_path / 'log.db').as_uri()}"):
        with raises_code(INVALID_INPUT) as info:
            await SQLiteStore.connect(path)
        assert "file path" in info.value.message


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


# --- read-only opens -------------------------------------------------------------------------


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


# --- records the file damaged ----------------------------------------------------------------


async def _five_records_edited(path: Path, *statements: str) -> SQLiteStore:
    """A log of five records, edited by hand with ``statements``, opened read-only."""
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(5))
    run(path, *statements)
    return await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro&immutable=1")


async def test_text_that_is_not_utf8_is_a_corrupt_record_naming_its_seq(tmp_path: Path) -> None:
    """The STRICT table takes such TEXT (SQLite does not check the encoding), so a hand edit can
    put it there; sqlite3 would fail the whole read without naming the row (``STORE_FAILED``,
    no seq), so the store re-reads those columns as blobs and names the record."""
    store = await _five_records_edited(
        tmp_path / "log.db", "UPDATE events SET stream = CAST(x'ff00fe' AS TEXT) WHERE seq = 4"
    )
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


async def test_a_missing_record_is_named_before_its_successors_bad_text(tmp_path: Path) -> None:
    """Record 3 removed and record 4's text damaged: the first thing wrong in chain order is the
    missing position, so both the read and the verify name record 3 (not record 4)."""
    store = await _five_records_edited(
        tmp_path / "log.db",
        "DELETE FROM events WHERE seq = 3",
        "UPDATE events SET stream = CAST(x'ff00fe' AS TEXT) WHERE seq = 4",
    )
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
