"""The audit (``tools/audit.py``) rule by rule. The join, pure: which life of its session a
generation belongs to, in which order a life's generations are listed, and each mismatch a
trainer must see, word for word. ``audit_log`` on the fault run's log: where the generations
came from, the note when nowhere, progress, and what a damaged log or store fails with. The
command's output is ``test_audit.py``'s."""

from __future__ import annotations

import functools
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from evlog.provenance_store import open_provenance, provenance_location
from projections.audit import SessionAudit
from publisher.gateway.provenance import StoreSink, encode_rows
from tests.tools import tamper
from tests.tools.test_audit import _row
from tools import audit
from tools.audit import Audited, audit_log, join, load_provenance
from tools.exitcodes import Exit, ToolError


def _life(session: str, version_id: int | None, **over: object) -> SessionAudit:
    row = _row(session, 0, version_id or 1, started=0.0)
    fields: dict[str, object] = dict(
        session=session,
        owner="w0",
        version_id=version_id,
        lora_name=row.lora_name if version_id else None,
        digest=row.digest if version_id else None,
        revision=version_id,
    )
    fields.update(over)
    return SessionAudit(**fields)  # type: ignore[arg-type]


def test_a_generation_belongs_to_the_last_life_bound_at_or_before_it_started() -> None:
    lives = [
        _life("s", 1, bound_at=100.0, released_at=110.0),
        _life("s", 2, bound_at=120.0, released_at=130.0),
        _life("s", 3, bound_at=140.0),
    ]
    early = _row("s", 0, 1, started=50.0)  # before any binding: the first life's
    first = _row("s", 1, 1, started=100.0)  # at the first binding
    second = _row("s", 2, 2, started=120.0)  # at the second binding
    third = _row("s", 3, 3, started=141.0)
    reports = join(lives, [third, second, first, early, _row("other", 0, 1, started=1.0)])
    assert [r.generations for r in reports] == [(early, first), (second,), (third,)]
    assert [r.mismatches for r in reports] == [(), (), ()]


def test_a_life_s_generations_are_listed_by_turn_then_start_those_without_a_turn_first() -> None:
    life = _life("s", 1, bound_at=0.0)
    rows = [
        _row("s", 2, 1, started=5.0),
        _row("s", 1, 1, started=9.0),
        _row("s", 1, 1, started=3.0, request_id="s-1-earlier"),
        msgspec.structs.replace(_row("s", 0, 1, started=20.0, request_id="s-none"), turn=None),
        _row("s", 0, 1, started=8.0),
    ]
    (report,) = join([life], rows)
    assert [(r.turn, r.started_at) for r in report.generations] == [
        (None, 20.0),
        (0, 8.0),
        (1, 3.0),
        (1, 9.0),
        (2, 5.0),
    ]


def test_each_difference_from_the_binding_is_a_mismatch_named_word_for_word() -> None:
    life = _life("s", 1, bound_at=0.0)
    row = _row("s", 4, 2, started=1.0, lora_name="agent@other", digest="d" * 64, bound_revision=7)
    (report,) = join([life], [row])
    assert report.mismatches == (
        "request s-4 (turn 4): version 2 served, session bound to 1",
        f"request s-4 (turn 4): adapter agent@other served, session bound to {life.lora_name}",
        f"request s-4 (turn 4): digest {'d' * 64} served, session bound to {life.digest}",
        "request s-4 (turn 4): bound revision 7 served, session bound to 1",
    )


def test_an_engine_that_echoed_another_adapter_is_a_mismatch() -> None:
    life = _life("s", 1, bound_at=0.0)
    row = _row("s", 0, 1, started=1.0)
    echoed = _row("s", 1, 1, started=2.0, served_name="agent@someone-else")
    agreed = _row("s", 2, 1, started=3.0, served_name=row.lora_name)
    (report,) = join([life], [row, echoed, agreed])
    assert report.mismatches == (
        f"request s-1 (turn 1): the engine echoed adapter agent@someone-else, not {row.lora_name}",
    )


def test_a_generation_started_after_the_release_is_a_mismatch_naming_the_release() -> None:
    life = _life("s", 1, bound_at=0.0, released_at=10.0, released_seq=42, cause="idle")
    at_release = _row("s", 0, 1, started=10.0)
    late = _row("s", 1, 1, started=10.25)
    (report,) = join([life], [at_release, late])
    assert report.mismatches == (
        "request s-1 (turn 1) started 0.250s after s was released (idle, seq 42): "
        "no binding held v1",
    )


def test_a_generation_of_a_life_never_bound_is_a_mismatch_of_its_own() -> None:
    never = _life("ghost", None)
    row = _row("ghost", 3, 5, started=1.0, served_name="agent@x")
    (report,) = join([never], [row])
    assert report.mismatches == (
        "request ghost-3 (turn 3) ran on v5 but the log never bound ghost",
    )


# --- audit_log on the fault run's log -----------------------------------------------------------


def _audit(log: Path, **options: Any) -> Audited:
    return anyio.run(functools.partial(audit_log, log, **options))


def test_a_provenance_file_that_cannot_be_read_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ToolError) as caught:
        load_provenance(tmp_path)  # a directory
    assert caught.value.exit_code == Exit.FAILED
    assert caught.value.message.startswith(f"{tmp_path}: cannot read: [Errno 21] Is a directory")


def test_the_audit_says_which_file_its_generations_came_from(
    fault_log: Path, tmp_path: Path
) -> None:
    file = tmp_path / "rows.jsonl"
    file.write_bytes(encode_rows([_row("s-b", 0, 1, started=1003.0)]))
    audited = _audit(fault_log, sessions=["s-b"], provenance=file)
    assert (audited.provenance, audited.note) == (str(file), None)


def test_no_store_beside_the_log_is_a_note_naming_where_it_looked(fault_log: Path) -> None:
    audited = _audit(fault_log, sessions=["s-b"])
    assert audited.provenance is None
    assert audited.note == (
        f"no provenance store beside {fault_log} (looked for {provenance_location(fault_log)}): "
        "generations are not shown; name a JSON-lines file with --provenance"
    )


def test_progress_is_reported_every_so_many_records_and_at_the_end(
    fault_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "_EVERY", 5)
    seen: list[tuple[int, int]] = []
    _audit(fault_log, progress=lambda done, last: seen.append((done, last)))
    last = seen[-1][0]
    assert last >= 10
    assert seen == [(seq, last) for seq in range(5, last + 1, 5)] + [(last, last)]


def test_a_damaged_record_fails_the_audit_naming_the_log(fault_log: Path) -> None:
    tamper.flip_payload_byte(fault_log, 3)
    with pytest.raises(ToolError) as caught:
        _audit(fault_log)
    assert caught.value.exit_code == Exit.TAMPERED
    assert caught.value.message.startswith(f"{fault_log}: CORRUPT_RECORD: ")
    assert caught.value.seq == 3


def test_a_row_beside_the_log_that_is_not_a_row_fails_naming_the_store(fault_log: Path) -> None:
    async def store() -> None:
        async with open_provenance(fault_log) as beside:
            await StoreSink(beside).write([_row("s-b", 0, 1, started=1003.0)])

    anyio.run(store)
    with closing(sqlite3.connect(provenance_location(fault_log))) as conn:
        conn.execute("UPDATE provenance SET body = ?", (b"not a row",))
        conn.commit()
    with pytest.raises(ToolError) as caught:
        _audit(fault_log, sessions=["s-b"])
    assert caught.value.exit_code == Exit.TAMPERED
    assert caught.value.message.startswith(
        f"{provenance_location(fault_log)}: CORRUPT_RECORD: provenance row 1 is not a row: "
    )


def test_generations_of_a_session_the_log_never_knew_have_a_life_of_no_owner(
    fault_log: Path, tmp_path: Path
) -> None:
    file = tmp_path / "rows.jsonl"
    file.write_bytes(encode_rows([_row("ghost", 0, 1, started=1003.0)]))
    (report,) = _audit(fault_log, sessions=["ghost"], provenance=file).reports
    assert report.audit == SessionAudit(session="ghost", owner="")
