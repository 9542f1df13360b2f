"""The chaos trainer's record of its publications survives its SIGKILL: a publication it was
killed in is left unacknowledged (``info``), never lost or taken for an answer, and a new life
goes on from the step after it."""

from __future__ import annotations

from pathlib import Path

import msgspec

from tests.chaos.history import ClientOp
from tests.chaos.trainer import NOT_ANSWERED, OPS_FILE, next_step, read_trainer_ops


def _line(version: int, outcome: str, code: str = "") -> bytes:
    op = ClientOp(
        client="trainer",
        kind="publish",
        invoked=float(version),
        completed=float(version),
        outcome=outcome,  # type: ignore[arg-type]
        code=code,
        version=version,
    )
    return msgspec.json.encode(op) + b"\n"


def test_a_publication_killed_before_its_answer_stays_unacknowledged(tmp_path: Path) -> None:
    path = tmp_path / OPS_FILE
    path.write_bytes(
        _line(1, "info", NOT_ANSWERED)
        + _line(1, "ok")
        + _line(2, "info", NOT_ANSWERED)
        + _line(2, "fail", "PUBLICATION_BLOCKED")
        + _line(3, "info", NOT_ANSWERED)  # killed here: no second line
        + b'{"client":"trainer","kind":"pub'  # a line the SIGKILL cut
    )
    ops = {op.version: (op.outcome, op.code) for op in read_trainer_ops(path)}
    assert ops == {1: ("ok", ""), 2: ("fail", "PUBLICATION_BLOCKED"), 3: ("info", NOT_ANSWERED)}
    assert next_step(path) == 4


def test_a_first_life_publishes_step_one(tmp_path: Path) -> None:
    assert read_trainer_ops(tmp_path / OPS_FILE) == []
    assert next_step(tmp_path / OPS_FILE) == 1
