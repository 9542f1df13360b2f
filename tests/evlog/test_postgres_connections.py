"""What only a server-backed store has: a URL that must name a reachable database (and never
show its password), sessions the server itself keeps read-only for the forensic tools, and a
writer's session the server may end at any time (a restart, a failover)."""

from __future__ import annotations

import os
import signal
import socket
from contextlib import suppress
from typing import Any

import anyio
import anyio.abc
import asyncpg
import pytest

from evlog import postgres
from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.postgres import _READ_PLANS, PostgresStore, redact
from tests.evlog.contract import batch_of, raises_code
from tests.evlog.postgres_raw import execute, sql
from tests.support.relay import listening, pipe
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio


async def test_bad_urls_and_unreachable_servers_are_refused(postgres_url: str) -> None:
    with raises_code(INVALID_INPUT) as info:
        await PostgresStore.connect("/a/path.db")
    assert info.value.message == "not a postgresql:// URL: /a/path.db"
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database"
    with raises_code(StoreCode.STORE_FAILED) as info:
        await PostgresStore.connect(missing)
    # the driver's own error, named: what the operator must fix
    assert info.value.message.startswith(f"cannot open {missing}: ")
    assert '"no_such_database" does not exist' in info.value.message
    assert info.value.details == {"cause": "InvalidCatalogNameError"}
    assert redact("postgresql://u:secret@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    # unparsable: refused before any connection, its password still hidden in the message
    assert redact("postgresql://u:secret@[::1/db") == "postgresql://***@[::1/db"
    for unusable in ("postgresql://u:secret@127.0.0.1:99999/db", "postgresql://u:secret@[::1/db"):
        with raises_code(INVALID_INPUT) as info:
            await PostgresStore.connect(unusable)
        assert "secret" not in info.value.message and "postgresql:// URL" in info.value.message


async def test_a_read_only_store_creates_no_layout_and_its_sessions_refuse_writes(
    postgres_url: str,
) -> None:
    """A reader never creates a log where there is none, and the server refuses a write on its
    sessions, whatever the code above them did (``default_transaction_read_only``)."""
    with raises_code(StoreCode.CORRUPT_STORE) as info:  # no layout is created by a reader
        await PostgresStore.connect(postgres_url, read_only=True)
    # marked empty: the read-only tools say "no ledger was written here", not "corrupt"
    assert info.value.details.get("empty") is True
    assert info.value.message == f"{postgres_url} holds no loraledger log (no tables)"
    assert (
        await sql(postgres_url, "SELECT 1 FROM pg_tables WHERE tablename LIKE 'loraledger%'") == []
    )
    async with PostgresStore.open(postgres_url) as store:
        await store.append(batch_of(3))
    reader = await PostgresStore.connect(postgres_url, read_only=True)
    try:
        assert [r.seq for r in await reader.read()] == [1, 2, 3]
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await reader._writer.execute("DELETE FROM loraledger_events")
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await reader._readers.execute("DELETE FROM loraledger_events")
    finally:
        await reader.close()
    assert [seq for (seq,) in await sql(postgres_url, "SELECT seq FROM loraledger_events")] == [
        1,
        2,
        3,
    ]


async def test_writes_after_the_connection_dies_fail_then_recover(postgres_url: str) -> None:
    """The server ends the writer's session (a restart, a failover). A group in flight then
    gets STORE_FAILED (its outcome is unknown to the store); a group written once asyncpg saw
    the session end goes to a new connection. Either way the store stays usable: the next
    append reconnects, re-reads the tail and lands right after everything committed."""
    async with PostgresStore.open(postgres_url) as store:
        assert await store.append(batch_of(2, "a")) == [1, 2]
        old_writer = store._writer
        await sql(
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


async def _session_settings(conn: Any) -> tuple[str, ...]:
    names = ("synchronous_commit", "application_name", "default_transaction_read_only")
    return tuple([await conn.fetchval(f"SHOW {name}") for name in names])


async def test_every_session_commits_synchronously_on_a_database_configured_off(
    postgres_url: str,
) -> None:
    """The writer's session runs ``synchronous_commit = on`` whatever the database says (here
    ``ALTER DATABASE ... SET synchronous_commit = off``, which every new session of that
    database inherits), also once it is renewed after the server ended it; every session names
    itself ``loraledger`` to the server (``pg_stat_activity``), and the read pool's sessions
    hold the plans that keep a range read on the primary key's index."""
    database = postgres_url.rsplit("/", 1)[1]
    await execute(postgres_url, f"ALTER DATABASE {database} SET synchronous_commit = off")
    plain = await asyncpg.connect(postgres_url)
    try:
        assert await plain.fetchval("SHOW synchronous_commit") == "off"  # the database's own
    finally:
        await plain.close()
    async with PostgresStore.open(postgres_url) as store:
        assert await _session_settings(store._writer) == ("on", "loraledger", "off")
        async with store._readers.acquire() as reader:
            assert await _session_settings(reader) == ("on", "loraledger", "off")
            plans = [await reader.fetchval(f"SHOW {name}") for name in _READ_PLANS]
            assert plans == ["off", "off", "off"]
        await sql(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        with suppress(LoraLedgerError):  # the group that meets the ended session
            await store.append(batch_of(1, "maybe"))
        await store.append(batch_of(1, "after"))
        assert await _session_settings(store._writer) == ("on", "loraledger", "off")
    reader_store = await PostgresStore.connect(postgres_url, read_only=True)
    try:
        assert await _session_settings(reader_store._writer) == ("on", "loraledger", "on")
        async with reader_store._readers.acquire() as reader:
            assert await _session_settings(reader) == ("on", "loraledger", "on")
    finally:
        await reader_store.close()


async def test_a_writer_renewed_between_groups_rereads_the_tail_before_trusting_it(
    postgres_url: str,
) -> None:
    """The server ended the writer's session while no group was being written (asyncpg saw
    it close): the next group goes to a new connection, and since the log may have moved
    meanwhile (a failover, another writer), it re-reads the tail first (the slow path)."""
    async with PostgresStore.open(postgres_url) as store:
        await store.append(batch_of(2, "a"))
        old_writer = store._writer
        await sql(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        await wait_for("asyncpg saw the writer's session end", old_writer.is_closed)
        assert store.stats.slow_paths == 0
        assert await store.append(batch_of(1, "b")) == [3]
        assert store.stats.slow_paths == 1 and store._writer is not old_writer
        assert await store.append(batch_of(1, "c")) == [4]  # trusted again: the fast path
        assert store.stats.slow_paths == 1


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        ("UPDATE loraledger_layout SET application = 'another'", "loraledger_events"),
        ("INSERT INTO loraledger_layout VALUES ('loraledger', 1)", "loraledger_events"),
        ("DELETE FROM loraledger_layout", "loraledger_layout"),
        ("DROP TABLE loraledger_layout", "['loraledger_events', 'loraledger_snapshots']"),
        ("DROP TABLE loraledger_snapshots", "['loraledger_events', 'loraledger_layout']"),
    ],
    ids=["another application", "two marks", "no mark", "no layout table", "no snapshots"],
)
async def test_our_tables_without_exactly_our_one_mark_are_not_a_log(
    postgres_url: str, damage: str, found: str
) -> None:
    """A database is read as a log only when it holds the three tables and one layout row
    naming this application: anything else is another application's, or a damaged log, and
    is refused (``CORRUPT_STORE``, naming the tables found), never written to or read."""
    async with PostgresStore.open(postgres_url) as store:
        await store.append(batch_of(2))
    await execute(postgres_url, damage)
    for read_only in (False, True):
        with raises_code(StoreCode.CORRUPT_STORE) as info:
            await PostgresStore.connect(postgres_url, read_only=read_only)
        assert info.value.message.startswith(  # names the database it refused
            f"{postgres_url} holds tables named like a loraledger log's but is not one"
        )
        assert found in info.value.message


async def test_port_0_and_the_password_never_reach_a_connection_or_a_name(
    postgres_url: str,
) -> None:
    with raises_code(INVALID_INPUT) as info:
        await PostgresStore.connect("postgresql://u:secret@127.0.0.1:0/db")
    assert info.value.message == (
        "postgresql://u:***@127.0.0.1:0/db: port 0 is not a TCP port to connect to"
    )
    scheme, rest = postgres_url.split("://", 1)
    user, rest = rest.split("@", 1)
    with_password = f"{scheme}://{user}:secret@{rest}"  # the server trusts loopback: ignored
    async with PostgresStore.open(with_password) as store:
        assert store.url == store.name == f"{scheme}://{user}:***@{rest}"


async def test_a_server_that_never_answers_is_given_up_on_after_the_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listener that accepts TCP connections but never speaks (a hung server, a black-holed
    proxy) fails the open with ``STORE_FAILED`` once the connect timeout passes (30 s; 0.2 s
    here), instead of asyncpg's own minute or forever."""
    monkeypatch.setattr(postgres, "_CONNECT_TIMEOUT_S", 0.2)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with anyio.fail_after(20), raises_code(StoreCode.STORE_FAILED) as info:
            await PostgresStore.connect(f"postgresql://u@127.0.0.1:{port}/db")
    assert info.value.message.startswith(f"cannot open postgresql://u@127.0.0.1:{port}/db")


def _signal(pids: list[int], signum: signal.Signals) -> None:
    """Signal the server processes still there (a resumed one may have ended already)."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signum)


async def _store_sessions(url: str) -> list[int]:
    """The server processes of the sessions a store holds on ``url``'s database."""
    rows = await sql(
        url,
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'loraledger'",
    )
    return [pid for (pid,) in rows]


async def test_a_close_gives_up_on_sessions_whose_server_stopped_answering(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops answering (hung, or cut off by a partition that drops packets) holds
    neither the writer's close nor the read pool's for longer than the close timeout (5 s each;
    0.5 s here), and a close that fails so stays quiet: it neither stops the next connection's
    close nor reaches the caller. Stopped here with SIGSTOP on the store's server processes:
    their sockets stay open, so a close waits for an answer that never comes (asyncpg's own
    close of a pool waits forever)."""
    monkeypatch.setattr(postgres, "_CLOSE_TIMEOUT_S", 0.5)
    store = await PostgresStore.connect(postgres_url)
    await store.append(batch_of(2))
    assert [r.seq for r in await store.read()] == [1, 2]  # the pool holds a session too
    stopped = await _store_sessions(postgres_url)
    assert len(stopped) >= 2
    closed = anyio.Event()

    async def close() -> None:
        await store.close()
        closed.set()

    try:
        _signal(stopped, signal.SIGSTOP)
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            with anyio.move_on_after(30):  # far beyond both timeouts: a close that waits on
                await closed.wait()
            gave_up = closed.is_set()
            _signal(stopped, signal.SIGCONT)  # the server answers again: a waiting close ends
    finally:
        _signal(stopped, signal.SIGCONT)
    assert gave_up, "the close waited on a server that stopped answering"
    assert store._writer.is_closed() and store._readers.is_closing()

    async def sessions_gone() -> bool:  # the connections were dropped, not left open
        return not await _store_sessions(postgres_url)

    await wait_for("the server saw every session of the store end", sessions_gone, every=0.05)


async def test_opening_an_empty_database_waits_for_another_store_creating_the_layout(
    postgres_url: str,
) -> None:
    """Two stores opening one empty database at once: the layout is created under a
    transaction-scoped advisory lock, so the second waits for the first instead of both
    creating the tables (one would fail). Held here by another session: the open waits."""
    holder = await asyncpg.connect(postgres_url)
    opened = anyio.Event()

    async def open_and_close() -> None:
        store = await PostgresStore.connect(postgres_url)
        opened.set()
        await store.close()

    async def waiting_on_the_lock() -> bool:
        rows = await sql(
            postgres_url, "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        )
        return bool(rows)

    try:
        await holder.execute("SELECT pg_advisory_lock($1)", postgres._LAYOUT_LOCK)
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_and_close)
            await wait_for("the open waits on the layout lock", waiting_on_the_lock)
            assert not opened.is_set()
            await holder.execute("SELECT pg_advisory_unlock($1)", postgres._LAYOUT_LOCK)
        assert opened.is_set()
    finally:
        await holder.close()


async def test_a_store_holds_one_writer_session_and_at_most_four_readers(
    postgres_url: str,
) -> None:
    """Opening costs the server two sessions (the writer, one reader); the read pool grows
    with demand up to four, so a store never takes more than five of the server's
    ``max_connections``, however many replays and followers read at once."""
    async with PostgresStore.open(postgres_url) as store:
        await store.append(batch_of(3))
        assert len(await _store_sessions(postgres_url)) == 2
        async with anyio.create_task_group() as tg:
            for _ in range(12):  # all waiting on the pool at once
                tg.start_soon(store.read)
        assert len(await _store_sessions(postgres_url)) == 1 + 4


async def test_a_refused_open_leaves_no_session_on_the_server(postgres_url: str) -> None:
    """An open refused after its writer connected (here: a database that is not a log)
    closes that session before it raises."""
    await execute(postgres_url, "CREATE TABLE loraledger_events (id integer)")
    with raises_code(StoreCode.CORRUPT_STORE) as info:
        await PostgresStore.connect(postgres_url)

    async def sessions_gone() -> bool:
        return not await _store_sessions(postgres_url)

    await wait_for("the refused open's session ended", sessions_gone, every=0.05)
    assert info.value.code == StoreCode.CORRUPT_STORE  # (the refusal is still held here)


async def test_an_open_cancelled_on_a_server_that_stopped_answering_ends_at_once(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open cancelled while its writer waits on a server that then stops answering (here:
    on the layout lock, the server's process stopped with SIGSTOP) still closes that session
    first, but gives up on it after the close timeout (5 s; 0.5 s here): the cancellation
    arrives, not an error of the failed close, and not minutes later."""
    monkeypatch.setattr(postgres, "_CLOSE_TIMEOUT_S", 0.5)
    holder = await asyncpg.connect(postgres_url)
    await holder.execute("SELECT pg_advisory_lock($1)", postgres._LAYOUT_LOCK)
    opening = anyio.CancelScope()
    ended = anyio.Event()
    stopped: list[int] = []

    async def open_the_store() -> None:
        with opening:
            store = await PostgresStore.connect(postgres_url)
            await store.close()
        ended.set()

    async def waiting_on_the_lock() -> bool:
        rows = await sql(
            postgres_url,
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'loraledger' "
            "AND wait_event_type = 'Lock'",
        )
        stopped[:] = [pid for (pid,) in rows]
        return bool(stopped)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_the_store)
            await wait_for("the open waits on the layout lock", waiting_on_the_lock, every=0.05)
            _signal(stopped, signal.SIGSTOP)
            opening.cancel()
            with anyio.move_on_after(30):  # far beyond the close timeout
                await ended.wait()
            gave_up = ended.is_set()
            _signal(stopped, signal.SIGCONT)  # the server answers again: a waiting close ends
    finally:
        _signal(stopped, signal.SIGCONT)
        await holder.close()
    assert gave_up, "the cancelled open waited on a server that stopped answering"
    assert opening.cancelled_caught


async def test_a_read_pool_that_cannot_connect_is_given_up_on_after_the_connect_timeout(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer connected, but the server never answers the read pool's connection (a
    connection limit's queue, a proxy that stopped forwarding): the open fails with
    ``STORE_FAILED`` once the connect timeout passes (30 s; 3 s here), not after asyncpg's
    own minute, and closes the writer's session. A relay on loopback forwards the first
    connection to the server and holds every later one silent."""
    monkeypatch.setattr(postgres, "_CONNECT_TIMEOUT_S", 3.0)
    server = postgres_url.split("@", 1)[1].split("/", 1)[0]
    host, port = server.rsplit(":", 1)
    accepted = 0

    async def first_only(client: anyio.abc.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        async with client:
            if accepted > 1:
                await anyio.sleep_forever()  # accepted, never answered
            upstream = await anyio.connect_tcp(host, int(port))
            async with upstream, anyio.create_task_group() as both_ways:
                both_ways.start_soon(pipe, upstream, client)
                await pipe(client, upstream)
                both_ways.cancel_scope.cancel()

    async with listening(first_only) as relay_port:
        relayed = postgres_url.replace(server, f"127.0.0.1:{relay_port}")
        with anyio.fail_after(20), raises_code(StoreCode.STORE_FAILED) as info:
            await PostgresStore.connect(relayed)
    assert info.value.message.startswith(f"cannot open {relayed}: ")
    assert accepted == 2  # the writer's connection, then the pool's

    async def sessions_gone() -> bool:
        return not await _store_sessions(postgres_url)

    await wait_for("the writer's session ended", sessions_gone, every=0.05)
