"""The SQLite store's two connections keep their settings, and no failure or cancellation of an
open, a write or a close leaves one open or hides its own error.

These paths are rarely taken and easy to get subtly wrong: a cleanup that a cancellation cuts
short leaks a connection thread (and keeps the file open) for the life of the process; a
cleanup that itself fails must not replace the error being reported. The failures below are
real SQLite behaviour (a damaged file, a table dropped behind the store's back, another
connection holding the write lock), except where no file can make SQLite fail on cue: a close
or a rollback that raises is injected around the real call, which still runs first.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import pytest

from evlog.errors import StoreCode
from evlog.sqlite import APPLICATION_ID, LAYOUT_VERSION, SQLiteStore, Synchronous
from evlog.store import Snapshot
from tests.evlog.contract import batch_of, raises_code
from tests.evlog.sqlite_raw import another_applications_database, foreign

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


def _connection_threads() -> set[threading.Thread]:
    """aiosqlite's one thread per open connection (it ends just after the connection closes).
    Compared as sets, not counts: a thread of an earlier test may still be ending, and a count
    taken before it ends would be off by one (a flaky failure the mutation runs found)."""
    return {t for t in threading.enumerate() if "_connection_worker_thread" in t.name}


async def _all_end(threads: set[threading.Thread]) -> None:
    with anyio.fail_after(5):
        while any(t.is_alive() for t in threads):  # noqa: ASYNC110 -- threads have no event
            await anyio.sleep(0.01)


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["FULL", "NORMAL"])
async def test_the_synchronous_mode_is_applied(tmp_path: Path, mode: Synchronous) -> None:
    async with SQLiteStore.open(tmp_path / "a.db", synchronous=mode) as store:
        assert store.synchronous == mode
        # the writer connection's setting, read through it (FULL = 2, NORMAL = 1)
        rows = await store._writer.execute_fetchall("PRAGMA synchronous")
        assert next(iter(rows))[0] == {"FULL": 2, "NORMAL": 1}[mode]
        journal = await store._writer.execute_fetchall("PRAGMA journal_mode")
        assert next(iter(journal))[0] == "wal"


async def _pragma(conn: Any, name: str) -> object:
    rows = await conn.execute_fetchall(f"PRAGMA {name}")
    return next(iter(rows))[0]


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


# --- opening ---------------------------------------------------------------------------------


async def test_a_refused_open_leaves_no_connection_open(tmp_path: Path) -> None:
    before = _connection_threads()
    newer = tmp_path / "newer.db"
    foreign(newer, application_id=0x4C4C4752, user_version=2)
    with raises_code(StoreCode.UNKNOWN_SCHEMA):
        await SQLiteStore.connect_read_only(f"{newer.as_uri()}?mode=ro")
    with raises_code(StoreCode.UNKNOWN_SCHEMA):
        await SQLiteStore.connect(newer)
    hollow = tmp_path / "hollow.db"  # fails after both connections opened: at the tail
    foreign(hollow, application_id=0x4C4C4752, user_version=1)
    with raises_code(StoreCode.STORE_FAILED):
        await SQLiteStore.connect(hollow)
    await _all_end(_connection_threads() - before)


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
    path = another_applications_database(tmp_path / "other.db")
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


# --- writing ---------------------------------------------------------------------------------


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


# --- closing ---------------------------------------------------------------------------------


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
