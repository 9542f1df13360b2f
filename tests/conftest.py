"""Shared pytest wiring: anyio on asyncio, the ``--slow`` switch for long variants, a
throwaway PostgreSQL server for the PostgreSQL event store's tests, and what running on
several xdist workers needs (``./test.sh`` passes ``-n 2``): the tests that share something
machine-wide kept on one worker, and the fault matrix's figures gathered from every worker."""

from __future__ import annotations

import asyncio
import json
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
    if hasattr(config, "workerinput"):
        # xdist starts its workers with COLUMNS=80 and LINES=24; the CLI sizes its tables
        # from COLUMNS (tools/output.py), so a worker would fold lines that a plain run
        # prints whole, and the tests reading them would depend on how the suite was run.
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


# Tests that run on one xdist worker, one after another: the vLLM integration tests share one
# server per process (a session fixture: ~2 min to start, several GiB; split over two workers
# it starts twice), and the two bad-input modules add to one tally that one figure reports.
_GROUPS = {
    "vllm": ("tests/integration/",),
    "bad-input": ("tests/fault/test_bad_input.py", "tests/fault/test_bad_input_http.py"),
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Load balancing, test by test, except that each of ``_GROUPS`` goes to one worker whole.

    xdist's own ``--dist loadgroup`` (``xdist_group`` marks) does this by renaming the tests'
    ids, which pytest 9 no longer lets a plugin do (the id is no longer ``item._nodeid``), so
    the groups are read from the test ids here, in the scheduler the same mode uses."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class _Grouped(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no annotations
        def _split_scope(self, nodeid: str) -> str:
            for group, prefixes in _GROUPS.items():
                if nodeid.startswith(prefixes):
                    return group
            return nodeid

    return _Grouped(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand this worker's fault-matrix figures to the controller."""
    from tests.fault.conftest import FIGURES

    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fault_figures"] = json.dumps(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the xdist controller: gather a finished worker's figures."""
    from tests.fault.conftest import FIGURES

    FIGURES.update(json.loads(getattr(node, "workeroutput", {}).get("fault_figures", "{}")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.fault.conftest import FIGURES

    if FIGURES:
        terminalreporter.section("fault matrix")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")


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
