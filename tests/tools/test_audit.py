"""``loraledger audit`` on the fault run, joined with its provenance: the store beside the log,
or a file named with ``--provenance``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from evlog.provenance_store import open_provenance
from publisher.gateway.provenance import ProvenanceRow, StoreSink, encode_rows
from tests.support.ledger import digest
from tests.tools.conftest import Cli
from tools.exitcodes import Exit


def _row(
    session: str, turn: int, version_id: int, *, started: float, **over: object
) -> ProvenanceRow:
    fields: dict[str, object] = dict(
        session=session,
        turn=turn,
        engine="e0",
        incarnation="e0-i1",
        version_id=version_id,
        lora_name=f"agent@dep-{version_id}-{digest(version_id)[:16]}",
        digest=digest(version_id),
        bound_revision=version_id,
        head_revision=version_id,
        head_revision_done=version_id,
        request_id=f"{session}-{turn}",
        prompt_tokens=12,
        completion_tokens=8,
        cached_tokens=0,
        finish_reason="length",
        started_at=started,
        finished_at=started + 0.5,
        gateway="g0",
    )
    fields.update(over)
    return ProvenanceRow(**fields)  # type: ignore[arg-type]


def _lines(stdout: str) -> list[dict[str, Any]]:  # JSON lines
    return [json.loads(line) for line in stdout.splitlines()]


def test_a_session_history_with_its_generations(cli: Cli, fault_log: Path, tmp_path: Path) -> None:
    prov = tmp_path / "provenance.jsonl"
    prov.write_bytes(
        encode_rows(
            [
                _row("s-b", 1, 1, started=1015.0, head_revision=2, head_revision_done=2),
                _row("s-b", 0, 1, started=1003.0),
                _row("s-other", 0, 1, started=1003.0),
            ]
        )
    )
    result = cli("audit", fault_log, "--session", "s-b", "--provenance", prov, "--json")
    assert result.returncode == 0, result.stderr
    (line,) = _lines(result.stdout)
    assert (line["row"], line["session"], line["owner"], line["version_id"]) == (
        "session",
        "s-b",
        "w1",
        1,
    )
    assert (line["digest"], line["revision"], line["cause"]) == (digest(1), 1, "closed")
    assert (line["bound_at"], line["released_at"]) == (1002.0, 1100.0)
    facts = [(f["what"], f["during"]) for f in line["version_facts"]]
    assert ("retired", True) in facts and ("reclaimed", False) in facts
    turns = [g["turn"] for g in line["generations"]]
    assert turns == [0, 1]  # ordered by turn, the other session's row is not attached
    assert line["mismatches"] == []

    human = cli("audit", fault_log, "--session", "s-b", "--provenance", prov)
    assert human.returncode == 0
    out = human.stdout
    assert "session s-b (owner w1) -> v1" in out
    assert "while bound" in out and "RELEASED" in out and "turn 1 on e0 v1" in out
    assert "staleness 1" in out  # turn 1 ran one publication behind the default


def test_a_generation_on_another_version_is_a_mismatch(
    cli: Cli, fault_log: Path, tmp_path: Path
) -> None:
    prov = tmp_path / "provenance.jsonl"
    prov.write_bytes(encode_rows([_row("s-a", 0, 2, started=1012.0, bound_revision=1)]))
    result = cli("audit", fault_log, "--session", "s-a", "--provenance", prov)
    assert result.returncode == Exit.FAILED
    assert "MISMATCH" in result.stdout and "version 2 served, session bound to 1" in result.stdout
    assert "digest" in result.stdout


def test_an_engine_echoing_another_adapter_is_a_mismatch(
    cli: Cli, fault_log: Path, tmp_path: Path
) -> None:
    prov = tmp_path / "provenance.jsonl"
    wrong = f"agent@dep-2-{digest(2)[:16]}"
    prov.write_bytes(encode_rows([_row("s-b", 0, 1, started=1003.0, served_name=wrong)]))
    result = cli("audit", fault_log, "--session", "s-b", "--provenance", prov)
    assert result.returncode == Exit.FAILED
    assert f"the engine echoed adapter {wrong}" in result.stdout


@pytest.mark.parametrize(
    ("session", "owner", "cause"), [("s-b", "w1", "closed"), ("s-c", "w2", "lease_expired")]
)
def test_a_generation_after_the_release_is_a_mismatch(
    cli: Cli, fault_log: Path, tmp_path: Path, session: str, owner: str, cause: str
) -> None:
    """A turn served on a binding the ledger had already released (a gateway that missed its
    lease's expiry, a client going on after close) ran on a version nothing held: it may have
    been reclaimed under it. Was reported clean: the rows matched the released binding."""
    (life,) = _lines(cli("audit", fault_log, "--session", session, "--json").stdout)
    assert (life["owner"], life["cause"]) == (owner, cause)
    released_at = life["released_at"]
    on_time = _row(session, 0, 1, started=life["bound_at"] + 0.5)
    late = _row(session, 1, 1, started=released_at + 2.0)
    prov = tmp_path / "provenance.jsonl"
    prov.write_bytes(encode_rows([on_time, late]))
    result = cli("audit", fault_log, "--session", session, "--provenance", prov, "--json")
    assert result.returncode == Exit.FAILED, result.stdout
    (line,) = _lines(result.stdout)
    assert [g["turn"] for g in line["generations"]] == [0, 1]  # both attached to this life
    (mismatch,) = line["mismatches"]
    assert mismatch.startswith(f"request {session}-1 (turn 1) started 2.000s after {session}")
    assert f"({cause}, seq {life['released_seq']})" in mismatch, mismatch
    prov.write_bytes(encode_rows([on_time]))  # the turn before the release alone: clean
    clean = cli("audit", fault_log, "--session", session, "--provenance", prov)
    assert clean.returncode == 0, clean.stdout


def test_by_owner_all_and_lease_release(cli: Cli, fault_log: Path) -> None:
    by_owner = _lines(cli("audit", fault_log, "--owner", "w2", "--json").stdout)
    assert [(r["session"], r["cause"]) for r in by_owner] == [("s-c", "lease_expired")]
    assert isinstance(by_owner[0]["lease_expired_seq"], int)
    everyone = _lines(cli("audit", fault_log, "--all", "--json").stdout)
    assert [r["session"] for r in everyone] == ["s-a", "s-b", "s-c", "s-d"]
    assert everyone[-1]["released_seq"] is None
    human = cli("audit", fault_log, "--owner", "w2")
    assert "owner lease expired at seq" in human.stdout
    assert "still bound at the end of the log" in cli("audit", fault_log, "--session", "s-d").stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ((), Exit.USAGE, "say which sessions"),
        (("--all", "--owner", "w1"), Exit.USAGE, "--all audits every session"),
        (("--session", "s-nope"), Exit.FAILED, "no session matches (s-nope)"),
        (("--session", "s-a", "--provenance", "/nonexistent.jsonl"), Exit.MISSING, "no such"),
    ],
)
def test_refusals(
    cli: Cli, fault_log: Path, args: tuple[str, ...], code: int, message: str
) -> None:
    result = cli("audit", fault_log, *args)
    assert result.returncode == code
    assert message in result.stderr


def test_a_torn_provenance_file_is_refused(cli: Cli, fault_log: Path, tmp_path: Path) -> None:
    prov = tmp_path / "provenance.jsonl"
    prov.write_bytes(encode_rows([_row("s-a", 0, 1, started=1003.0)]) + b'{"session": "s-a", "tu')
    result = cli("audit", fault_log, "--session", "s-a", "--provenance", prov)
    assert result.returncode == Exit.CORRUPT
    assert "line 2" in result.stderr


def test_generations_of_a_session_the_log_never_knew_are_a_mismatch(
    cli: Cli, fault_log: Path, tmp_path: Path
) -> None:
    """Rows of a session absent from the log were dropped: ``audit --all --provenance`` said
    clean (exit 0) and ``--session ghost`` "no session matches", though "a session never
    bound" is a mismatch."""
    prov = tmp_path / "provenance.jsonl"
    prov.write_bytes(
        encode_rows([_row("s-b", 0, 1, started=1003.0), _row("ghost", 0, 1, started=1004.0)])
    )
    everyone = cli("audit", fault_log, "--all", "--provenance", prov, "--json")
    assert everyone.returncode == Exit.FAILED, everyone.stdout
    lines = {line["session"]: line for line in _lines(everyone.stdout)}
    assert lines["s-b"]["mismatches"] == []
    assert lines["ghost"]["mismatches"] == [
        "request ghost-0 (turn 0) ran on v1 but the log never bound ghost"
    ]
    assert [g["turn"] for g in lines["ghost"]["generations"]] == [0]

    one = cli("audit", fault_log, "--session", "ghost", "--provenance", prov)
    assert one.returncode == Exit.FAILED
    assert "ghost: not in the log" in one.stdout and "MISMATCH" in one.stdout
    by_owner = cli("audit", fault_log, "--owner", "w1", "--provenance", prov, "--json")
    assert "ghost" not in {line["session"] for line in _lines(by_owner.stdout)}
    assert cli("audit", fault_log, "--session", "ghost").returncode == Exit.FAILED  # no rows


def _store_beside(log: Path, rows: list[ProvenanceRow]) -> None:
    """Rows in the store beside ``log``, as the ledger's process keeps them."""

    async def store() -> None:
        async with open_provenance(log) as beside:
            await StoreSink(beside).write(rows)

    anyio.run(store)


def test_generations_come_from_the_store_beside_the_log_without_naming_a_file(
    cli: Cli, fault_log: Path
) -> None:
    """Whichever process served them, the rows are beside the log: no ``--provenance``. A
    mismatch is found there as in a file."""
    _store_beside(
        fault_log,
        [
            _row("s-b", 1, 1, started=1015.0, gateway="gw-a"),
            _row("s-b", 0, 1, started=1003.0, gateway="openai-serve"),
            _row("s-a", 0, 2, started=1012.0, bound_revision=1),
        ],
    )
    result = cli("audit", fault_log, "--session", "s-b", "--json")
    assert result.returncode == 0, result.stderr
    (line,) = _lines(result.stdout)
    assert [(g["turn"], g["gateway"]) for g in line["generations"]] == [
        (0, "openai-serve"),
        (1, "gw-a"),
    ]
    assert "note" not in result.stderr
    wrong = cli("audit", fault_log, "--session", "s-a")
    assert wrong.returncode == Exit.FAILED and "version 2 served" in wrong.stdout
    quiet = cli("audit", fault_log, "--session", "s-c")  # in the store's reach, no rows
    assert "no generations of s-c in" in quiet.stdout and "provenance.sqlite" in quiet.stdout


def test_no_store_beside_the_log_is_said_plainly(cli: Cli, fault_log: Path) -> None:
    """Not a session shown without generations and nothing else: the audit says where it
    looked and how to name a file instead."""
    result = cli("audit", fault_log, "--session", "s-b")
    assert result.returncode == 0
    said = " ".join(result.stderr.split())
    assert "no provenance store beside" in said and "--provenance" in said, result.stderr
