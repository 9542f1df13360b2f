"""Raw sqlite3 access to a log file, bypassing the store: how the SQLite tests read, damage or
forge a file the way a hand edit, a bad disk or another application would."""

from __future__ import annotations

import sqlite3
from pathlib import Path

COLUMNS = "seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash"


def raw(path: Path) -> sqlite3.Connection:
    """An autocommit connection that waits for the store's write lock like the store does."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def run(path: Path, *statements: str) -> None:
    conn = raw(path)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def another_applications_database(path: Path) -> Path:
    """A SQLite database with a table named like the log's, written by someone else."""
    run(path, "CREATE TABLE events (id INTEGER PRIMARY KEY, what TEXT)")
    return path


def foreign(path: Path, *, application_id: int, user_version: int) -> None:
    """A database marked with ``application_id`` and ``user_version`` and holding none of the
    log's tables."""
    run(
        path,
        f"PRAGMA application_id = {application_id}",
        f"PRAGMA user_version = {user_version}",
        "CREATE TABLE other (x)",
    )


def damage_an_index_page(path: Path) -> None:
    """Overwrite the b-tree page header of the event_id index's root page: damage that only
    SQLite's integrity check sees (the records and the tail still read)."""
    conn = sqlite3.connect(path)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
        ).fetchone()
    finally:
        conn.close()
    with path.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 16)
