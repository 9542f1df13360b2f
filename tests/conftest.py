"""Shared pytest wiring: anyio on asyncio, the ``--slow`` switch for long variants, and a
throwaway PostgreSQL server for the PostgreSQL event store's tests."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from tools.pg_server import PostgresServer

T = TypeVar("T")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the long variants (more Hypothesis examples, more seeds, every crash point)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "anyio: run the test on the anyio event loop")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def slow(request: pytest.FixtureRequest) -> bool:
    """True under ``--slow``: tests scale their example/seed counts from it."""
    return bool(request.config.getoption("--slow"))


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
