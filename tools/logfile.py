"""Opening a ledger file for the read-only tools (replay, audit, verify), safely.

``SQLiteStore.open`` is the writer's door: it creates a missing file, lays the tables out in an
empty one and switches a database to WAL mode. A tool pointed at the wrong path must do none of
that (``verify typo.db`` must not leave a fresh empty ledger behind, ``replay app.sqlite`` must
not convert someone's database to WAL), so :func:`preflight` first looks at the file with a
read-only SQLite connection and refuses, with a distinct exit code, a missing or empty file, a
file that is not SQLite, a database that is not a loraledger log, and a damaged one. Only then
is the store opened (its own checks: integrity, tail record hash and link).

The read-only look goes through SQLite (not the raw header bytes) on purpose: a live ledger in
WAL mode may hold its newest pages, even its application id, only in the ``-wal`` file.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path

from evlog.errors import LoraLedgerError
from evlog.sqlite import APPLICATION_ID, SQLiteStore
from tools.exitcodes import Exit, ToolError

_MAGIC = b"SQLite format 3\x00"
_HEADER = 100  # bytes of the SQLite file header


def preflight(path: str | os.PathLike[str]) -> Path:
    """Raise :class:`ToolError` unless ``path`` looks like a loraledger log; never writes."""
    p = Path(path)
    if not p.exists():
        raise ToolError(Exit.MISSING, f"{p}: no such file (give the path of a ledger log)")
    if p.is_dir():
        raise ToolError(Exit.NOT_A_LEDGER, f"{p}: is a directory, not a ledger log")
    size = p.stat().st_size
    wal = Path(f"{p}-wal")
    if size == 0 and not (wal.exists() and wal.stat().st_size > 0):
        raise ToolError(Exit.EMPTY, f"{p}: empty file (0 bytes): no ledger was written here")
    with open(p, "rb") as f:
        head = f.read(_HEADER)
    if size and not head.startswith(_MAGIC):
        if _MAGIC.startswith(head):
            raise ToolError(Exit.CORRUPT, f"{p}: truncated ({size} bytes, not even a header)")
        raise ToolError(Exit.NOT_A_LEDGER, f"{p}: not a SQLite database, so not a ledger log")
    if size:
        _check_length(p, head, size)
    try:
        with closing(sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            (app_id,) = conn.execute("PRAGMA application_id").fetchone()
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise _classify(p, exc) from None
    if app_id != APPLICATION_ID or "events" not in tables:
        raise ToolError(
            Exit.NOT_A_LEDGER,
            f"{p}: a SQLite database, but not a loraledger log (application id {app_id:#x})",
        )
    return p


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
) -> AsyncIterator[SQLiteStore]:
    """The store at ``path``, checked by :func:`preflight` and by the store's own open checks.

    ``allow_empty`` accepts a ledger with no events (``verify`` reports it itself)."""
    p = preflight(path)
    try:
        store = await SQLiteStore.connect(p)
    except LoraLedgerError as exc:
        raise ToolError.from_ledger(exc, path=str(p)) from None
    try:
        if store.last_seq == 0 and not allow_empty:
            raise ToolError(Exit.EMPTY, f"{p}: the ledger holds no events yet")
        yield store
    finally:
        await store.close()
