"""``PostgresStore`` answers an append only once its commit is durable, whatever the server's
own configuration: its writer's session runs ``synchronous_commit = on`` even on a server
configured ``off`` (where a commit is answered before its WAL is flushed), so an acknowledged
append survives a crash of the SERVER itself (kill -9 of the postmaster and its backends, then
a restart that recovers from the WAL), not only of the client.

Real parts: a throwaway PostgreSQL server of its own (``tools/pg_server.py``), configured
``synchronous_commit = off`` and with its WAL writer's periodic flush as far apart as the server
allows (10 s), so that a commit not flushed by its own session stays in the server's memory
until the kill."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import suppress

import anyio
import asyncpg
import pytest

from evlog.postgres import PostgresStore
from evlog.record import Record
from tests.evlog.contract import bound
from tools.pg_server import (
    PostgresServer,
    PostgresUnavailable,
    create_database,
    restarted,
    temporary_server,
)

CONFIGURED_OFF = {"synchronous_commit": "off", "wal_writer_delay": "10000ms"}
APPENDS = 40
GONE_WITHIN_S = 30.0


@pytest.fixture
def careless_server() -> Iterator[PostgresServer]:
    """A server of this test's own (it is crashed), configured to answer commits early."""
    try:
        with temporary_server(settings=CONFIGURED_OFF) as server:
            yield server
    except PostgresUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI: {exc}")
        pytest.skip(f"no PostgreSQL server here: {exc}")


def crash(server: PostgresServer) -> None:
    """kill -9 the postmaster and every process of its group (the backends, the WAL writer: it
    leads the group), reap it, and wait until no process of the group is left."""
    os.killpg(server.pid, signal.SIGKILL)
    with suppress(ChildProcessError):
        os.waitpid(server.pid, 0)
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "the crashed server's processes did not exit"
        time.sleep(0.01)


def test_the_writer_commits_synchronously_on_a_server_configured_off(
    careless_server: PostgresServer,
) -> None:
    async def settings() -> tuple[str, str]:
        url = await create_database(careless_server, "sync")
        async with PostgresStore.open(url) as store:
            writer = await store._writer.fetchval("SHOW synchronous_commit")
        plain = await asyncpg.connect(url)
        try:
            configured = await plain.fetchval("SHOW synchronous_commit")
        finally:
            await plain.close()
        return writer, configured

    assert anyio.run(settings) == ("on", "off")


def test_an_acknowledged_append_survives_a_crash_of_the_server(
    careless_server: PostgresServer,
) -> None:
    async def append_one_by_one(url: str) -> list[tuple[int, bytes]]:
        store = await PostgresStore.connect(url)
        acknowledged: list[tuple[int, bytes]] = []
        try:
            for i in range(APPENDS):
                event = bound(i)
                [seq] = await store.append([event])
                acknowledged.append((seq, event.event_id))
            crash(careless_server)  # while the store is still open: nothing closes cleanly
        finally:
            with suppress(Exception):
                await store.close()
        return acknowledged

    async def read_back(url: str) -> list[Record]:
        async with PostgresStore.open(url) as store:
            return [record async for record in store.iterate(after=0)]

    database = "crash"
    url = anyio.run(create_database, careless_server, database)
    acknowledged = anyio.run(append_one_by_one, url)
    with restarted(careless_server, settings=CONFIGURED_OFF) as again:
        records = anyio.run(read_back, again.url(database))
    assert [(r.seq, r.event_id) for r in records] == acknowledged
