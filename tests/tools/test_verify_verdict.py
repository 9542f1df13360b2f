"""``verify``'s verdict, field by field, and what it reports while it works.

``verify --json`` is read by scripts: every field of the verdict is a promise (where, how many
records, the head hash a second copy can be compared with, the time it took, the seq to look
at). And the verdict judges exactly the records the chain check counted: a file a
writer changes meanwhile is refused, to be verified again.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from evlog.errors import LoraLedgerError
from evlog.memory import MemoryStore
from evlog.record import Record, pending
from evlog.stores import describe
from projections.incidents import EngineHealthFold
from tests.tools import tamper
from tools.exitcodes import Exit
from tools.verify import VerifyResult, _replay_checked, verify_log

pytestmark = pytest.mark.anyio

Calls = list[tuple[str, int, int]]


def _head(log: Path, upto: int | None = None) -> tuple[int, str]:
    """The seq and hash of the last record (up to ``upto``)."""
    with closing(sqlite3.connect(log)) as conn:
        seq, head = conn.execute(
            "SELECT seq, hash FROM events WHERE seq <= ? ORDER BY seq DESC", (upto or 2**62,)
        ).fetchone()
    return seq, head.hex()


async def _timed(log: Path, **options: Any) -> VerifyResult:
    """``verify_log``, checking that the time it reports is its own, in ms."""
    start = time.perf_counter()
    result = await verify_log(log, **options)
    elapsed = time.perf_counter() - start
    assert 0 < result.seconds <= round(elapsed, 3) + 0.001
    assert result.seconds == round(result.seconds, 3)
    return result


async def test_an_intact_log_gives_every_field_and_reports_each_phase(
    fault_log: Path, fault_records: list[Record], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("projections.recovery.PROGRESS_EVERY", 10)
    calls: Calls = []
    result = await _timed(fault_log, progress=lambda *call: calls.append(call))
    last, head = _head(fault_log)
    health = EngineHealthFold()
    for record in fault_records:
        health.apply(record)
    assert (result.path, result.ok, result.exit_code, result.stage) == (
        describe(fault_log),
        True,
        Exit.OK,
        "done",
    )
    assert (result.records, result.last_seq, result.head_hash) == (last, last, head)
    assert result.incidents == tuple(health.finish())
    every = [("invariants", seq, last) for seq in range(10, last + 1, 10)]
    assert calls == [("chain", 0, last), ("chain", last, last), *every, ("invariants", last, last)]
    assert (await verify_log(fault_log)).ok  # and without anyone to report to


async def test_a_broken_chain_gives_the_chains_figures_and_its_code(fault_log: Path) -> None:
    """The chain's figures stop at the last record that links: what a copy can be compared
    with up to there."""
    tamper.rewrite_prev_hash(fault_log, 20, rehash=True)  # (a bad tail is refused at open)
    result = await _timed(fault_log)
    assert (result.ok, result.stage, result.first_bad_seq) == (False, "chain", 20)
    assert (result.records, result.last_seq, result.head_hash) == (19, 19, _head(fault_log, 19)[1])
    assert result.code is not None and result.exit_code == Exit.TAMPERED
    assert result.problem and result.path == describe(fault_log)


async def test_a_broken_invariant_gives_the_logs_figures_and_the_incidents_so_far(
    fault_log: Path, fault_records: list[Record]
) -> None:
    from evlog.events import SessionBound

    last = _head(fault_log)[0]
    tamper.reforge(
        fault_log, last, SessionBound(session="s", owner="w1", version_id=99, revision=1)
    )
    head = _head(fault_log)[1]
    result = await _timed(fault_log)
    assert (result.stage, result.code, result.exit_code) == (
        "invariants",
        "INVARIANT",
        Exit.INVARIANT,
    )
    assert (result.records, result.last_seq, result.head_hash) == (last, last, head)
    assert result.first_bad_seq == last and "SessionBound" in result.problem
    before = EngineHealthFold()
    for record in fault_records[:-1]:  # every record applied before the forged one
        before.apply(record)
    assert result.incidents == tuple(before.finish())


async def test_an_empty_ledger_is_refused_at_open_naming_it(tmp_path: Path) -> None:
    from evlog.sqlite import SQLiteStore

    log = tmp_path / "empty.db"
    store = await SQLiteStore.connect(log)
    await store.close()
    result = await verify_log(log)
    assert (result.ok, result.stage, result.exit_code) == (False, "open", Exit.EMPTY)
    assert result.problem == f"{describe(log)}: the ledger holds no events"


async def test_a_log_a_writer_changes_while_it_is_verified_is_refused_to_run_again(
    fault_log: Path,
) -> None:
    """A verdict is about one state of the file: a writer that changes it between the chain
    check and the invariant replay (here: a record altered, as a tamperer would) makes the
    verdict void, said as such, never a verdict on a mix of two files."""

    def alter(phase: str, done: int, total: int) -> None:
        if (phase, done) == ("chain", total):
            tamper.flip_payload_byte(fault_log, 20)

    result = await verify_log(fault_log, progress=alter)
    assert (result.ok, result.stage, result.exit_code) == (False, "open", Exit.FAILED)
    assert "the log changed while it was read" in result.problem


async def test_the_per_session_invariants_run_at_each_record_only_when_deep(
    fault_log: Path, fault_records: list[Record]
) -> None:
    """By default the per-session invariants (O(sessions)) run once, on the final state: a
    breach the log heals later (a binding forged at a revision not yet published, released
    since) passes. ``deep`` runs them after every record and names the record that broke
    them: the cost ``--deep`` buys."""
    import msgspec

    from evlog.events import SessionBound

    first = next(r for r in fault_records if isinstance(r.event, SessionBound))
    assert isinstance(first.event, SessionBound)
    tamper.reforge(fault_log, first.seq, msgspec.structs.replace(first.event, revision=99))
    deep = await verify_log(fault_log, deep=True)
    cheap = await verify_log(fault_log)
    assert (deep.stage, deep.first_bad_seq) == ("invariants", first.seq)
    assert "bound at future revision 99" in deep.problem
    assert (cheap.ok, cheap.stage) == (True, "done")


async def _store_of(records: list[Record]) -> MemoryStore:
    store = MemoryStore()
    await store.append([pending(r.event, recorded_at=r.recorded_at) for r in records])
    return store


async def test_the_replay_judges_the_records_the_chain_check_counted_and_no_more(
    fault_records: list[Record],
) -> None:
    """A log a live writer extends (a PostgreSQL ledger in use) has more records by the time
    the replay runs: the verdict is about the records the chain check counted, so the replay
    stops at its last seq."""
    store = await _store_of(fault_records)
    seen: list[int] = []
    assert await _replay_checked(store, False, 40, None, lambda r: seen.append(r.seq)) is None
    assert seen == list(range(1, 41))


class _ChangedUnderneath(MemoryStore):
    """A store whose records change between the chain check and the replay: its iterate
    raises the store's own error at ``bad`` (what a PostgreSQL row altered meanwhile, or one
    that no longer decodes, raises). A test double: the real case needs a live database
    changed at the right moment."""

    def __init__(self, bad: int, details: dict[str, Any]) -> None:
        super().__init__()
        self.bad, self.details = bad, details

    async def iterate(self, after: int = 0, until: int | None = None) -> AsyncIterator[Record]:
        async for record in super().iterate(after, until):
            if record.seq == self.bad:
                raise LoraLedgerError("TAMPERED", f"record {self.bad} changed", **self.details)
            yield record


@pytest.mark.parametrize(("details", "seq"), [({"seq": 25}, 25), ({}, 20)])
async def test_a_store_error_during_the_replay_is_named_at_its_seq(
    fault_records: list[Record], details: dict[str, Any], seq: int
) -> None:
    """At the seq the store's error names (a read by chunks can fail on a row past the next
    one to apply), or, when it names none, at the record the replay was about to apply."""
    store = _ChangedUnderneath(20, details)
    await store.append([pending(r.event, recorded_at=r.recorded_at) for r in fault_records])
    fault = await _replay_checked(store, False, 40, None, lambda r: None)
    assert fault == (seq, "TAMPERED: record 20 changed")
