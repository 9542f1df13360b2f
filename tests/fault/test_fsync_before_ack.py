"""Power-loss durability at the system-call level: with ``synchronous=FULL`` every
acknowledged append was fsynced before it was acknowledged; with ``NORMAL`` it was not.

A kill -9 cannot show the difference (the OS still writes the page cache out), and a
fault-injecting filesystem is not available here (RELIABILITY.md, "Power loss"). What power
loss destroys is exactly what was written but not synced when the power went, so the
guarantee can be checked on the real system calls instead: the child runs under ``strace``;
for every ``ACK`` the child wrote on stdout, the last write to the WAL before it must be
followed by an ``fdatasync``/``fsync`` of the WAL that returned before the ``ACK`` was written.
One appender, so the next commit's WAL writes cannot interleave with an acknowledgement (the
group-commit path is the same code: one statement per group, synced by SQLite at COMMIT).
Then no acknowledged event can be lost by a power loss on storage that honours flushes.
``NORMAL`` must fail that check (its acknowledgements are durable only across process
crashes): the check can tell the two apart.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fault.conftest import record_figure
from tests.support.paths import REPO

ROOT = REPO
_LINE = re.compile(r"^(\d+)\s+(.*)$")
_OPEN_WAL = re.compile(r'openat\(.*"[^"]*-wal".*\)\s+=\s+(\d+)')
_CALL = re.compile(r"^(pwrite64|write|fdatasync|fsync)\((\d+)")
_RESUMED = re.compile(r"^<\.\.\. (fdatasync|fsync) resumed>.*=\s+0")


def unsynced_acks(trace: str) -> tuple[int, int]:
    """``(acknowledgements, acknowledgements not preceded by a WAL sync)`` in an strace log
    (``-f``: lines carry the thread id; a call may be split into unfinished/resumed)."""
    wal_fds: set[int] = set()
    pending_sync: dict[str, int] = {}  # thread -> fd of its unfinished sync call
    dirty = False  # the WAL was written since its last completed sync
    acks = unsynced = 0
    for raw in trace.splitlines():
        match = _LINE.match(raw)
        if match is None:
            continue
        tid, text = match.groups()
        opened = _OPEN_WAL.search(text)
        if opened:
            wal_fds.add(int(opened.group(1)))
            continue
        if _RESUMED.match(text):
            if pending_sync.pop(tid, None) in wal_fds:
                dirty = False
            continue
        call = _CALL.match(text)
        if call is None:
            continue
        name, fd = call.group(1), int(call.group(2))
        if name == "pwrite64" and fd in wal_fds:
            dirty = True
        elif name in ("fdatasync", "fsync") and fd in wal_fds:
            if "<unfinished" in text:
                pending_sync[tid] = fd
            elif text.rstrip().endswith("= 0"):
                dirty = False
        elif name == "write" and fd == 1 and '"ACK ' in text:
            acks += 1
            unsynced += dirty
    return acks, unsynced


def _traced(tmp_path: Path, synchronous: str) -> tuple[int, int]:
    trace = tmp_path / f"trace-{synchronous}.txt"
    args = [
        "strace",
        "-f",
        "-qq",
        "-o",
        str(trace),
        "-e",
        "trace=openat,pwrite64,write,fdatasync,fsync",
    ]
    child = [
        sys.executable,
        "-m",
        "tests.fault.fsync_child",
        str(tmp_path / f"{synchronous}.db"),
        synchronous,
        "1",
        "60",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*args, *child], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ACK ") == 60
    return unsynced_acks(trace.read_text())


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed here")
def test_full_syncs_every_acknowledged_append_and_normal_does_not(tmp_path: Path) -> None:
    acks, unsynced = _traced(tmp_path, "FULL")
    assert acks == 60 and unsynced == 0, (acks, unsynced)
    normal_acks, normal_unsynced = _traced(tmp_path, "NORMAL")
    assert normal_acks == 60 and normal_unsynced > 0, (normal_acks, normal_unsynced)
    record_figure(
        "acknowledged appends fsynced first",
        f"FULL {acks - unsynced}/{acks}, NORMAL {normal_acks - normal_unsynced}/{normal_acks}",
    )
