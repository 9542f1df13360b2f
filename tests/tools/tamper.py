"""Ways a log file gets damaged, done to a copy with plain ``sqlite3`` (the ledger closed it).

Each helper models one real-world failure: a flipped byte (disk or a hand edit), a rewritten
link (someone splicing records), a re-forged chain (an attacker who recomputes every hash after
editing history: the chain then verifies, and only the invariant replay can catch it), and a
file cut short (a copy or a disk that stopped mid-write).
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from evlog.events import Event, encode_event
from evlog.record import GENESIS_HASH, chain_hash

_ROW = (
    "SELECT seq, event_id, stream, type, schema, recorded_at, payload, prev_hash, hash FROM events"
)


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def flip_payload_byte(path: Path, seq: int, index: int = -1) -> None:
    with closing(_connect(path)) as conn:
        (payload,) = conn.execute("SELECT payload FROM events WHERE seq = ?", (seq,)).fetchone()
        changed = bytearray(payload)
        changed[index] ^= 0x01
        conn.execute("UPDATE events SET payload = ? WHERE seq = ?", (bytes(changed), seq))


def rewrite_prev_hash(path: Path, seq: int, *, rehash: bool) -> None:
    """Point record ``seq`` at a made-up predecessor; ``rehash`` also makes its own hash
    consistent with that (so the record alone looks fine and only the link is wrong)."""
    fake_prev = bytes(range(32))
    with closing(_connect(path)) as conn:
        row = conn.execute(_ROW + " WHERE seq = ?", (seq,)).fetchone()
        new_hash = chain_hash(fake_prev, *row[:7]) if rehash else row[8]
        conn.execute(
            "UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (fake_prev, new_hash, seq)
        )


def reforge(path: Path, seq: int, event: Event) -> None:
    """Replace record ``seq`` by ``event`` (its type, schema and payload) and recompute every
    hash from there on."""
    with closing(_connect(path)) as conn:
        conn.execute("BEGIN")
        conn.execute(
            "UPDATE events SET type = ?, schema = ?, payload = ? WHERE seq = ?",
            (type(event).__name__, event.SCHEMA, encode_event(event), seq),
        )
        prev = _hash_before(conn, seq)
        for row in conn.execute(_ROW + " WHERE seq >= ? ORDER BY seq", (seq,)).fetchall():
            new_hash = chain_hash(prev, *row[:7])
            conn.execute(
                "UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, new_hash, row[0])
            )
            prev = new_hash
        conn.execute("COMMIT")


def _hash_before(conn: sqlite3.Connection, seq: int) -> bytes:
    if seq == 1:
        return GENESIS_HASH
    (prev,) = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq - 1,)).fetchone()
    return bytes(prev)


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def page_size(path: Path) -> int:
    with open(path, "rb") as f:
        header = f.read(100)
    size = int.from_bytes(header[16:18], "big")
    return 65536 if size == 1 else size


def loose_copy(src: Path, dst: Path) -> None:
    """The same log with its events table re-created without STRICT, so that any column takes
    any type: what a forger who writes the file with another tool can produce (the ledger's
    own table refuses it)."""
    from evlog.sqlite import APPLICATION_ID, LAYOUT_VERSION

    with closing(_connect(src)) as s:
        rows = s.execute(_ROW + " ORDER BY seq").fetchall()
    with closing(_connect(dst)) as d:
        d.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY, event_id, stream, type, schema, "
            "recorded_at, payload, prev_hash, hash)"
        )
        d.execute(
            "CREATE TABLE snapshots (code_version TEXT, seq INTEGER, state BLOB, "
            "PRIMARY KEY (code_version, seq))"
        )
        d.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        d.execute(f"PRAGMA user_version = {LAYOUT_VERSION}")
        d.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 9)})", rows)


def craft(path: Path, seq: int, **columns: object) -> None:
    """Set ``columns`` of record ``seq`` (any values, any types) and recompute its hash and
    every later one wherever the values can be hashed at all, so the record is hash-valid
    unless its very columns make hashing impossible. Needs a :func:`loose_copy` for values of
    another type. ``prev_hash`` and ``hash`` are set as given (no chain is rewritten then)."""
    with closing(_connect(path)) as conn:
        conn.execute("BEGIN")
        sets = ", ".join(f"{name} = ?" for name in columns)
        conn.execute(f"UPDATE events SET {sets} WHERE seq = ?", (*columns.values(), seq))
        if not {"prev_hash", "hash"} & set(columns):
            prev = _hash_before(conn, seq)
            for row in conn.execute(_ROW + " WHERE seq >= ? ORDER BY seq", (seq,)).fetchall():
                try:
                    new_hash = chain_hash(prev, *row[:7])
                except (TypeError, ValueError):
                    new_hash = bytes(32)  # columns the chain cannot hash: left so
                conn.execute(
                    "UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?",
                    (prev, new_hash, row[0]),
                )
                prev = new_hash
        conn.execute("COMMIT")


def raw_text(path: Path, seq: int, column: str, raw: bytes) -> None:
    """Store bytes that are not UTF-8 as the TEXT of ``column`` (Python cannot even read it
    back as a string, let alone hash it)."""
    with closing(_connect(path)) as conn:
        conn.execute(f"UPDATE events SET {column} = CAST(? AS TEXT) WHERE seq = ?", (raw, seq))
