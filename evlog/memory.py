"""``MemoryStore``: the ``EventStore`` contract in memory, for fast tests and simulation.

It keeps exactly what the SQLite store keeps (flat rows, the id index, snapshots) in a
:class:`MemoryLog`, the in-memory stand-in for a file: a new ``MemoryStore`` over the same
``MemoryLog`` is a "reopen" after a simulated crash, and a test can rewrite a row of it the way
it would rewrite a row of a SQLite file. Reads decode and verify every row on the way out, just
like the SQLite store, so the hash chain, upcasting and corruption paths behave the same in
both and the contract suite can hold both to one standard.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel

from evlog.append_plan import plan_appends
from evlog.errors import INVALID_INPUT, StoreCode, StoreError
from evlog.record import GENESIS_HASH, Pending, Record, Row, open_row
from evlog.store import SNAPSHOTS_KEPT, CommitSignal, Snapshot, VerifyReport

_CHUNK = 1024


def _seq_of(row: Row) -> int:
    return row[0]


class MemoryLog:
    """The durable part of a memory store ("the file"): outlives any ``MemoryStore`` over it.

    ``ids`` plays the role of the UNIQUE index on ``event_id``: it is kept by appends, so a
    duplicate is recognised forever, across reopens.
    """

    __slots__ = ("ids", "rows", "snapshots")

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.ids: dict[bytes, int] = {}
        self.snapshots: dict[str, list[Snapshot]] = {}


class MemoryStore:
    """An ``EventStore`` in memory. Constructing it checks the tail record, as opening a file
    does, so a tampered tail is refused at "open" by both backends."""

    def __init__(self, log: MemoryLog | None = None) -> None:
        self._log = MemoryLog() if log is None else log
        self._closed = False
        # Created lazily: an anyio Event needs a running loop, and the constructor is sync.
        self._committed = CommitSignal()
        rows = self._log.rows
        if rows:
            before = rows[-2] if len(rows) > 1 else None
            open_row(
                rows[-1],
                before[0] if before else 0,
                before[8] if before else GENESIS_HASH,
            )

    @classmethod
    async def connect(cls, log: MemoryLog | None = None) -> MemoryStore:
        await anyio.lowlevel.checkpoint()
        return cls(log)

    @classmethod
    @asynccontextmanager
    async def open(cls, log: MemoryLog | None = None) -> AsyncIterator[MemoryStore]:
        store = await cls.connect(log)
        try:
            yield store
        finally:
            with anyio.CancelScope(shield=True):
                await store.close()

    @property
    def log(self) -> MemoryLog:
        """The backing log, to "reopen" it with a new ``MemoryStore``."""
        return self._log

    @property
    def last_seq(self) -> int:
        rows = self._log.rows
        return rows[-1][0] if rows else 0

    @property
    def head_hash(self) -> bytes:
        rows = self._log.rows
        return rows[-1][8] if rows else GENESIS_HASH

    # --- writes ----------------------------------------------------------------------------

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        self._check_open()
        # Every backend suspends in append; tests that interleave appenders rely on it.
        await anyio.lowlevel.checkpoint()
        self._check_open()
        if not batch:
            return []
        log = self._log
        plan = plan_appends([(batch, expected_seq)], self.last_seq, self.head_hash, log.ids)
        outcome = plan.outcomes[0]
        if isinstance(outcome, StoreError):
            raise outcome
        if plan.rows:
            log.rows.extend(plan.rows)
            for row in plan.rows:
                log.ids[row[1]] = row[0]
            self._committed.fire()
        return outcome

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        self._check_open()
        await anyio.lowlevel.checkpoint()
        self._check_open()
        if not 0 <= snapshot.seq <= self.last_seq:
            raise StoreError(
                INVALID_INPUT,
                f"snapshot at seq {snapshot.seq} is outside the log (last seq {self.last_seq})",
                seq=snapshot.seq,
            )
        kept = [
            s for s in self._log.snapshots.get(snapshot.code_version, []) if s.seq != snapshot.seq
        ]
        kept.append(snapshot)
        kept.sort(key=lambda s: s.seq)
        self._log.snapshots[snapshot.code_version] = kept[-SNAPSHOTS_KEPT:]

    async def load_snapshot(self, code_version: str) -> Snapshot | None:
        self._check_open()
        await anyio.lowlevel.checkpoint()
        kept = self._log.snapshots.get(code_version)
        return kept[-1] if kept else None

    # --- reads -----------------------------------------------------------------------------

    async def read(
        self, after: int = 0, until: int | None = None, limit: int | None = None
    ) -> list[Record]:
        self._check_open()
        await anyio.lowlevel.checkpoint()
        self._check_open()
        return self._read(after, until, limit, None)

    async def iterate(self, after: int = 0, until: int | None = None) -> AsyncIterator[Record]:
        prev_hash: bytes | None = None
        while True:
            self._check_open()
            records = self._read(after, until, _CHUNK, prev_hash)
            for record in records:
                yield record
            if len(records) < _CHUNK:
                return
            after, prev_hash = records[-1].seq, records[-1].hash
            await anyio.lowlevel.checkpoint()

    async def follow(self, after: int = 0) -> AsyncIterator[Record]:
        prev_hash: bytes | None = None
        while not self._closed:
            wake = self._committed.next()
            records = self._read(after, None, _CHUNK, prev_hash)
            if not records:
                await wake.wait()
                continue
            for record in records:
                yield record
            after, prev_hash = records[-1].seq, records[-1].hash

    async def verify(self) -> VerifyReport:
        self._check_open()
        await anyio.lowlevel.checkpoint()
        prev_seq, prev_hash, count = 0, GENESIS_HASH, 0
        try:
            for row in self._log.rows:
                open_row(row, prev_seq, prev_hash)
                prev_seq, prev_hash = row[0], row[8]
                count += 1
        except StoreError as exc:
            return VerifyReport(
                ok=False,
                records=count,
                last_seq=prev_seq,
                head_hash=prev_hash,
                first_bad_seq=exc.details.get("seq"),
                code=exc.code,
                message=exc.message,
            )
        return VerifyReport(ok=True, records=count, last_seq=prev_seq, head_hash=prev_hash)

    async def close(self) -> None:
        self._closed = True
        self._committed.fire()
        await anyio.lowlevel.checkpoint()

    # --- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(StoreCode.STORE_CLOSED, "the store is closed")

    def _read(
        self, after: int, until: int | None, limit: int | None, prev_hash: bytes | None
    ) -> list[Record]:
        """Verified records after ``after``. ``prev_hash`` is the hash of record ``after`` when
        the caller already holds it (chunked reads); otherwise it is looked up, so the first
        record returned is verified against its real predecessor too."""
        if after < 0:
            raise StoreError(INVALID_INPUT, f"after must be >= 0, got {after}")
        if (limit is not None and limit <= 0) or (until is not None and until <= after):
            return []
        rows = self._log.rows
        start = bisect.bisect_right(rows, after, key=_seq_of)
        if prev_hash is None:
            if after == 0:
                prev_hash = GENESIS_HASH
            elif start > 0 and rows[start - 1][0] == after:
                prev_hash = rows[start - 1][8]
            elif start < len(rows):
                raise StoreError(StoreCode.CHAIN_BROKEN, f"record {after} is missing", seq=after)
            else:
                return []
        stop = len(rows) if limit is None else min(len(rows), start + limit)
        out: list[Record] = []
        prev_seq = after
        for row in rows[start:stop]:
            if until is not None and row[0] > until:
                break
            out.append(open_row(row, prev_seq, prev_hash))
            prev_seq, prev_hash = row[0], row[8]
        return out
