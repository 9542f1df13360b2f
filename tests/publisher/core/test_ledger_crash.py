"""Crash safety of the ledger service: SIGKILL a child process running the ledger on a SQLite
file at many points (one file, many lives), reopen, and check that every acknowledged outcome is
in the log, the chain verifies and the invariants hold at every seq.

Each life is judged against the file *as its kill left it*, read before the next life starts:
every answer it printed must be recorded there, by an event whose seq the child's store had
reported committed (``DURABLE``) before the answer was printed. So a ledger that answers
before its COMMIT fails at its first answer, whatever instant the kill lands at."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from evlog.events import (
    ControllerStarted,
    SessionBound,
    SessionReleased,
    VersionPublished,
    VersionReclaimed,
)
from evlog.record import Record
from evlog.sqlite import SQLiteStore
from projections.recovery import recover
from tests.support.paths import REPO

ROOT = REPO


Ack = tuple[list[str], int]  # (kind and fields, the last seq reported DURABLE before it)


def run_and_kill(db: Path, run_id: str, acks_before_kill: int, durable: int) -> list[Ack]:
    """Start the child, read acknowledgements until ``acks_before_kill``, SIGKILL it by PID.
    ``durable``: the records in the file when it starts (committed before any answer)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.publisher.core.crash_child", str(db), run_id],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    acks: list[Ack] = []

    def take(line: str) -> None:
        nonlocal durable
        if line.startswith("DURABLE "):
            durable = max(durable, int(line.split()[1]))
        elif line.startswith("ACK "):
            acks.append((line.split()[1:], durable))

    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while len(acks) < acks_before_kill and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if line.endswith("\n"):
                take(line)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            # Acks written before the kill but not yet read were acknowledged too; a line the
            # kill cut short (no newline yet) was never completely printed: it acknowledged
            # nothing (and its last field may be a truncated seq).
            for line in child.stdout.read().split("\n")[:-1]:
                take(line)
            child.stdout.close()
    assert acks, "the child never acknowledged anything"
    return acks


async def read_log(db: Path) -> list[Record]:
    """Every record of the file as it is now (none before the first life created it)."""
    if not await anyio.Path(db).exists():
        return []
    async with SQLiteStore.open(db) as store:
        return await store.read()


def records_it(event: object, kind: str, fields: list[str]) -> bool:
    """Whether ``event`` records the answered outcome ``kind fields... last_seq``."""
    match kind, event:
        case "open", ControllerStarted():
            return event.epoch == int(fields[0])
        case "bind", SessionBound():
            return [event.session, event.version_id] == [fields[0], int(fields[1])]
        case "release", SessionReleased():
            return event.session == fields[0]
        case "publish", VersionPublished():
            return [event.version_id, event.revision] == [int(fields[0]), int(fields[1])]
        case "reclaim", VersionReclaimed():
            return event.version_id == int(fields[0])
    return False


def judge_life(life: int, acks: list[Ack], left: list[Record]) -> None:
    """Every answer of one life against the file its kill left: recorded there, at a seq that
    was committed before the answer was printed."""
    for (kind, *fields), durable in acks:
        if kind == "refused":
            continue  # a refusal writes nothing
        seq = next((r.seq for r in left if records_it(r.event, kind, fields)), None)
        assert seq is not None, f"life {life}: answered {kind} {fields}, the file lacks it"
        assert seq <= durable, (
            f"life {life}: answered {kind} {fields} before seq {seq}, which records it, was "
            f"committed (committed then: up to seq {durable})"
        )


@pytest.mark.anyio
async def test_sigkill_at_many_points_loses_no_acknowledged_outcome(
    tmp_path: Path, slow: bool
) -> None:
    db = tmp_path / "ledger.db"
    rng = random.Random(1234)
    kills = 40 if slow else 10
    acknowledged: list[list[str]] = []
    for life in range(kills):
        durable = len(await read_log(db))
        acks = run_and_kill(db, f"r{life}", rng.randint(1, 60), durable)
        judge_life(life, acks, await read_log(db))  # before the next life touches the file
        acknowledged += [fields for fields, _ in acks]

    async with SQLiteStore.open(db) as store:
        report = await store.verify()
        assert report.ok, report
        records = await store.read()
        # Invariants after every single event (cheap) and at the end (deep).
        state = await recover(store, use_snapshot=False, check=True)
    assert state.epoch == kills  # each life opened (its first answer) and started one epoch

    bound = {
        r.event.session: r.event.version_id for r in records if isinstance(r.event, SessionBound)
    }
    released = {r.event.session for r in records if isinstance(r.event, SessionReleased)}
    published = {r.event.version_id: r.event.revision for r in records
                 if isinstance(r.event, VersionPublished)}  # fmt: skip
    reclaimed = {r.event.version_id for r in records if isinstance(r.event, VersionReclaimed)}
    last_seq = records[-1].seq
    for kind, *fields in acknowledged:
        assert int(fields[-1]) <= last_seq, (kind, fields)
        if kind == "bind":
            assert bound.get(fields[0]) == int(fields[1]), fields
        elif kind == "release":
            assert fields[0] in released, fields
        elif kind == "publish":
            assert published.get(int(fields[0])) == int(fields[1]), fields
        elif kind == "reclaim":
            assert int(fields[0]) in reclaimed, fields
    kinds = {kind for kind, *_ in acknowledged}
    assert {"bind", "release", "publish"} <= kinds  # the scenario really ran
