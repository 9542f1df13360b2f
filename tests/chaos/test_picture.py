"""The chaos picture draws any history: fault bands and turns per second, as a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.history import ClientOp, Fault, History, Outcome
from tests.chaos.picture import draw


def test_a_history_is_drawn_as_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the picture needs the plot extra (matplotlib)")
    ended: tuple[tuple[float, Outcome], ...] = ((100.0, "ok"), (101.0, "info"), (102.5, "fail"))
    ops = tuple(
        ClientOp(client="c0", kind="turn", invoked=t, completed=t + 0.5, outcome=outcome)
        for t, outcome in ended
    )
    faults = (
        Fault(target="e0", kind="kill", at=100.2, healed=101.7),
        Fault(target="serve->e1", kind="black_hole", at=101.0, healed=102.0),
    )
    history = History(ops=ops, engine=(), faults=faults, log=(), heal=102.0)
    out = draw(history, tmp_path / "run.png", title="three turns")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # two panels, not an empty canvas
