"""Opening a ledger file for the read-only tools (replay, audit, verify): safely, and read-only.

``SQLiteStore.open`` is the writer's door: it creates a missing file, lays the tables out in an
empty one, switches a database to WAL mode and, as the last connection, checkpoints and
deletes the ``-wal``. A forensic tool must do none of that: ``verify typo.db`` must not leave a
fresh ledger behind, ``replay app.sqlite`` must not convert someone's database, and no read
may change one byte of the evidence (main file, ``-wal``, ``-shm``, ``-journal``), nor need
write access to its directory. So :func:`preflight` first looks at the raw bytes (no SQLite)
and refuses, with a distinct exit code, a missing, empty, cut-short or foreign file, and
:func:`_readable` then picks how SQLite may read the log without writing:

* **only the main file** (no ``-wal`` content, no ``-journal``: the writer closed it, or a
  copy): read in place with ``mode=ro&immutable=1``. Plain ``mode=ro`` is not enough: on a
  WAL-mode file it creates ``-wal`` and ``-shm``. ``immutable`` takes no lock and opens no
  other file, which is safe only while nobody writes the file; so the file's identity (size,
  mtime, inode, and the absence of a ``-wal``) is checked again after the read, and a read
  that raced a writer is reported as such (run again), never trusted.
* **a live writer** (another process holds SQLite's lock on the ``-shm``): read in place with
  plain ``mode=ro``. SQLite's WAL protocol gives the reader a consistent snapshot, a read-only
  connection never checkpoints and never deletes; the ``-shm`` is the writer's working memory
  and changes anyway. ``immutable`` would be wrong here: it ignores the ``-wal`` and reads
  pages the writer's checkpoints are rewriting.
* **a dirty ``-wal`` or a ``-journal`` and no live writer** (a crash, or a copied log): even
  ``mode=ro`` writes here -- SQLite rebuilds the ``-shm`` (or creates it), rolls a hot journal
  back, and deletes a ``-wal`` whose main file is empty (the evidence). So the main file,
  ``-wal`` and ``-journal`` are copied (plain reads) into a private temporary directory, SQLite
  settles the copy there, and the tool reads the copy; the originals are only ever read. That
  costs a copy of the log in ``$TMPDIR``, and only in this case.

A main file of 0 bytes whose ``-wal`` holds pages is refused as corrupt before any of this:
a ledger's main file always holds at least its header page, and SQLite's answer to that
state is to delete the ``-wal``.

A ``postgresql://`` URL is opened with :meth:`PostgresStore.connect` ``read_only=True`` instead:
the server's snapshot isolation gives a consistent read next to a live writer, and the
sessions are read-only, so the server itself refuses any write.

These are tools for another process than the writer's: POSIX locks belong to a process, and
closing any descriptor of a file drops all of them, so reading a log that a connection of the
*same* process holds open (the raw reads here open and close its files) would strip that
connection's locks. The CLI never does; library callers must not either.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import struct
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path

from evlog.errors import LoraLedgerError
from evlog.provenance_store import ProvenanceStore, SQLiteProvenance, provenance_location
from evlog.sqlite import APPLICATION_ID, SQLiteStore
from evlog.store import EventStore
from evlog.stores import describe, is_shared
from tools.exitcodes import Exit, ToolError

_MAGIC = b"SQLite format 3\x00"
_HEADER = 100  # bytes of the SQLite file header


def preflight(path: str | os.PathLike[str]) -> Path:
    """Raise :class:`ToolError` unless ``path`` looks like a SQLite file; reads bytes only."""
    p = Path(path)
    if not p.exists():
        raise ToolError(Exit.MISSING, f"{p}: no such file (give the path of a ledger log)")
    if p.is_dir():
        raise ToolError(Exit.NOT_A_LEDGER, f"{p}: is a directory, not a ledger log")
    try:
        size = p.stat().st_size
        wal = _size(Path(f"{p}-wal"))
        if size == 0 and wal == 0:
            raise ToolError(Exit.EMPTY, f"{p}: empty file (0 bytes): no ledger was written here")
        if size == 0:
            raise ToolError(
                Exit.CORRUPT,
                f"{p}: the main file is empty (0 bytes) but its -wal holds {wal} bytes: the "
                "main file was truncated; nothing was read or changed (keep both files)",
            )
        with open(p, "rb") as f:
            head = f.read(_HEADER)
    except OSError as exc:
        raise ToolError(Exit.FAILED, f"{p}: cannot read: {exc.strerror or exc}") from None
    if not head.startswith(_MAGIC):
        if _MAGIC.startswith(head):
            raise ToolError(Exit.CORRUPT, f"{p}: truncated ({size} bytes, not even a header)")
        raise ToolError(Exit.NOT_A_LEDGER, f"{p}: not a SQLite database, so not a ledger log")
    _check_length(p, head, size)
    return p


def _check_ledger(p: Path, uri: str) -> None:
    """Through SQLite (read-only), not the raw header: a live ledger may hold its newest
    pages, even its application id, only in the ``-wal``."""
    try:
        with closing(sqlite3.connect(uri, uri=True)) as conn:
            (app_id,) = conn.execute("PRAGMA application_id").fetchone()
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise _classify(p, exc) from None
    if app_id != APPLICATION_ID or "events" not in tables:
        raise ToolError(
            Exit.NOT_A_LEDGER,
            f"{p}: a SQLite database, but not a loraledger log (application id {app_id:#x})",
        )


def refuse_foreign(path: str | os.PathLike[str]) -> None:
    """For a writer about to open ``path`` (``serve``): nothing, when it is absent or empty (a
    new log) or a loraledger log; else the reader's :class:`ToolError` (a directory, another
    file, another application's database: exit 5; a damaged one: exit 6). Reads only, so the
    refused file is left as it was."""
    p = Path(path)
    if p.is_dir():
        raise ToolError(Exit.NOT_A_LEDGER, f"{p}: is a directory, not a ledger log")
    if not p.exists() or (_size(p) == 0 and _size(Path(f"{p}-wal")) == 0):
        return
    preflight(p)
    with _readable(p) as uri:
        _check_ledger(p, uri)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _uri(p: Path, *, immutable: bool) -> str:
    return f"{p.resolve().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")


_DMS = 128  # the "dead man switch" byte of SQLite's unix -shm: every open connection locks it


def _live(shm: Path) -> bool:
    """Does another process have this database open in WAL mode right now? Asked with
    ``F_GETLK`` (which takes no lock) on the byte every connection holds a shared lock on."""
    try:
        fd = os.open(shm, os.O_RDONLY)
    except OSError:
        return False
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, _DMS, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
        lock_type: int = struct.unpack(_FLOCK, answer)[0]
        return lock_type != fcntl.F_UNLCK
    except OSError:
        return False
    finally:
        os.close(fd)


_FLOCK = "hhqqi4x"  # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid


def open_elsewhere(path: str | os.PathLike[str]) -> bool:
    """Does another live process have the SQLite log at ``path`` open (a running ``serve``,
    or a reader)? Only a live process holds the lock asked about: a crashed writer's leftover
    ``-shm`` answers False, so this can never stand in the way of a restart. Call it only
    before this process opens the log (see the module docstring on POSIX locks)."""
    return _live(Path(f"{os.fspath(path)}-shm"))


def _identity(p: Path) -> tuple[int, int, int, int]:
    st = p.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns, _size(Path(f"{p}-wal")))


@contextmanager
def _readable(p: Path) -> Iterator[str]:
    """A read-only SQLite URI showing the log at ``p`` (see the module docstring)."""
    wal, journal = Path(f"{p}-wal"), Path(f"{p}-journal")
    if _live(Path(f"{p}-shm")):
        yield _uri(p, immutable=False)
        return
    if _size(wal) == 0 and _size(journal) == 0:
        before = _identity(p)
        yield _uri(p, immutable=True)
        if _identity(p) != before or _live(Path(f"{p}-shm")):
            raise ToolError(
                Exit.FAILED,
                f"{p}: the log changed while it was read (a writer opened it): run again",
            )
        return
    with tempfile.TemporaryDirectory(prefix="loraledger-read-") as tmp:
        copy = Path(tmp) / "ledger.db"
        try:
            for source, suffix in ((p, ""), (wal, "-wal"), (journal, "-journal")):
                if source.exists():
                    shutil.copyfile(source, f"{copy}{suffix}")
            # SQLite settles the copy (rebuilds the WAL index, rolls a hot journal back,
            # checkpoints on close): what it would have written into the evidence.
            with closing(sqlite3.connect(copy)) as conn:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.DatabaseError as exc:
            raise _classify(p, exc) from None
        except OSError as exc:
            raise ToolError(
                Exit.FAILED,
                f"{p}: its -wal/-journal must be read from a private copy, which failed: "
                f"{exc.strerror or exc} (set TMPDIR to a disk with room for the log)",
            ) from None
        yield _uri(copy, immutable=True)


def _check_length(p: Path, head: bytes, size: int) -> None:
    """A file cut short. SQLite itself may not notice a cut inside the last page (it reads the
    missing bytes as zeros, so the damage would surface as an "altered" record, the wrong
    diagnosis): a database file is always a whole number of pages, and at least as many pages
    as its header records (that count is trusted only when the header says it is current)."""
    if len(head) < _HEADER:
        raise ToolError(Exit.CORRUPT, f"{p}: truncated ({size} bytes, not even a header)")
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    if page < 512 or page & (page - 1):
        raise ToolError(Exit.CORRUPT, f"{p}: damaged header (page size {page})")
    if size % page:
        raise ToolError(
            Exit.CORRUPT,
            f"{p}: truncated mid-page ({size} bytes is not a whole number of {page}-byte pages)",
        )
    pages = int.from_bytes(head[28:32], "big")
    current = head[24:28] == head[92:96]
    if current and pages and size < pages * page:
        raise ToolError(
            Exit.CORRUPT,
            f"{p}: truncated ({size // page} pages on disk, its header records {pages})",
        )


def _classify(p: Path, exc: sqlite3.DatabaseError) -> ToolError:
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_NOTADB:
        return ToolError(Exit.NOT_A_LEDGER, f"{p}: not a database ({exc})")
    return ToolError(Exit.CORRUPT, f"{p}: damaged database file ({exc}); truncated or overwritten?")


@asynccontextmanager
async def open_log(
    path: str | os.PathLike[str], *, allow_empty: bool = False
) -> AsyncIterator[EventStore]:
    """The store at ``path`` (a file, or a ``postgresql://`` URL), read-only, checked by
    :func:`preflight` (files) and by the store's own open checks. ``allow_empty`` accepts a
    ledger with no events (``verify`` reports it)."""
    if is_shared(path):
        async with _open_database(os.fspath(path), allow_empty) as pg:
            yield pg
        return
    p = preflight(path)
    with _readable(p) as uri:
        _check_ledger(p, uri)
        try:
            store = await SQLiteStore.connect_read_only(uri, label=str(p))
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=str(p)) from None
        try:
            if store.last_seq == 0 and not allow_empty:
                raise ToolError(Exit.EMPTY, f"{p}: the ledger holds no events yet")
            yield store
        finally:
            await store.close()


@asynccontextmanager
async def _open_database(url: str, allow_empty: bool) -> AsyncIterator[EventStore]:
    from evlog.postgres import PostgresStore

    where = describe(url)
    try:
        store = await PostgresStore.connect(url, read_only=True)
    except LoraLedgerError as exc:
        if exc.details.get("empty"):
            raise ToolError(Exit.EMPTY, f"{where}: no ledger was written here") from None
        raise ToolError.from_ledger(exc, path=where) from None
    try:
        if store.last_seq == 0 and not allow_empty:
            raise ToolError(Exit.EMPTY, f"{where}: the ledger holds no events yet")
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def open_provenance_beside(
    log: str | os.PathLike[str],
) -> AsyncIterator[ProvenanceStore | None]:
    """The provenance store beside the log at ``log`` (``evlog/provenance_store.py``), read
    the same way as the log itself: read-only, writing nothing, next to a live writer or not.
    None when there is none (the log's process never kept one: rows were written elsewhere,
    or no generation was ever served)."""
    if is_shared(log):
        from evlog.provenance_postgres import PostgresProvenance

        try:
            async with PostgresProvenance.read_only(os.fspath(log)) as pg:
                yield pg
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=provenance_location(log)) from None
        return
    p = _beside(log)
    if p is None:
        yield None
        return
    with _readable(p) as uri:
        try:
            async with SQLiteProvenance.read_only(uri, str(p)) as lite:
                yield lite
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=str(p)) from None


def _beside(log: str | os.PathLike[str]) -> Path | None:
    """The provenance file of the SQLite log at ``log``, if there is one."""
    p = Path(provenance_location(log))
    return p if p.exists() else None
