"""``verify`` and ``replay`` read every record a crashed writer acknowledged, including those
that exist only in its ``-wal``: a SQLite writer's commits go to the ``-wal`` first and reach
the main file only at a checkpoint, which a writer killed with -9 never runs. A copy of the main
file and its ``-wal`` (what an operator takes from a crashed host) is the whole log; a tool that
read the main file alone would show the log as it was before the crash's last commits, and
call it intact.

Real parts: the fault run's log, a real ``Ledger`` on ``SQLiteStore`` in a child process that
appends to it and is killed with SIGKILL by its PID, and the tools on a copy of what it left."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from tests.support.paths import REPO
from tests.tools.conftest import Cli

LATE_OWNERS = 3
_WRITER = """
import sys
import anyio
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger

async def main() -> None:
    async with SQLiteStore.open(sys.argv[1]) as store, Ledger.open(store) as ledger:
        for i in range(int(sys.argv[2])):
            await ledger.register_owner(f"late-{i}", ttl_s=3600.0, incarnation="one")
        print(store.last_seq, flush=True)  # each answered once durable: in the -wal
        sys.stdin.read()  # stays open (no checkpoint) until it is killed

anyio.run(main)
"""


def _crashed_writer_leaves(log: Path) -> int:
    """Have a ledger append to ``log`` and die by SIGKILL with the log open; its last
    acknowledged seq."""
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(log), str(LATE_OWNERS)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        acknowledged = int(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    return acknowledged


def _last_seq_of_main_file_alone(main: Path) -> int:
    uri = f"{main.resolve().as_uri()}?mode=ro&immutable=1"  # reads no -wal
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        (last,) = conn.execute("SELECT max(seq) FROM events").fetchone()
        return int(last)


def test_verify_and_replay_see_the_records_only_in_a_crashed_writers_wal(
    cli: Cli, fault_log: Path, tmp_path: Path
) -> None:
    before = _last_seq_of_main_file_alone(fault_log)
    acknowledged = _crashed_writer_leaves(fault_log)
    assert acknowledged >= before + LATE_OWNERS  # (and what its clock decided: an expiry)
    taken = tmp_path / "taken"
    taken.mkdir()
    copy = taken / "ledger.db"
    shutil.copyfile(fault_log, copy)
    shutil.copyfile(f"{fault_log}-wal", f"{copy}-wal")
    assert _last_seq_of_main_file_alone(copy) == before  # the new records: only in the -wal

    verified = cli("verify", copy, "--json")
    verdict = json.loads(verified.stdout)
    assert verified.returncode == 0, verified.stdout
    assert (verdict["records"], verdict["last_seq"]) == (acknowledged, acknowledged)

    replayed = cli("replay", copy, "--json")
    assert replayed.returncode == 0, replayed.stderr
    rows = [json.loads(line) for line in replayed.stdout.splitlines()]
    (state,) = [row for row in rows if row["row"] == "state"]
    assert (state["seq"], state["log_last_seq"]) == (acknowledged, acknowledged)
