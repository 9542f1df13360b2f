"""The provenance store beside the log, on both backends: it sits where the log's location
says, a row id is stored once however often its batch is sent, rows outlive the process that
wrote them, and a foreign file is refused rather than written into."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from evlog.errors import StoreCode, StoreError
from evlog.provenance_rows import POSTGRES_TABLE, ProvenanceStore, StoredRow
from evlog.provenance_store import SQLiteProvenance, open_provenance, provenance_location

pytestmark = pytest.mark.anyio


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def _exists(path: Path) -> bool:
    return path.is_file()


def _row(row_id: str, session: str, started_at: float) -> StoredRow:
    return StoredRow(
        row_id=row_id, session=session, started_at=started_at, body=f"{row_id}".encode()
    )


@pytest.fixture(params=["sqlite", "postgres"])
def log_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    url: str = request.getfixturevalue("postgres_url")
    return url


@asynccontextmanager
async def _opened(location: str) -> AsyncIterator[ProvenanceStore]:
    async with open_provenance(location) as store:
        yield store


async def test_a_batch_sent_twice_is_stored_once_and_read_per_session(log_location: str) -> None:
    batch = [_row("r2", "s-a", 2.0), _row("r1", "s-a", 1.0), _row("r3", "s-b", 1.5)]
    async with _opened(log_location) as store:
        assert await store.add(batch) == 3
        assert await store.add(batch) == 0  # the same rows again: a resend after a lost reply
        assert await store.add([*batch[:1], _row("r4", "s-b", 0.5)]) == 1
        assert await store.count() == 4
        assert await store.read(["s-a"]) == [b"r1", b"r2"]  # in start order
        assert await store.read() == [b"r1", b"r2", b"r4", b"r3"]
        assert await store.read(["nobody"]) == []
    async with _opened(log_location) as again:  # another life of the ledger's process
        assert await again.count() == 4


def test_the_store_lives_where_the_log_does(tmp_path: Path) -> None:
    log = tmp_path / "run7" / "ledger.db"
    assert provenance_location(log) == f"{log}.provenance.sqlite"
    assert provenance_location(f"sqlite://{log}") == f"{log}.provenance.sqlite"
    url = "postgresql://ledger:secret@db.internal/run7"
    where = provenance_location(url)
    assert POSTGRES_TABLE in where and "secret" not in where and "db.internal/run7" in where


async def test_the_sqlite_store_is_a_file_beside_the_log(tmp_path: Path) -> None:
    log = tmp_path / "ledger.db"
    async with open_provenance(log) as store:
        await store.add([_row("r1", "s", 1.0)])
    assert _exists(Path(f"{log}.provenance.sqlite"))
    assert not _exists(log)  # the log itself is not touched


async def test_a_foreign_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "ledger.db"
    foreign = Path(f"{log}.provenance.sqlite")
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE mine (x)")
    before = _bytes(foreign)
    with pytest.raises(StoreError) as info:
        async with open_provenance(log):
            pass
    assert info.value.code == StoreCode.CORRUPT_STORE and "not a loraledger" in info.value.message
    assert _bytes(foreign) == before


async def test_a_read_only_reader_sees_what_the_writer_stored(tmp_path: Path) -> None:
    log = tmp_path / "ledger.db"
    async with open_provenance(log) as store:
        await store.add([_row("r1", "s", 1.0)])
        uri = f"file:{store.location}?mode=ro"
        async with SQLiteProvenance.read_only(uri, store.location) as reader:
            assert await reader.read(["s"]) == [b"r1"]


async def test_a_postgres_reader_finds_no_table_beside_a_log_without_one(
    postgres_url: str,
) -> None:
    from evlog.provenance_postgres import PostgresProvenance

    async with PostgresProvenance.read_only(postgres_url) as none:
        assert none is None
    async with open_provenance(postgres_url) as store:
        await store.add([_row("r1", "s", 1.0)])
    async with PostgresProvenance.read_only(postgres_url) as reader:
        assert reader is not None and await reader.read(["s"]) == [b"r1"]
