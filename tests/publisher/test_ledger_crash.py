"""Crash safety of the ledger service: SIGKILL a child process running the ledger on a SQLite
file at many points (one file, many lives), reopen, and check that every acknowledged outcome is
in the log, the chain verifies and the invariants hold at every seq."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evlog.events import SessionBound, SessionReleased, VersionPublished, VersionReclaimed
from evlog.sqlite import SQLiteStore
from projections.recovery import recover

ROOT = Path(__file__).resolve().parents[2]


def run_and_kill(db: Path, run_id: str, acks_before_kill: int) -> list[list[str]]:
    """Start the child, read acknowledgements until ``acks_before_kill``, SIGKILL it by PID."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.publisher.crash_child", str(db), run_id],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    acks: list[list[str]] = []
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while len(acks) < acks_before_kill and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if line.startswith("ACK ") and line.endswith("\n"):
                acks.append(line.split()[1:])
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            # Acks written before the kill but not yet read were acknowledged too; a line the
            # kill cut short (no newline yet) was never completely printed: it acknowledged
            # nothing (and its last field may be a truncated seq).
            complete = child.stdout.read().split("\n")[:-1]
            acks.extend(line.split()[1:] for line in complete if line.startswith("ACK "))
            child.stdout.close()
    assert acks, "the child never acknowledged anything"
    return acks


@pytest.mark.anyio
async def test_sigkill_at_many_points_loses_no_acknowledged_outcome(
    tmp_path: Path, slow: bool
) -> None:
    db = tmp_path / "ledger.db"
    rng = random.Random(1234)
    kills = 40 if slow else 10
    acknowledged: list[list[str]] = []
    for life in range(kills):
        acknowledged += run_and_kill(db, f"r{life}", rng.randint(1, 60))

    async with SQLiteStore.open(db) as store:
        report = await store.verify()
        assert report.ok, report
        records = await store.read()
        # Invariants after every single event (cheap) and at the end (deep).
        state = await recover(store, use_snapshot=False, check=True)
    assert state.epoch >= kills

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
