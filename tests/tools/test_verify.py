"""``loraledger verify`` on a real log, and on every way a log file goes bad.

Each damaged file must be named with its own exit code and, where a record is to blame, the
first bad seq; none may produce a traceback, and verify must never modify what it inspects.
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from evlog.events import SessionBound
from tests.tools import tamper
from tests.tools.conftest import Cli, run_script
from tools.exitcodes import Exit


def _verdict(cli: Cli, log: Path) -> tuple[int, dict[str, object]]:
    result = cli("verify", log, "--json")
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    report: dict[str, object] = json.loads(lines[0])
    assert report["row"] == "verify"  # every --json row names its kind
    return result.returncode, report


def _seq_of(log: Path, type_name: str, nth: int = 0) -> int:
    with closing(sqlite3.connect(log)) as conn:
        rows = conn.execute("SELECT seq FROM events WHERE type = ? ORDER BY seq", (type_name,))
        seqs: list[int] = [r[0] for r in rows]
        return seqs[nth]


def test_a_good_log_verifies(cli: Cli, fault_log: Path) -> None:
    code, report = _verdict(cli, fault_log)
    assert code == 0 and report["ok"] is True
    assert report["records"] == report["last_seq"] == 82
    kinds = [i["kind"] for i in report["incidents"]]  # type: ignore[attr-defined]
    assert kinds == ["adapter_lost", "adapter_lost", "engine_suspended"]
    assert len(str(report["head_hash"])) == 64
    human = cli("verify", fault_log, "--deep")
    assert human.returncode == 0 and "82 records, chain intact" in human.stdout


def test_verify_lists_the_engine_health_incidents_of_an_intact_log(
    cli: Cli, health_log: Path
) -> None:
    """Lost adapters and suspensions are no corruption, but whoever checks a log sees them."""
    code, report = _verdict(cli, health_log)
    assert code == 0 and report["ok"] is True
    incidents = report["incidents"]
    assert isinstance(incidents, list)
    rows = [(i["kind"], i["subject"], i["resolved"], i["resolution"]) for i in incidents]
    assert rows == [
        ("adapter_lost", "e1", True, "reloaded under its name after the engine restarted"),
        ("engine_suspended", "e1", True, "repaired: holds exactly the needed versions"),
        ("engine_suspended", "e2", True, "removed by an operator"),
        ("engine_suspended", "e0", False, "still suspended"),
    ]
    assert incidents[0]["seqs"][0] == _seq_of(health_log, "AdapterLost")
    human = cli("verify", health_log)
    assert human.returncode == 0
    out = " ".join(human.stdout.split())
    assert "chain intact" in out and "4 engine-health incidents" in out
    # table cells wrap: single-line cells only
    for text in ("adapter_lost", "engine_suspended", "removed by an operator", "still suspended"):
        assert text in out, text


def test_a_flipped_payload_byte_is_tampering_at_that_seq(cli: Cli, fault_log: Path) -> None:
    bad = _seq_of(fault_log, "SessionBound", 1)
    tamper.flip_payload_byte(fault_log, bad)
    code, report = _verdict(cli, fault_log)
    assert code == Exit.TAMPERED
    assert (report["first_bad_seq"], report["code"], report["stage"]) == (
        bad,
        "CORRUPT_RECORD",
        "chain",
    )
    assert report["last_seq"] == bad - 1  # the verified prefix
    human = cli("verify", fault_log)
    assert human.returncode == Exit.TAMPERED
    assert f"at seq {bad}" in human.stdout and "altered" in human.stdout


@pytest.mark.parametrize(
    ("rehash", "expected_code"), [(False, "CORRUPT_RECORD"), (True, "CHAIN_BROKEN")]
)
def test_a_rewritten_prev_hash_is_named(
    cli: Cli, fault_log: Path, rehash: bool, expected_code: str
) -> None:
    bad = 30
    tamper.rewrite_prev_hash(fault_log, bad, rehash=rehash)
    code, report = _verdict(cli, fault_log)
    assert (code, report["first_bad_seq"], report["code"]) == (Exit.TAMPERED, bad, expected_code)


def test_a_tampered_tail_is_refused_at_open(cli: Cli, fault_log: Path) -> None:
    tamper.flip_payload_byte(fault_log, 82)
    code, report = _verdict(cli, fault_log)
    assert (code, report["first_bad_seq"], report["stage"]) == (Exit.TAMPERED, 82, "open")


def test_a_reforged_chain_is_caught_by_the_invariant_replay(cli: Cli, fault_log: Path) -> None:
    """Someone rewrote history and recomputed every hash: the chain verifies, the replay does
    not (a session bound to a version that did not exist yet)."""
    bad = _seq_of(fault_log, "SessionBound", 0)
    tamper.reforge(
        fault_log, bad, SessionBound(session="s-a", owner="w1", version_id=4, revision=1)
    )
    code, report = _verdict(cli, fault_log)
    assert code == Exit.INVARIANT
    assert (report["stage"], report["first_bad_seq"]) == ("invariants", bad)
    assert "SessionBound" in str(report["problem"])


def test_a_reforged_last_record_is_caught_by_the_invariant_replay(
    cli: Cli, fault_log: Path
) -> None:
    """The invariant replay applies every record up to the last one included: a forgery of
    the newest record (the one a tamperer most likely rewrites) is caught at its seq."""
    with closing(sqlite3.connect(fault_log)) as conn:
        (last,) = conn.execute("SELECT max(seq) FROM events").fetchone()
    tamper.reforge(
        fault_log, last, SessionBound(session="s-late", owner="w1", version_id=99, revision=1)
    )
    code, report = _verdict(cli, fault_log)
    assert (code, report["stage"], report["first_bad_seq"]) == (Exit.INVARIANT, "invariants", last)


def test_a_reforged_but_applicable_event_breaks_a_named_invariant(
    cli: Cli, fault_log: Path
) -> None:
    """A binding forged onto v3 while it is still LOADING can be applied, but it breaks "only
    serving versions are bound" exactly at that seq."""
    claimed = _seq_of(fault_log, "VersionAllocated", 2) + 2  # v3: allocated, started, claimed
    assert _seq_of(fault_log, "TransportClaimed", 3) == claimed
    forged = SessionBound(session="s-x", owner="w1", version_id=3, revision=2)
    tamper.reforge(fault_log, claimed, forged)
    code, report = _verdict(cli, fault_log)
    assert (code, report["first_bad_seq"]) == (Exit.INVARIANT, claimed)
    assert "version 3 is LOADING with 1 sessions bound" in str(report["problem"])


def test_a_truncated_log_is_corrupt_not_tampered(cli: Cli, fault_log: Path) -> None:
    assert not Path(f"{fault_log}-wal").exists()  # the writer checkpointed: the file is whole
    size = fault_log.stat().st_size
    page = tamper.page_size(fault_log)
    cuts = {
        size - page // 2: "truncated mid-page",
        size - page: f"{size // page - 1} pages on disk, its header records {size // page}",
        50: "not even a header",
    }
    for cut, why in cuts.items():
        copy = fault_log.with_name(f"cut-{cut}.db")
        copy.write_bytes(fault_log.read_bytes())
        tamper.truncate(copy, cut)
        code, report = _verdict(cli, copy)
        assert code == Exit.CORRUPT, (cut, report)
        assert why in str(report["problem"])
        assert copy.stat().st_size == cut  # verify never "repairs" what it inspects


def test_missing_empty_and_foreign_files(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    code, report = _verdict(cli, missing)
    assert code == Exit.MISSING and "no such file" in str(report["problem"])
    assert not missing.exists()  # not created

    empty = tmp_path / "empty.db"
    empty.touch()
    assert _verdict(cli, empty)[0] == Exit.EMPTY
    assert empty.stat().st_size == 0  # not turned into a ledger

    text = tmp_path / "notes.txt"
    text.write_text("hello, not a ledger\n" * 20)
    assert _verdict(cli, text)[0] == Exit.NOT_A_LEDGER

    foreign = tmp_path / "app.sqlite"
    with closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
        conn.commit()
    before = foreign.read_bytes()
    assert _verdict(cli, foreign)[0] == Exit.NOT_A_LEDGER
    assert foreign.read_bytes() == before  # not switched to WAL, no tables added

    assert _verdict(cli, tmp_path)[0] == Exit.NOT_A_LEDGER  # a directory


def test_an_initialised_ledger_without_events_is_empty(cli: Cli, tmp_path: Path) -> None:
    import anyio

    from evlog.sqlite import SQLiteStore

    async def create() -> None:
        async with SQLiteStore.open(tmp_path / "new.db"):
            pass

    anyio.run(create)
    code, report = _verdict(cli, tmp_path / "new.db")
    assert code == Exit.EMPTY and "no events" in str(report["problem"])


def test_the_console_script_reports_without_a_traceback(fault_log: Path) -> None:
    """The real entry point, as a user runs it: one line on failure, the exit code."""
    tamper.flip_payload_byte(fault_log, 20)
    result = run_script("verify", fault_log)
    assert result.returncode == Exit.TAMPERED
    assert "at seq 20" in result.stdout and "Traceback" not in result.stderr
    missing = run_script("replay", os.fspath(fault_log) + ".missing")
    assert missing.returncode == Exit.MISSING
    assert missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_verify_json_prints_a_verdict_even_when_verify_itself_breaks(
    cli: Cli, fault_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an unexpected exception (a RecursionError on a crafted record was one) left
    ``verify --json`` with no verdict at all. A planted bug in the invariant replay must still
    give one JSON object, exit 1, stage ``internal``."""

    class Broken:
        def __init__(self, **_: object) -> None:
            raise RecursionError("planted: maximum recursion depth exceeded")

    monkeypatch.setattr("tools.verify.CheckedReplay", Broken)
    code, report = _verdict(cli, fault_log)
    assert (code, report["ok"], report["stage"]) == (Exit.FAILED, False, "internal")
    assert "RecursionError" in str(report["problem"])
