"""The forensic commands (verify, replay, audit) never write: not one byte of the log changes.

Found by an adversarial pass; before the fix, on a DELETE-journal copy they rewrote header
bytes 18-19 (the store's writer switched it to WAL); on a log with an un-checkpointed ``-wal`` they
checkpointed it and deleted ``-wal``/``-shm``; on a log whose main file was truncated while its
``-wal`` held every event, SQLite deleted the ``-wal`` (the evidence); on a read-only mount the
exit codes were wrong. Each layout below is read by every read command, and the sha256 of every
file of the log (main, ``-wal``, ``-shm``, ``-journal``) is compared before and after.

``status`` reads a running service over HTTP, never a file, so it has no place here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from tests.tools.conftest import Cli, console_script, script_env
from tools.exitcodes import Exit

READS: list[list[str]] = [
    ["verify"],
    ["verify", "--deep"],
    ["verify", "--json"],
    ["replay"],
    ["replay", "--seq", "10"],
    ["replay", "--incidents", "--version", "1", "--engine", "e0", "--json"],
    ["audit", "--all"],
]
_SUFFIXES = ("", "-wal", "-shm", "-journal")


def files_of(log: Path) -> dict[str, str]:
    """sha256 of every file of the log, and which exist."""
    out: dict[str, str] = {}
    for suffix in _SUFFIXES:
        f = Path(f"{log}{suffix}")
        if f.exists():
            out[suffix or "main"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return {**out, "_listing": ",".join(sorted(p.name for p in log.parent.iterdir()))}


def _crash_child(log: Path, body: str) -> None:
    """Run ``body`` on a plain sqlite3 connection ``c`` in a child that dies without closing
    (``os._exit``): what a writer killed mid-run leaves behind."""
    code = (
        "import os, sqlite3\n"
        f"c = sqlite3.connect({str(log)!r}, isolation_level=None)\n"
        f"{body}\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def make_layout(kind: str, master: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "fault.db"
    shutil.copyfile(master, log)
    if kind == "wal":  # as the ledger leaves it when it closes: WAL mode, checkpointed
        assert log.read_bytes()[18:20] == b"\x02\x02"
    elif kind == "delete":  # a copy converted to a rollback journal (bytes 18-19 = 1)
        with closing(sqlite3.connect(log)) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")
        assert log.read_bytes()[18:20] == b"\x01\x01"
    elif kind == "hot-journal":  # a DELETE-mode writer killed mid-transaction
        with closing(sqlite3.connect(log)) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")
        _crash_child(
            log,
            "c.execute('PRAGMA cache_size = 1')\nc.execute('BEGIN')\n"
            "c.execute('DELETE FROM events WHERE seq > 5')\n"
            "c.execute('INSERT INTO snapshots VALUES (?, ?, zeroblob(200000))', ('x', 1))",
        )
        assert Path(f"{log}-journal").stat().st_size > 0
    elif kind in ("dirty-wal", "truncated-main"):
        # every page rewritten into the -wal and never checkpointed (the writer died)
        _crash_child(log, "c.execute('PRAGMA wal_autocheckpoint = 0')\nc.execute('VACUUM')")
        assert Path(f"{log}-wal").stat().st_size > log.stat().st_size
        if kind == "truncated-main":
            os.truncate(log, 0)
    else:
        raise AssertionError(kind)
    return log


LAYOUTS = ["wal", "delete", "hot-journal", "dirty-wal", "truncated-main"]


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest, fault_log_master: Path, tmp_path: Path) -> Path:
    return make_layout(request.param, fault_log_master, tmp_path / request.param)


def _expected(log: Path) -> int:
    return int(Exit.CORRUPT) if log.parent.name == "truncated-main" else 0


def test_read_commands_never_change_a_byte_of_the_log(cli: Cli, layout: Path) -> None:
    before = files_of(layout)
    for args in READS:
        result = cli(args[0], layout, *args[1:])
        assert result.returncode == _expected(layout), (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
        assert files_of(layout) == before, f"{args} changed the log"


def test_a_truncated_main_with_a_full_wal_is_reported_and_the_wal_kept(
    cli: Cli, fault_log_master: Path, tmp_path: Path
) -> None:
    """SQLite deletes a ``-wal`` whose main file is empty, even on a read-only connection:
    the tools must say so and touch nothing, never "repair" it into an empty ledger."""
    log = make_layout("truncated-main", fault_log_master, tmp_path / "t")
    wal = Path(f"{log}-wal").read_bytes()
    result = cli("verify", log)
    assert result.returncode == Exit.CORRUPT
    assert "main file is empty (0 bytes) but its -wal holds" in result.stdout
    assert Path(f"{log}-wal").read_bytes() == wal and log.stat().st_size == 0


def test_a_hot_journal_is_rolled_back_in_a_private_copy_only(
    cli: Cli, fault_log_master: Path, tmp_path: Path
) -> None:
    """The committed state (82 events) is what the tools see; the interrupted transaction
    stays in the original ``-journal`` for whoever investigates."""
    log = make_layout("hot-journal", fault_log_master, tmp_path / "h")
    result = cli("verify", log, "--json")
    assert result.returncode == 0 and '"records":82' in result.stdout
    assert Path(f"{log}-journal").exists()


class _Opens:
    """Every ``open``/``sqlite3.connect`` of this process, from Python's audit hooks (a hook
    cannot be removed, so it records only while ``on``)."""

    on = False
    seen: list[tuple[str, str, object]] = []

    @classmethod
    def hook(cls, event: str, args: tuple[object, ...]) -> None:
        if cls.on and event in ("open", "sqlite3.connect"):
            cls.seen.append((event, str(args[0]), args[1:] if event == "open" else None))


_hooked = False


@pytest.fixture
def opens() -> Iterator[type[_Opens]]:
    global _hooked
    if not _hooked:
        sys.addaudithook(_Opens.hook)
        _hooked = True
    _Opens.seen.clear()
    _Opens.on = True
    try:
        yield _Opens
    finally:
        _Opens.on = False


def test_read_commands_open_the_evidence_read_only(
    cli: Cli, layout: Path, opens: type[_Opens]
) -> None:
    """Root ignores file modes, so a ``chmod`` cannot prove a command does not write; this
    does: every Python ``open`` of a file of the log is read-only, and every SQLite
    connection to it is a ``mode=ro`` URI (a private copy elsewhere may be settled)."""
    folder = str(layout.parent)
    for args in READS:
        cli(args[0], layout, *args[1:])
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    checked = 0
    for event, target, rest in opens.seen:
        if folder not in target:
            continue
        checked += 1
        if event == "sqlite3.connect":
            assert target.startswith("file:") and "mode=ro" in target, target
        else:
            assert isinstance(rest, tuple)
            mode, flags = rest[0], int(rest[1])
            assert (mode is None or set(str(mode)) <= set("rbt")) and not (flags & writes), (
                target,
                mode,
                flags,
            )
    assert checked or layout.parent.name == "truncated-main"  # refused before any open


def _ro_mount_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --bind / /mnt && mount -o remount,ro,bind /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _ro_mount_available(), reason="needs unshare -m and mount (root)")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_read_commands_work_on_a_read_only_mount(
    fault_log_master: Path, tmp_path: Path, kind: str
) -> None:
    """A real read-only file system: a private mount namespace (``unshare -m``) bind-mounts the
    log's folder read-only over itself, and the console script runs inside it. Exit codes as
    on a writable disk (before: 6 or 1), and nothing changed."""
    log = make_layout(kind, fault_log_master, tmp_path / kind)
    before = files_of(log)
    folder = str(log.parent)
    for args in (["verify", "--json"], ["replay"], ["audit", "--all"]):
        command = " ".join(
            [*console_script(), *args[:1], str(log), *args[1:]]
        )  # paths from tmp_path: no spaces
        script = (
            f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} && "
            f"! touch {folder}/probe 2>/dev/null && exec {command}"
        )
        result = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env=script_env(),
        )
        assert result.returncode == _expected(log), (kind, args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
    assert files_of(log) == before


def test_a_live_writer_is_read_through_sqlite_and_left_alone(
    cli: Cli, fault_log_master: Path, tmp_path: Path
) -> None:
    """Another process has the log open in WAL mode (its lock on the ``-shm`` says so): the
    tools read through SQLite's own protocol with a read-only connection, which never
    checkpoints or deletes; the main file and the ``-wal`` stay as they are (the ``-shm`` is
    the writer's working memory)."""
    log = make_layout("dirty-wal", fault_log_master, tmp_path / "live")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            f"c = sqlite3.connect({str(log)!r})\n"
            "c.execute('SELECT count(*) FROM events').fetchall()\n"
            "print('open', flush=True)\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "open\n"
        main, wal = log.read_bytes(), Path(f"{log}-wal").read_bytes()
        result = cli("verify", log)
        assert result.returncode == 0, result.stdout
        assert log.read_bytes() == main and Path(f"{log}-wal").read_bytes() == wal
    finally:
        child.kill()
        child.wait()
