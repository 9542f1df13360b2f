"""The fault matrix's figures (crash points survived, seeds run, bad inputs tried), printed in
pytest's terminal summary so a CI log shows them in the form RELIABILITY.md quotes."""

from __future__ import annotations

import pytest

FIGURES: dict[str, str] = {}


def record_figure(name: str, value: str) -> None:
    """Keep ``name: value`` for the summary, and print it now (visible with ``-s``)."""
    FIGURES[name] = value
    print(f"{name}: {value}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("fault matrix")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")
