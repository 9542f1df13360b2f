"""How the read-only tools open a log file (``tools/logfile.py``), rule by rule, on the module
itself: what :func:`preflight` refuses from the raw bytes and with which exit code, how a
file's length is checked against its header, which of the three ways a log is read
(in place and immutable, in place beside a live writer, a private copy of a dirty ``-wal`` or
``-journal``), and that a read which raced a writer is refused, never trusted.

Real parts: the fault run's log (SQLite), files written byte for byte, a child process holding
the log open as a live writer does (stopped by its PID)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from evlog.provenance_store import open_provenance, provenance_location
from evlog.sqlite import APPLICATION_ID, SQLiteStore
from tools import logfile
from tools.exitcodes import Exit, ToolError
from tools.logfile import open_elsewhere, open_log, preflight, refuse_foreign

MAGIC = b"SQLite format 3\x00"


def _refused(path: Path, code: Exit, message: str) -> None:
    with pytest.raises(ToolError) as caught:
        preflight(path)
    assert (caught.value.exit_code, caught.value.message) == (code, message)


def _header(*, page: int = 4096, pages: int = 0, counter: int = 1, valid_for: int = 1) -> bytes:
    """A SQLite header whose page size, page count and change counters are given."""
    head = bytearray(100)
    head[:16] = MAGIC
    head[16:18] = (1 if page == 65536 else page).to_bytes(2, "big")
    head[24:28] = counter.to_bytes(4, "big")
    head[28:32] = pages.to_bytes(4, "big")
    head[92:96] = valid_for.to_bytes(4, "big")
    return bytes(head)


def _file(tmp_path: Path, content: bytes, name: str = "ledger.db") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_a_missing_file_or_a_directory_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    _refused(missing, Exit.MISSING, f"{missing}: no such file (give the path of a ledger log)")
    assert not missing.exists()
    _refused(tmp_path, Exit.NOT_A_LEDGER, f"{tmp_path}: is a directory, not a ledger log")


def test_an_empty_file_is_empty_unless_its_wal_holds_pages(tmp_path: Path) -> None:
    empty = _file(tmp_path, b"")
    _refused(empty, Exit.EMPTY, f"{empty}: empty file (0 bytes): no ledger was written here")
    Path(f"{empty}-wal").write_bytes(b"")
    _refused(empty, Exit.EMPTY, f"{empty}: empty file (0 bytes): no ledger was written here")
    Path(f"{empty}-wal").write_bytes(b"w" * 33)
    _refused(
        empty,
        Exit.CORRUPT,
        f"{empty}: the main file is empty (0 bytes) but its -wal holds 33 bytes: the main file "
        "was truncated; nothing was read or changed (keep both files)",
    )
    assert Path(f"{empty}-wal").read_bytes() == b"w" * 33


def test_a_file_that_is_not_sqlite_or_cut_inside_its_header_is_named_so(tmp_path: Path) -> None:
    text = _file(tmp_path, b"hello, not a ledger\n" * 20, "notes.txt")
    _refused(text, Exit.NOT_A_LEDGER, f"{text}: not a SQLite database, so not a ledger log")
    for cut in (1, 10, 16, 99):
        short = _file(tmp_path, _header()[:cut], f"short{cut}.db")
        _refused(short, Exit.CORRUPT, f"{short}: truncated ({cut} bytes, not even a header)")


@pytest.mark.parametrize("page", [512, 1024, 4096, 65536])
def test_a_file_of_whole_pages_passes_with_any_valid_page_size(tmp_path: Path, page: int) -> None:
    path = _file(tmp_path, _header(page=page, pages=2).ljust(2 * page, b"\0"))
    assert preflight(str(path)) == path


@pytest.mark.parametrize("page", [0, 2, 256, 511, 1000, 4095, 4097, 32769])
def test_a_page_size_sqlite_never_writes_is_a_damaged_header(tmp_path: Path, page: int) -> None:
    head = bytearray(_header())
    head[16:18] = page.to_bytes(2, "big")
    path = _file(tmp_path, bytes(head).ljust(8192, b"\0"))
    _refused(path, Exit.CORRUPT, f"{path}: damaged header (page size {page})")


def test_a_file_cut_inside_a_page_is_truncated_mid_page(tmp_path: Path) -> None:
    path = _file(tmp_path, _header(page=1024).ljust(1024 + 1, b"\0"))
    _refused(
        path,
        Exit.CORRUPT,
        f"{path}: truncated mid-page (1025 bytes is not a whole number of 1024-byte pages)",
    )


def test_a_file_shorter_than_its_current_header_says_is_truncated(tmp_path: Path) -> None:
    path = _file(tmp_path, _header(page=1024, pages=3).ljust(2 * 1024, b"\0"))
    _refused(path, Exit.CORRUPT, f"{path}: truncated (2 pages on disk, its header records 3)")
    exact = _file(tmp_path, _header(page=1024, pages=3).ljust(3 * 1024, b"\0"), "exact.db")
    assert preflight(exact) == exact
    # a count that is not current (an old SQLite wrote the file) or absent is not trusted
    stale = _header(page=1024, pages=3, counter=2, valid_for=1).ljust(2 * 1024, b"\0")
    assert preflight(_file(tmp_path, stale, "stale.db")).name == "stale.db"
    none = _header(page=1024, pages=0).ljust(1024, b"\0")
    assert preflight(_file(tmp_path, none, "none.db")).name == "none.db"


def test_a_file_that_cannot_be_read_is_failed_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path, _header().ljust(4096, b"\0"))

    def denied(*args: object, **kwargs: object) -> object:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("builtins.open", denied)
    _refused(path, Exit.FAILED, f"{path}: cannot read: Permission denied")


def test_a_foreign_database_is_refused_naming_its_application_id(tmp_path: Path) -> None:
    foreign = tmp_path / "app.sqlite"
    with closing(sqlite3.connect(foreign)) as conn:
        conn.execute("PRAGMA application_id = 48879")
        conn.execute("CREATE TABLE events (name TEXT)")
        conn.commit()
    before = foreign.read_bytes()
    with pytest.raises(ToolError) as caught:
        refuse_foreign(foreign)
    assert (caught.value.exit_code, caught.value.message) == (
        Exit.NOT_A_LEDGER,
        f"{foreign}: a SQLite database, but not a loraledger log (application id 0xbeef)",
    )
    assert foreign.read_bytes() == before


def test_a_database_with_our_id_but_no_events_table_is_not_a_ledger(tmp_path: Path) -> None:
    odd = tmp_path / "odd.sqlite"
    with closing(sqlite3.connect(odd)) as conn:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("CREATE TABLE other (name TEXT)")
        conn.commit()
    with pytest.raises(ToolError) as caught:
        refuse_foreign(odd)
    assert caught.value.exit_code == Exit.NOT_A_LEDGER


def test_a_writer_may_open_nothing_an_empty_file_or_a_ledger_and_nothing_else(
    tmp_path: Path, fault_log: Path
) -> None:
    refuse_foreign(tmp_path / "new.db")
    refuse_foreign(_file(tmp_path, b"", "empty.db"))
    Path(tmp_path / "empty.db-wal").write_bytes(b"")
    refuse_foreign(tmp_path / "empty.db")
    refuse_foreign(fault_log)
    with pytest.raises(ToolError) as caught:
        refuse_foreign(tmp_path)
    assert (caught.value.exit_code, caught.value.message) == (
        Exit.NOT_A_LEDGER,
        f"{tmp_path}: is a directory, not a ledger log",
    )
    Path(tmp_path / "empty.db-wal").write_bytes(b"w" * 10)
    with pytest.raises(ToolError) as caught:
        refuse_foreign(tmp_path / "empty.db")
    assert caught.value.exit_code == Exit.CORRUPT


def test_damage_sqlite_finds_is_corrupt_and_a_bad_header_not_a_database(
    tmp_path: Path, fault_log: Path
) -> None:
    damaged = bytearray(fault_log.read_bytes())
    damaged[100:4096] = b"\xff" * (4096 - 100)  # the schema's page, past the file header
    fault_log.write_bytes(bytes(damaged))
    with pytest.raises(ToolError) as caught:
        refuse_foreign(fault_log)
    assert caught.value.exit_code == Exit.CORRUPT
    assert caught.value.message.startswith(f"{fault_log}: damaged database file (")
    assert caught.value.message.endswith("); truncated or overwritten?")
    not_a_db = _file(tmp_path, _header(page=1024, pages=1).ljust(1024, b"\0"), "bad.db")
    with pytest.raises(ToolError) as caught:  # payload fractions 0, not 64/32/32
        refuse_foreign(not_a_db)
    assert caught.value.exit_code == Exit.NOT_A_LEDGER
    assert caught.value.message.startswith(f"{not_a_db}: not a database (")


def test_a_closed_log_is_read_in_place_immutable(fault_log: Path) -> None:
    with logfile._readable(fault_log) as uri:
        assert uri == f"{fault_log.resolve().as_uri()}?mode=ro&immutable=1"
    assert not Path(f"{fault_log}-wal").exists() and not Path(f"{fault_log}-shm").exists()


def _change(log: Path, how: str) -> None:
    """What a writer does to a log: append a page, touch it, start its ``-wal``, or replace
    the file by another of the same size and time (another inode)."""
    st = log.stat()
    if how == "append":
        with open(log, "ab") as f:
            f.write(b"\0" * 4096)
    elif how == "touch":
        os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif how == "wal":
        Path(f"{log}-wal").write_bytes(b"w")
    else:
        replacement = log.with_name("other.db")
        replacement.write_bytes(log.read_bytes())
        os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(replacement, log)


@pytest.mark.parametrize("change", ["append", "touch", "wal", "replace"])
def test_a_read_that_raced_a_writer_is_refused_run_again(fault_log: Path, change: str) -> None:
    with pytest.raises(ToolError) as caught, logfile._readable(fault_log):
        _change(fault_log, change)
    assert (caught.value.exit_code, caught.value.message) == (
        Exit.FAILED,
        f"{fault_log}: the log changed while it was read (a writer opened it): run again",
    )


def _dirty(log: Path) -> None:
    """What a crashed writer leaves: its pages in the ``-wal``, never checkpointed."""
    code = (
        "import os, sqlite3\n"
        f"c = sqlite3.connect({str(log)!r})\n"
        "c.execute('PRAGMA wal_autocheckpoint = 0')\nc.execute('VACUUM')\nos._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert Path(f"{log}-wal").stat().st_size > 0


def test_a_dirty_wal_is_read_from_a_private_copy_and_the_evidence_left_as_it_was(
    fault_log: Path,
) -> None:
    _dirty(fault_log)
    files = {p.name: p.read_bytes() for p in fault_log.parent.iterdir()}
    with logfile._readable(fault_log) as uri:
        copy = Path(uri.removeprefix("file://").partition("?")[0])
        assert uri.endswith("?mode=ro&immutable=1")
        assert copy.name == "ledger.db" and copy.parent.name.startswith("loraledger-read-")
        assert fault_log.parent not in copy.parents
        assert not Path(f"{copy}-wal").exists() or Path(f"{copy}-wal").stat().st_size == 0
        with closing(sqlite3.connect(uri, uri=True)) as conn:
            (last,) = conn.execute("SELECT max(seq) FROM events").fetchone()
        assert last > 0
    assert not copy.parent.exists()
    assert {p.name: p.read_bytes() for p in fault_log.parent.iterdir()} == files


def test_a_hot_journal_is_rolled_back_in_the_copy_only(fault_log: Path) -> None:
    journal = Path(f"{fault_log}-journal")
    with closing(sqlite3.connect(fault_log)) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    journal.write_bytes(b"")  # an empty journal is no hot journal: read in place
    with logfile._readable(fault_log) as uri:
        assert uri.endswith("&immutable=1") and fault_log.name in uri
    journal.write_bytes(b"j" * 512)  # not a valid journal: SQLite ignores it when settling
    with logfile._readable(fault_log) as uri:
        assert fault_log.name not in uri and "loraledger-read-" in uri
    assert journal.read_bytes() == b"j" * 512


def test_a_private_copy_that_fails_says_where_to_make_room(
    fault_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dirty(fault_log)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(ToolError) as caught, logfile._readable(fault_log):
        pass
    assert (caught.value.exit_code, caught.value.message) == (
        Exit.FAILED,
        f"{fault_log}: its -wal/-journal must be read from a private copy, which failed: "
        "No space left on device (set TMPDIR to a disk with room for the log)",
    )


@contextmanager
def _held_open(log: Path) -> Iterator[None]:
    """Another process with ``log`` open in WAL mode, as a running ``serve`` has it."""
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
        yield
    finally:
        child.kill()
        child.wait()


def test_a_live_writer_is_read_in_place_through_sqlite_s_own_protocol(fault_log: Path) -> None:
    _dirty(fault_log)
    assert not open_elsewhere(fault_log)  # a crashed writer's -shm holds no lock
    with _held_open(fault_log):
        assert open_elsewhere(fault_log)
        assert open_elsewhere(str(fault_log))
        with logfile._readable(fault_log) as uri:
            assert uri == f"{fault_log.resolve().as_uri()}?mode=ro"
    assert not open_elsewhere(fault_log)


def test_a_writer_that_opens_the_log_during_an_immutable_read_spoils_it(fault_log: Path) -> None:
    with (
        pytest.raises(ToolError, match="changed while it was read"),
        ExitStack() as writer,
        logfile._readable(fault_log),
    ):
        writer.enter_context(_held_open(fault_log))  # still open when the read ends


def test_open_log_reads_a_ledger_and_refuses_one_without_events(
    fault_log: Path, tmp_path: Path
) -> None:
    async def check() -> None:
        async with open_log(fault_log) as store:
            assert store.last_seq > 0
        async with SQLiteStore.open(tmp_path / "new.db"):
            pass
        with pytest.raises(ToolError) as caught:
            async with open_log(tmp_path / "new.db"):
                pass
        assert (caught.value.exit_code, caught.value.message) == (
            Exit.EMPTY,
            f"{tmp_path / 'new.db'}: the ledger holds no events yet",
        )
        async with open_log(tmp_path / "new.db", allow_empty=True) as store:
            assert store.last_seq == 0

    anyio.run(check)


def test_no_provenance_beside_a_log_is_none(fault_log: Path) -> None:
    async def check() -> None:
        async with logfile.open_provenance_beside(fault_log) as provenance:
            assert provenance is None

    anyio.run(check)


def test_preflight_reads_only_the_header_of_a_log_of_any_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log of gigabytes is checked on its first 100 bytes, not read into memory."""
    path = _file(tmp_path, _header(page=1024, pages=4).ljust(4 * 1024, b"\0"))
    asked: list[object] = []
    real_open = open

    class Spy:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Spy:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def read(self, n: int | None = None) -> bytes:
            asked.append(n)
            data: bytes = self.f.read(n)
            return data

    monkeypatch.setattr("builtins.open", lambda *a, **k: Spy(real_open(*a, **k)))
    assert preflight(path) == path
    assert asked == [100]


def test_a_page_count_is_read_from_all_four_bytes_of_the_header(tmp_path: Path) -> None:
    path = _file(tmp_path, _header(page=1024, pages=(1 << 24) + 3).ljust(3 * 1024, b"\0"))
    _refused(
        path, Exit.CORRUPT, f"{path}: truncated (3 pages on disk, its header records 16777219)"
    )


def test_a_lock_that_cannot_be_asked_about_is_no_live_writer(
    fault_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dirty(fault_log)

    def refused(*args: object) -> object:
        raise OSError(errno.EINVAL, "Invalid argument")

    with _held_open(fault_log):
        monkeypatch.setattr(fcntl, "fcntl", refused)
        assert not open_elsewhere(fault_log)


def test_a_database_error_without_a_sqlite_code_is_damage(tmp_path: Path) -> None:
    """Python raises some itself (a closed connection, a bad parameter): no crash on the
    missing code."""
    error = logfile._classify(tmp_path / "x.db", sqlite3.DatabaseError("no code"))
    assert error.exit_code == Exit.CORRUPT


def test_the_provenance_store_beside_a_log_is_opened(fault_log: Path) -> None:
    async def check() -> None:
        async with open_provenance(fault_log):
            pass
        async with logfile.open_provenance_beside(fault_log) as provenance:
            assert provenance is not None
            assert provenance.location == provenance_location(fault_log)

    anyio.run(check)
