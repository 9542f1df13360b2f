"""The fixtures any test folder can ask for (``tests/conftest.py`` registers this module).

* ``anyio_backend``: ``@pytest.mark.anyio`` tests run on asyncio;
* ``slow``: True under ``--slow`` (tests scale their example and seed counts from it);
* ``postgres_server`` / ``postgres_url``: a throwaway PostgreSQL server for the session and a
  fresh database on it per test;
* ``fault_log`` / ``health_log``: a private copy of a log the real ledger wrote
  (:mod:`tests.support.runs`), free to change; ``fault_records``: the fault run's records.
  Each run is written once per session (the ``*_master`` fixtures, never to be changed).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest

from evlog.record import Record
from tests.support.runs import read_back, write_fault_run_sync, write_health_run

if TYPE_CHECKING:
    from tools.pg_server import PostgresServer

T = TypeVar("T")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def slow(request: pytest.FixtureRequest) -> bool:
    """True under ``--slow``: tests scale their example/seed counts from it."""
    return bool(request.config.getoption("--slow"))


# --- PostgreSQL ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL server for the session (tools/pg_server.py), on 127.0.0.1 and
    a free port, stopped by its PID at the end. Missing binaries fail the run in CI (``CI`` is
    set; ./test.sh installs them) and skip, saying why, elsewhere."""
    from tools.pg_server import PostgresUnavailable, temporary_server

    try:
        with temporary_server() as server:
            yield server
    except PostgresUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI: {exc}")
        pytest.skip(f"no PostgreSQL server here: {exc}")


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh, empty database on the session's server."""
    from tools.pg_server import create_database

    return run_blocking(create_database, postgres_server, f"t_{uuid.uuid4().hex[:12]}")


def run_blocking(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """Run a coroutine to completion on a private event loop in a thread, from sync code or
    from inside a running test loop (raw database access that bypasses the store under test)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fn(*args)).result()


# --- logs the real ledger wrote --------------------------------------------------------------


@pytest.fixture(scope="session")
def fault_log_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault run of :mod:`tests.support.runs`, written once per test session (read-only:
    copy it with the ``fault_log`` fixture before changing it)."""
    return write_fault_run_sync(tmp_path_factory.mktemp("fault") / "fault.db")


@pytest.fixture
def fault_log(fault_log_master: Path, tmp_path: Path) -> Path:
    """A private copy of the fault run (the writer closed it, so the file is complete)."""
    copy = tmp_path / "fault.db"
    shutil.copyfile(fault_log_master, copy)
    return copy


@pytest.fixture(scope="session")
def fault_records(fault_log_master: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Record]:
    """The fault run's records, read once per session from a copy of the log (a shared list:
    never change it)."""
    copy = tmp_path_factory.mktemp("fault-records") / "fault.db"
    shutil.copyfile(fault_log_master, copy)
    return read_back(copy)


@pytest.fixture(scope="session")
def health_log_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The health run of :mod:`tests.support.runs` (read-only: copy it with ``health_log``)."""
    return anyio.run(write_health_run, tmp_path_factory.mktemp("health") / "health.db")


@pytest.fixture
def health_log(health_log_master: Path, tmp_path: Path) -> Path:
    """A private copy of the health run."""
    copy = tmp_path / "health.db"
    shutil.copyfile(health_log_master, copy)
    return copy
