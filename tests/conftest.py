"""Shared pytest wiring: anyio on asyncio, and the ``--slow`` switch for long variants."""

from __future__ import annotations

import pytest


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
