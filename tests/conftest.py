"""Shared pytest wiring: the ``--slow`` switch for long variants, ``--contend N`` (busy processes
beside the run: :mod:`tests.support.contention`), the ``anyio`` marker, and the
fixtures of :mod:`tests.support.fixtures` for every test folder."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.support.fixtures", "tests.support.contention"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the long variants (more Hypothesis examples, more seeds, every crash point)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "anyio: run the test on the anyio event loop")
