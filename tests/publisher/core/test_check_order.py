"""The check order of docs/state-machine.md, exhaustively: every version command x every
version state (and a LOADING candidate under another version's block) x the current or a
stale attempt, each answer checked against the doc's table *Answers by version state*, parsed
from the document itself so the two cannot drift apart.

Every refusal must leave the state and the log unchanged (a recorded refusal appends exactly
its one record and changes no version); every no-op writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import get_args

import msgspec
import pytest

from projections import invariants
from projections.registry import encode_state, evolve
from publisher.core import commands as c
from publisher.core.decider import decide
from tests.publisher.core.book import Book, digest_of
from tests.support.paths import REPO

DOC = REPO / "docs" / "state-machine.md"
TARGET = 3  # the version whose state the table's columns name
RECORDED = {"ReceiptRejected", "VerdictConflict", "PublicationBlocked"}


def _doc_table() -> dict[str, dict[str, str]]:
    """{command: {column: cell}} from the table under "### Answers by version state"."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Answers by version state", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    table: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header[1:], cells[1:], strict=True))
    return table


TABLE = _doc_table()


# --- the states the columns name ----------------------------------------------------------


def _base() -> Book:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.publish(2)  # 1 RETIRED, 2 the default
    return book


def _loading(book: Book) -> None:
    book.allocate(TARGET)
    book.claim(TARGET)


def _blocked(book: Book) -> None:
    _loading(book)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason="unload timed out"))


def _fail(clean: bool) -> Callable[[Book], None]:
    def build(book: Book) -> None:
        _loading(book)
        absent = ("e0", "e1") if clean else ()
        book.run(c.FailAttempt(version_id=TARGET, attempt=1, clean=clean, code="T",
                               reason="t", absent_on=absent))  # fmt: skip

    return build


def _published(book: Book) -> None:
    book.publish(TARGET)


def _retired(book: Book) -> None:
    book.publish(TARGET)
    book.publish(TARGET + 1)


def _reclaiming(book: Book) -> None:
    _retired(book)
    book.run(c.ClaimReclaim(version_id=TARGET))


def _reclaimed(book: Book) -> None:
    _retired(book)
    book.reclaim(TARGET)


BUILDS: dict[str, Callable[[Book], None]] = {
    "LOADING": _loading,
    "LOADING, blocked": _blocked,
    "PUBLISHED": _published,
    "RETIRED": _retired,
    "RECLAIMING": _reclaiming,
    "RECLAIMED": _reclaimed,
    "FAILED_RETRYABLE": _fail(clean=True),
    "FAILED_FATAL": _fail(clean=False),
}


def build(column: str, command: str) -> Book:
    """The target in the column's state; then e1 restarts (to e1-i2), so that a receipt or an
    unload from e1 is never a duplicate of one the build recorded. A READY in a LOADING
    column has its PREPARED first (the protocol's order is tested elsewhere)."""
    book = _base()
    BUILDS[column](book)
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    v = book.state.versions[TARGET]
    if command == "RecordReady" and column.startswith("LOADING"):
        book.run(_receipt(book, c.RecordPrepared))
    assert v.state.value == column.split(",")[0]
    return book


# --- the commands the rows name -----------------------------------------------------------


def _receipt(book: Book, step: type[c.EngineReceipt], stale: bool = False) -> c.EngineReceipt:
    v = book.state.versions[TARGET]
    return step(version_id=TARGET, attempt=v.attempt + stale, engine="e1",
                incarnation="e1-i2", digest=v.digest, lora_name=v.lora_name)  # fmt: skip


def command(name: str, book: Book, stale: bool) -> c.Command:
    attempt = book.state.versions[TARGET].attempt + (1 if stale else 0)
    v, e1 = TARGET, {"engine": "e1"}
    commands: dict[str, Callable[[], c.Command]] = {
        "Allocate": lambda: c.Allocate(version_id=v, digest=digest_of(v)),
        "ClaimTransport": lambda: c.ClaimTransport(version_id=v, attempt=attempt, owner="other"),
        "RecordPrepared": lambda: _receipt(book, c.RecordPrepared, stale),
        "RecordReady": lambda: _receipt(book, c.RecordReady, stale),
        "Commit": lambda: c.Commit(version_id=v, attempt=attempt),
        "FailAttempt": lambda: c.FailAttempt(
            version_id=v, attempt=attempt, clean=False, code="LATE", reason="a fatal verdict"
        ),
        "RestoreVersion": lambda: c.RestoreVersion(version_id=v, incarnation="e1-i2", **e1),
        "ClaimReclaim": lambda: c.ClaimReclaim(version_id=v),
        "RecordUnloaded": lambda: c.RecordUnloaded(version_id=v, incarnation="e1-i2", **e1),
        "MarkReclaimAmbiguous": lambda: c.MarkReclaimAmbiguous(version_id=v, reason="r", **e1),
        # e0 holds a committed target since the build (e1 restarted and holds nothing)
        "CheckCanary": lambda: c.CheckCanary(
            version_id=v, engine="e0", incarnation="e0-i1", answer="5,6,7"
        ),
    }
    return commands[name]()


CASES = [
    pytest.param(name, column, stale, id=f"{name}-{column.replace(', ', '+')}-{kind}")
    for name in TABLE
    for column in BUILDS
    for stale, kind in ((False, "current"), (True, "stale"))
    if not stale or TABLE[name]["stale attempt"] != "—"
]


def test_the_table_covers_every_version_command_and_state() -> None:
    version_commands = {
        cls.__name__ for cls in get_args(c.AnyCommand) if "version_id" in cls.__struct_fields__
    }
    assert set(TABLE) == version_commands
    assert all(set(row) == {"stale attempt", *BUILDS} for row in TABLE.values())


def _versions(book: Book) -> dict[int, bytes]:
    return {k: msgspec.msgpack.encode(v) for k, v in book.state.versions.items()}


@pytest.mark.parametrize(("name", "column", "stale"), CASES)
def test_every_command_answers_as_the_table_says(name: str, column: str, stale: bool) -> None:
    expected = TABLE[name]["stale attempt" if stale else column]
    book = build(column, name)
    state_before = encode_state(book.state)
    versions_before = _versions(book)
    decision = decide(book.state, command(name, book, stale))
    for event in decision.events:
        evolve(book.state, event, book.state.last_seq + 1)
    invariants.check(book.state)
    written = [type(e).__name__ for e in decision.events]
    code = re.fullmatch(r"`([A-Z_]+)`(\*?)", expected)
    if code is not None:
        assert decision.error is not None, f"expected {expected}, got {decision.outcome}"
        assert decision.error.code == code.group(1), decision.error
        if code.group(2):  # recorded: its one record, no version changed
            assert len(written) == 1 and written[0] in RECORDED, written
            if written == ["ReceiptRejected"]:
                assert getattr(decision.events[0], "code", None) == code.group(1)
            assert _versions(book) == versions_before
        else:
            assert written == [] and encode_state(book.state) == state_before
    elif expected in ("no-op", "resumed"):
        assert decision.error is None, decision.error
        assert written == [] and encode_state(book.state) == state_before
        if expected == "resumed":
            assert getattr(decision.outcome, "resumed", False), decision.outcome
    else:
        assert expected == "accepted", f"unknown cell {expected!r}"
        assert decision.error is None, decision.error
        assert written and not getattr(decision.outcome, "no_op", False), decision.outcome
