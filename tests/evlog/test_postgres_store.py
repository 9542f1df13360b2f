"""The store contract on ``PostgresStore`` against a real PostgreSQL server (the session's
throwaway one, tests/conftest.py; raw asyncpg for tampering), plus what a server-backed,
group-committing store has: merged transactions, a second writer, a database that is not a
log, a server that goes away, and the URL that picks the backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg
import pytest

from evlog import open_store
from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.postgres import PostgresStore, redact
from evlog.record import Row
from evlog.sqlite import SQLiteStore
from evlog.store import EventStore
from publisher.errors import Code
from publisher.ledger import Ledger
from tests.evlog.contract import StoreContract, batch_of, raises_code
from tests.support.fixtures import run_blocking

_COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"


async def _sql(url: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(query, *args)]
    finally:
        await conn.close()


async def _execute(url: str, query: str, *args: Any) -> str:
    conn = await asyncpg.connect(url)
    try:
        return await conn.execute(query, *args)
    finally:
        await conn.close()


class TestPostgresStore(StoreContract):
    @pytest.fixture
    def location(self, postgres_url: str) -> str:
        return postgres_url

    def opened(self, location: str) -> AbstractAsyncContextManager[EventStore]:
        return PostgresStore.open(location)

    def raw_row(self, location: str, seq: int) -> Row:
        rows = run_blocking(
            _sql, location, f"SELECT {_COLUMNS} FROM loraledger_events WHERE seq = $1", seq
        )
        return rows[0]

    def rewrite(self, location: str, seq: int, **columns: Any) -> None:
        sets = ", ".join(f"{name} = ${i}" for i, name in enumerate(columns, start=2))
        status = run_blocking(
            _execute,
            location,
            f"UPDATE loraledger_events SET {sets} WHERE seq = $1",
            seq,
            *columns.values(),
        )
        assert status == "UPDATE 1"

    def remove(self, location: str, seq: int) -> None:
        status = run_blocking(
            _execute, location, "DELETE FROM loraledger_events WHERE seq = $1", seq
        )
        assert status == "DELETE 1"

    def snapshot_seqs(self, location: str, code_version: str) -> list[int]:
        rows = run_blocking(
            _sql,
            location,
            "SELECT seq FROM loraledger_snapshots WHERE code_version = $1 ORDER BY seq",
            code_version,
        )
        return [seq for (seq,) in rows]


@asynccontextmanager
async def _opened(url: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore.open(url) as store:
        yield store


pytestmark = pytest.mark.anyio


async def test_queued_appends_are_merged_into_few_transactions(postgres_url: str) -> None:
    async with _opened(postgres_url) as store:
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


async def test_a_second_writer_on_the_same_log_is_detected_and_handled(postgres_url: str) -> None:
    async with _opened(postgres_url) as one, _opened(postgres_url) as two:
        assert await one.append(batch_of(3, "one")) == [1, 2, 3]
        # ``two`` believes the log is empty: its seq 1 collides, it re-reads the tail.
        assert await two.append(batch_of(2, "two")) == [4, 5]
        assert await one.append(batch_of(1, "one-again")) == [6]
        with raises_code(StoreCode.SEQ_CONFLICT):
            await two.append(batch_of(1, "stale"), expected_seq=5)
        assert one.stats.slow_paths >= 1 and two.stats.slow_paths >= 1
        report = await two.verify()
        assert report.ok and report.records == 6


async def test_two_writers_racing_never_share_a_seq(postgres_url: str) -> None:
    """Two stores appending at once on one log: every answered seq is unique, the chain is
    one chain (the primary key refuses a second seq n; the loser re-plans under the lock)."""
    answered: dict[str, list[tuple[bytes, int]]] = {"a": [], "b": []}
    async with _opened(postgres_url) as a, _opened(postgres_url) as b:

        async def appender(name: str, store: PostgresStore, k: int) -> None:
            for j in range(15):
                batch = batch_of(1 + (k + j) % 3, f"{name}{k}-{j}")
                seqs = await store.append(batch)
                answered[name] += [(p.event_id, s) for p, s in zip(batch, seqs, strict=True)]

        async with anyio.create_task_group() as tg:
            for k in range(8):
                tg.start_soon(appender, "a", a, k)
                tg.start_soon(appender, "b", b, k)
        pairs = answered["a"] + answered["b"]
        seqs = sorted(s for _, s in pairs)
        assert seqs == list(range(1, len(pairs) + 1))
        by_seq = {r.seq: r.event_id for r in await a.read()}
        assert all(by_seq[s] == eid for eid, s in pairs)
        assert (await a.verify()).ok and (await b.verify()).ok
        assert a.stats.slow_paths + b.stats.slow_paths >= 1


async def test_a_stale_ledger_is_fenced_by_its_successor(postgres_url: str) -> None:
    """The Ray restart story on one log: a ledger that kept running (a zombie on a node cut
    off) is refused by the store the moment its successor appended, and stops (FENCED)."""
    async with _opened(postgres_url) as old_store, Ledger.open(old_store) as old:
        await old.create_deployment("d", prefix="p", capacity=2)
        await old.register_owner("w1", ttl_s=60)
        async with _opened(postgres_url) as new_store, Ledger.open(new_store) as new:
            assert new.state.epoch == old.state.epoch + 1
            await new.register_owner("w2", ttl_s=60)
            with pytest.raises(LoraLedgerError) as fenced:
                await old.register_owner("w3", ttl_s=60)
            assert fenced.value.code == Code.FENCED
            report = await new_store.verify()
            assert report.ok and report.last_seq == new_store.last_seq


async def test_a_database_holding_other_tables_by_our_names_is_refused(postgres_url: str) -> None:
    await _execute(postgres_url, "CREATE TABLE loraledger_events (id integer)")
    with raises_code(StoreCode.CORRUPT_STORE):
        await PostgresStore.connect(postgres_url)


async def test_a_newer_layout_is_refused(postgres_url: str) -> None:
    async with _opened(postgres_url) as store:
        await store.append(batch_of(2))
    await _execute(postgres_url, "UPDATE loraledger_layout SET layout = 99")
    with raises_code(StoreCode.UNKNOWN_SCHEMA):
        await PostgresStore.connect(postgres_url)


async def test_a_read_only_store_reads_and_refuses_appends(postgres_url: str) -> None:
    with raises_code(StoreCode.CORRUPT_STORE):  # no layout is created by a reader
        await PostgresStore.connect(postgres_url, read_only=True)
    assert (
        await _sql(postgres_url, "SELECT 1 FROM pg_tables WHERE tablename LIKE 'loraledger%'") == []
    )
    async with _opened(postgres_url) as store:
        await store.append(batch_of(3))
    reader = await PostgresStore.connect(postgres_url, read_only=True)
    try:
        assert [r.seq for r in await reader.read()] == [1, 2, 3]
        assert (await reader.verify()).ok
        with raises_code(INVALID_INPUT):
            await reader.append(batch_of(1, "x"))
        # the server refuses a write on its sessions too, whatever the code above did
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await reader._writer.execute("DELETE FROM loraledger_events")
    finally:
        await reader.close()


async def test_bad_urls_and_unreachable_servers_are_refused(postgres_url: str) -> None:
    with raises_code(INVALID_INPUT):
        await PostgresStore.connect("/a/path.db")
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database"
    with raises_code(StoreCode.STORE_FAILED):
        await PostgresStore.connect(missing)
    assert redact("postgresql://u:secret@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    # unparsable: refused before any connection, its password still hidden in the message
    assert redact("postgresql://u:secret@[::1/db") == "postgresql://***@[::1/db"
    for unusable in ("postgresql://u:secret@127.0.0.1:99999/db", "postgresql://u:secret@[::1/db"):
        with raises_code(INVALID_INPUT) as info:
            await PostgresStore.connect(unusable)
        assert "secret" not in info.value.message and "postgresql:// URL" in info.value.message


async def test_writes_after_the_connection_dies_fail_then_recover(postgres_url: str) -> None:
    """The server ends the writer's session (a restart, a failover). A group in flight then
    gets STORE_FAILED (its outcome is unknown to the store); a group written once asyncpg saw
    the session end goes to a new connection. Either way the store stays usable: the next
    append reconnects, re-reads the tail and lands right after everything committed."""
    async with _opened(postgres_url) as store:
        assert await store.append(batch_of(2, "a")) == [1, 2]
        old_writer = store._writer
        await _execute(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        failure = None
        try:
            maybe = len(await store.append(batch_of(1, "maybe")))
        except LoraLedgerError as exc:
            failure, maybe = exc.code, 0
        assert failure in (None, StoreCode.STORE_FAILED)
        got = await store.append(batch_of(2, "b"))
        assert got == [3 + maybe, 4 + maybe]
        assert store._writer is not old_writer and not store._writer.is_closed()
        assert [r.seq for r in await store.read()] == list(range(1, 5 + maybe))
        assert (await store.verify()).ok


async def test_open_store_picks_the_backend_from_the_location(
    postgres_url: str, tmp_path: Path
) -> None:
    async with open_store(postgres_url) as pg:
        assert isinstance(pg, PostgresStore)
        assert await pg.append(batch_of(1)) == [1]
    for where in (str(tmp_path / "a.db"), f"sqlite://{tmp_path / 'b.db'}", tmp_path / "c.db"):
        async with open_store(where) as lite:
            assert isinstance(lite, SQLiteStore)
            assert await lite.append(batch_of(1)) == [1]
    assert (tmp_path / "b.db").exists()
    with raises_code(INVALID_INPUT):
        async with open_store("mysql://h/db"):
            pass
    with raises_code(INVALID_INPUT):
        async with open_store(postgres_url, synchronous="NORMAL"):
            pass


async def test_close_lets_queued_appends_finish_and_refuses_new_ones(postgres_url: str) -> None:
    answered: dict[int, list[int] | str] = {}

    async def appender(store: PostgresStore, k: int) -> None:
        try:
            answered[k] = await store.append(batch_of(2, f"w{k}"))
        except LoraLedgerError as exc:
            answered[k] = exc.code

    store = await PostgresStore.connect(postgres_url)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for k in range(20):
                tg.start_soon(appender, store, k)
            await anyio.lowlevel.checkpoint()
            await store.close()
            tg.start_soon(appender, store, 99)
    assert answered.pop(99) == StoreCode.STORE_CLOSED
    acked = {s for v in answered.values() if isinstance(v, list) for s in v}
    async with _opened(postgres_url) as again:
        assert again.last_seq == len(acked) and acked == set(range(1, len(acked) + 1))
        assert (await again.verify()).ok
