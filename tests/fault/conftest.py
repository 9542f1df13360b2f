"""The fault matrix's figures (crash points survived, seeds run, bad inputs tried), printed in
pytest's terminal summary (``tests/conftest.py``, which also gathers them from xdist workers)
so a CI log shows them in the form RELIABILITY.md quotes."""

from __future__ import annotations

FIGURES: dict[str, str] = {}


def record_figure(name: str, value: str) -> None:
    """Keep ``name: value`` for the summary, and print it now (visible with ``-s``)."""
    FIGURES[name] = value
    print(f"{name}: {value}")
