"""kill -9 at many points of a log's life (SQLite, and PostgreSQL on a real server): no
acknowledged event is ever lost.

A child process (``crash_child``) appends with several concurrent appenders and prints each
event only after its append returned. The test SIGKILLs it at a random point (during open,
just after, after a few or many acknowledgements, alternating FULL and NORMAL), or the child
kills itself inside a write statement after letting every answered appender print (so a
store that answers before its COMMIT loses an acknowledged event every such time), reaps it,
and checks the file as the kill left it, before the next life: it opens (integrity and tail
checks), every acknowledged seq holds the acknowledged event id, there are no holes
(count == max(seq)), and the whole chain verifies.
The same file is reused, so every run also proves that a recovered log can be continued.
"""

from __future__ import annotations

import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import anyio
import asyncpg

from evlog.stores import is_shared, open_store
from tests.support.fixtures import run_blocking
from tests.support.paths import REPO

ROOT = REPO
STARTUP_TIMEOUT_S = 30.0


class _Lines:
    """Complete lines read from a child's stdout, with a deadline (never blocks forever)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._buf = b""
        self.lines: list[str] = []

    def pump(self, timeout: float) -> bool:
        """Read what is available within ``timeout``; False at end of stream."""
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return True
        chunk = os.read(self._fd, 65536)
        if not chunk:
            return False
        *complete, self._buf = (self._buf + chunk).split(b"\n")
        self.lines += [line.decode() for line in complete]
        return True

    def drain(self) -> None:
        """After the child died: whatever it wrote before dying is acknowledged too."""
        while self.pump(1.0):
            pass


def _run_and_kill(
    location: str, synchronous: str, run: int, rng: random.Random, stderr_path: Path
) -> list[str]:
    inside_a_write = run % 4 == 1
    target = rng.choice([0, 1, rng.randint(2, 60), rng.randint(60, 1500)])
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.evlog.crash_child",
                location,
                synchronous,
                "4",
                str(run),
                str(target + 1 if inside_a_write else 0),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        lines = _Lines(proc)
        if inside_a_write:
            # the child kills itself once it acknowledged ``target + 1`` events
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while lines.pump(0.5):  # keep its pipe drained until it dies
                assert time.monotonic() < deadline, stderr_path.read_text()
        elif run % 4 == 3:
            # anywhere from interpreter start-up, through open, to the first thousands of events
            time.sleep(rng.uniform(0.02, 0.5))
        else:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while len(lines.lines) < target + 1:  # +1: the "open" line
                assert time.monotonic() < deadline, stderr_path.read_text()
                assert lines.pump(0.5), "child exited:\n" + stderr_path.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        lines.drain()
        assert proc.returncode == -signal.SIGKILL, stderr_path.read_text()
        return lines.lines
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


_OTHER_BACKENDS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


def _stored_ids(location: str) -> dict[int, str]:
    if not is_shared(location):
        conn = sqlite3.connect(location)
        try:
            return {seq: eid.hex() for seq, eid in conn.execute("SELECT seq, event_id FROM events")}
        finally:
            conn.close()

    async def fetch() -> dict[int, str]:
        conn = await asyncpg.connect(location)
        try:
            # The killed client's server backends may still be finishing a COMMIT they had
            # received: rows can land after the kill. Read once they are gone, or the count
            # read here and the store opened next disagree.
            with anyio.fail_after(60):
                while await conn.fetchval(_OTHER_BACKENDS):  # noqa: ASYNC110 -- no event to await
                    await anyio.sleep(0.05)
            rows = await conn.fetch("SELECT seq, event_id FROM loraledger_events")
            return {seq: eid.hex() for seq, eid in rows}
        finally:
            await conn.close()

    return run_blocking(fetch)


def _check(location: str, acked: dict[int, str]) -> int:
    stored = _stored_ids(location)
    count = len(stored)
    assert count == max(stored, default=0), "a hole in the seqs"
    lost = {seq: eid for seq, eid in acked.items() if stored.get(seq) != eid}
    assert not lost, f"acknowledged but lost or changed: {sorted(lost)[:10]}"

    async def verify() -> None:
        async with open_store(location) as store:
            assert store.last_seq == count
            report = await store.verify()
            assert report.ok and report.records == count, report

    anyio.run(verify)
    return count


def _kill_many_times(location: str, modes: tuple[str, ...], kills: int, tmp_path: Path) -> None:
    rng = random.Random(20240611)
    acked: dict[int, str] = {}
    grew = 0
    for run in range(kills):
        synchronous = modes[run % len(modes)]
        lines = _run_and_kill(location, synchronous, run, rng, tmp_path / f"stderr-{run}.txt")
        for line in lines:
            if line.startswith("open "):
                # the reopened log starts at or after everything acknowledged so far
                assert int(line.split()[1]) >= max(acked, default=0)
                continue
            seq, eid = line.split()
            assert int(seq) not in acked, f"seq {seq} acknowledged twice"
            acked[int(seq)] = eid
        before = grew
        grew = _check(location, acked)
        assert grew >= before
        print(f"run {run} {synchronous}: {len(lines)} lines, {len(acked)} acked, {grew} stored")
    assert len(acked) > kills, "the children acknowledged almost nothing: the test proved little"


def test_acknowledged_events_survive_kill_9(tmp_path: Path, slow: bool) -> None:
    _kill_many_times(str(tmp_path / "crash.db"), ("FULL", "NORMAL"), 100 if slow else 20, tmp_path)


def test_acknowledged_events_survive_kill_9_on_postgres(
    postgres_url: str, tmp_path: Path, slow: bool
) -> None:
    """The same kills with the log on a PostgreSQL server (a client killed mid-group: the
    server rolls back an open transaction, or commits a statement it already had)."""
    _kill_many_times(postgres_url, ("FULL",), 100 if slow else 20, tmp_path)
