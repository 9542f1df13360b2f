"""What the SQLite store leaves behind when an open, a write, a read or a close goes wrong.

These paths are rarely taken and easy to get subtly wrong: a cleanup that a cancellation cuts
short leaks a connection thread (and keeps the file open) for the life of the process; a
cleanup that itself fails must not replace the error being reported. The failures below are
real SQLite behaviour (a file system without locking, a damaged file, a table dropped behind
the store's back), except where no file can make SQLite fail on cue: a close or a rollback
that raises is injected around the real call, which still runs first.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import pytest

from evlog.chained_store import CHUNK
from evlog.errors import INVALID_INPUT, StoreCode
from evlog.record import Row
from evlog.sqlite import APPLICATION_ID, LAYOUT_VERSION, SQLiteStore, _prepare_writer
from evlog.store import Snapshot
from tests.evlog.contract import batch_of, raises_code

pytestmark = pytest.mark.anyio


@pytest.fixture
async def connections(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[list[aiosqlite.Connection]]:
    """Every aiosqlite connection the store makes during the test, closed at the end whatever
    the test found (so a leaked one does not outlive it)."""
    made: list[aiosqlite.Connection] = []
    real_connect = aiosqlite.connect

    def connect(*args: Any, **kwargs: Any) -> aiosqlite.Connection:
        conn = real_connect(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(aiosqlite, "connect", connect)
    yield made
    monkeypatch.undo()  # a close injected to fail must not fail the cleanup
    for conn in made:
        await conn.close()


async def _is_closed(conn: aiosqlite.Connection) -> bool:
    try:
        await conn.execute_fetchall("SELECT 1")
    except ValueError:  # aiosqlite: no active connection
        return True
    return False


def _fail_after(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Make ``aiosqlite.Connection.<method>`` run for real, then raise as a failing disk would."""
    real: Callable[[aiosqlite.Connection], Awaitable[None]] = getattr(aiosqlite.Connection, method)

    async def failing(self: aiosqlite.Connection) -> None:
        await real(self)
        raise sqlite3.OperationalError(f"disk I/O error (injected into {method})")

    monkeypatch.setattr(aiosqlite.Connection, method, failing)


def _another_applications_database(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, what TEXT)")
    conn.commit()
    conn.close()
    return path


# --- opening -----------------------------------------------------------------------------------


async def test_a_cancelled_open_closes_every_connection_it_made(
    tmp_path: Path, connections: list[aiosqlite.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after both connections exist (the reader's first statement never returns):
    the cleanup must close both, although the cancellation is still being delivered."""
    both_open = anyio.Event()
    real_connect = aiosqlite.connect

    def connect(*args: Any, **kwargs: Any) -> aiosqlite.Connection:
        conn = real_connect(*args, **kwargs)
        if len(connections) == 2:  # the reader

            async def stalled(*_: Any, **__: Any) -> None:
                both_open.set()
                await anyio.sleep_forever()

            monkeypatch.setattr(conn, "execute", stalled)
        return conn

    monkeypatch.setattr(aiosqlite, "connect", connect)
    async with anyio.create_task_group() as tg:
        tg.start_soon(SQLiteStore.connect, tmp_path / "log.db")
        await both_open.wait()
        tg.cancel_scope.cancel()
    assert len(connections) == 2
    assert [await _is_closed(c) for c in connections] == [True, True]


async def test_a_failing_close_does_not_hide_why_the_open_failed(
    tmp_path: Path, connections: list[aiosqlite.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_after(monkeypatch, "close")
    path = _another_applications_database(tmp_path / "other.db")
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await SQLiteStore.connect(path)
    assert "not a loraledger log" in info.value.message
    with raises_code(StoreCode.CORRUPT_STORE):
        await SQLiteStore.connect_read_only(f"{path.as_uri()}?mode=ro")
    assert len(connections) == 2 and all([await _is_closed(c) for c in connections])


async def test_a_failing_rollback_does_not_hide_why_the_layout_check_failed(
    tmp_path: Path, connections: list[aiosqlite.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_after(monkeypatch, "rollback")
    path = tmp_path / "newer.db"  # ours, in a layout this code does not read: checked in the
    conn = sqlite3.connect(path)  # layout's transaction, so refusing it rolls that back
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {LAYOUT_VERSION + 1}")
    conn.execute("CREATE TABLE events (x)")
    conn.commit()
    conn.close()
    with raises_code(StoreCode.UNKNOWN_SCHEMA) as info:
        await SQLiteStore.connect(path)
    assert f"layout {LAYOUT_VERSION + 1}" in info.value.message
    assert all([await _is_closed(c) for c in connections])


async def test_another_applications_database_is_left_untouched(tmp_path: Path) -> None:
    """Refused before any setting: switching it to WAL rewrote its header (its bytes changed,
    its journal mode became ``wal``) and left ``-wal`` and ``-shm`` files beside it."""
    path = _another_applications_database(tmp_path / "other.db")
    before = path.read_bytes()
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await SQLiteStore.connect(path)
    assert "not a loraledger log" in info.value.message
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["other.db"]


async def test_a_path_that_names_no_file_is_refused(tmp_path: Path) -> None:
    """The empty path is SQLite's private temporary database: a reader could not share it."""
    for path in ("", ":memory:", f"{(tmp_path / 'log.db').as_uri()}"):
        with raises_code(INVALID_INPUT) as info:
            await SQLiteStore.connect(path)
        assert "file path" in info.value.message


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


# --- writing -----------------------------------------------------------------------------------


async def test_a_failing_rollback_leaves_the_writes_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot save fails inside its transaction (the table was dropped behind the store's
    back) and the rollback fails too: the caller learns the save's cause, and the store,
    which no longer trusts its cached tail, still appends correctly afterwards."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(3))
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("DROP TABLE snapshots")
        conn.close()
        _fail_after(monkeypatch, "rollback")
        with raises_code(StoreCode.STORE_FAILED) as info:
            await store.save_snapshot(Snapshot(code_version="v1", seq=3, state=b"s"))
        assert info.value.details["cause"] == "OperationalError"
        assert "no such table: snapshots" in info.value.message
        monkeypatch.undo()
        assert await store.append(batch_of(2, "after")) == [4, 5]
    async with SQLiteStore.open(path) as store:
        assert [r.seq for r in await store.read()] == [1, 2, 3, 4, 5]


async def test_after_a_failed_first_write_the_chain_still_starts_at_seq_1(tmp_path: Path) -> None:
    """The slow path reads the tail of an empty log as (0, genesis), not as what the cache
    says: the first record written after a failure is record 1, chained to genesis."""
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no'); END"
        )
        conn.close()
        with raises_code(StoreCode.STORE_FAILED):
            await store.append(batch_of(2, "lost"))
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("DROP TRIGGER refuse")
        conn.close()
        assert await store.append(batch_of(2, "a")) == [1, 2]
        assert [r.seq for r in await store.read()] == [1, 2]
        assert (await store.verify()).ok


# --- reading and closing ------------------------------------------------------------------------


def _paused_before_its_second_fetch(paused: anyio.Event, resume: anyio.Event) -> type[SQLiteStore]:
    """The real store, holding its second fetch until ``resume``: how a verify's next chunk
    meets a close that happened while the first chunk was being checked."""

    class Paused(SQLiteStore):
        fetches = 0

        async def _fetch(
            self, after: int, upto: int, limit: int | None, *, with_predecessor: bool = False
        ) -> list[Row]:
            self.fetches += 1
            if self.fetches == 2:
                paused.set()
                await resume.wait()
            return await super()._fetch(after, upto, limit, with_predecessor=with_predecessor)

    return Paused


async def test_a_verify_that_meets_a_close_between_chunks_is_store_closed(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    async with SQLiteStore.open(path) as store:
        await store.append(batch_of(CHUNK + 5))
    paused, resume = anyio.Event(), anyio.Event()
    store = await _paused_before_its_second_fetch(paused, resume).connect(path)
    outcome: list[Exception] = []

    async def verify() -> None:
        try:
            await store.verify()
        except Exception as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(verify)
        await paused.wait()
        await store.close()
        resume.set()
    assert len(outcome) == 1, "the verify must fail, not report the log"
    with raises_code(StoreCode.STORE_CLOSED):
        raise outcome[0]


async def test_a_failing_close_still_closes_both_connections(
    tmp_path: Path, connections: list[aiosqlite.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await SQLiteStore.connect(tmp_path / "log.db")
    await store.append(batch_of(2))
    _fail_after(monkeypatch, "close")
    await store.close()  # the injected failures are not the caller's business
    assert len(connections) == 2 and all([await _is_closed(c) for c in connections])
    with raises_code(StoreCode.STORE_CLOSED):
        await store.read()


async def test_a_close_cancelled_while_a_group_is_written_waits_for_it_then_closes(
    tmp_path: Path, connections: list[aiosqlite.Connection]
) -> None:
    """close() is shielded as a whole: cancelled while a group waits for the file's write lock
    (held here by another connection), it still lets that group commit and answer, then closes
    both connections; nothing is left half-closed."""
    path = tmp_path / "log.db"
    store = await SQLiteStore.connect(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the store's next write waits for it (busy_timeout)
    answered: list[list[int]] = []

    async def append() -> None:
        answered.append(await store.append(batch_of(1)))

    async def release() -> None:
        await anyio.wait_all_tasks_blocked()  # close() is waiting for the group by now
        other.rollback()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(append)
            await anyio.wait_all_tasks_blocked()  # the group is in flight, on the lock
            tg.start_soon(release)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await store.close()
    finally:
        other.close()
    assert answered == [[1]]
    assert len(connections) == 2 and all([await _is_closed(c) for c in connections])
    with raises_code(StoreCode.STORE_CLOSED):
        await store.read()
