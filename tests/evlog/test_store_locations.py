"""One location string names both the backend and where the log is (``evlog.open_store``):
a ``postgresql://`` URL opens a PostgreSQL log, a path or a ``sqlite://`` location a SQLite
file; any other scheme, or a SQLite-only setting for a PostgreSQL log, is the caller's mistake.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evlog import open_store
from evlog.errors import INVALID_INPUT
from evlog.postgres import PostgresStore
from evlog.sqlite import SQLiteStore
from tests.evlog.contract import batch_of, raises_code


@pytest.mark.anyio
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
