"""What every durable store does above its database driver: the hash-chained log's rules.

:class:`~evlog.sqlite.SQLiteStore` and :class:`~evlog.postgres.PostgresStore` differ in how
they talk to their database (one file through aiosqlite; a server through asyncpg) and in how
they fence a second writer. Everything else is the same promise and lives here once, so the
two cannot drift apart:

* the cached tail (``last_seq``, ``head_hash``) is only ever advanced by :meth:`_settle`,
  after the group's transaction committed;
* appends and snapshot saves go through one :class:`~evlog.group_commit.GroupCommit`;
* every record read is checked against its predecessor (its link and its own hash) before a
  caller sees it, chunk by chunk, so a replay of any length runs in bounded memory;
* ``follow`` cannot miss a commit: it takes the commit signal before it reads;
* ``verify`` walks the whole log, past this store's own tail, and also checks that the record
  this store committed last is still the one there (a rewritten tail is ``CHAIN_BROKEN``).

A backend supplies :meth:`_write_group` (write one group, then ``_settle`` it) and
:meth:`_fetch` (raw rows of a seq range, in seq order), plus its own open, close and snapshot
load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.lowlevel

from evlog.append_plan import AppendPlan
from evlog.errors import INVALID_INPUT, StoreCode, StoreError
from evlog.group_commit import GroupCommit, Write, WriteStats
from evlog.record import GENESIS_HASH, Pending, Record, Row, open_row
from evlog.store import CommitSignal, Snapshot, VerifyReport

MAX_SEQ = 2**63 - 1
CHUNK = 4096  # rows per read: bounded memory for a replay, few round trips


class ChainedStore:
    """The shared half of a durable ``EventStore`` (see the module docstring)."""

    def __init__(self, last_seq: int, head_hash: bytes) -> None:
        self._last_seq = last_seq
        self._head_hash = head_hash
        self._group = GroupCommit(self._write_group)
        self._closing = False  # no new calls; the queued ones still commit
        self._closed = False
        self._committed = CommitSignal()
        # After a failed write the cached tail may be wrong: re-read it inside the next one.
        self._suspect = False
        self._transactions = 0
        self._events = 0
        self._slow_paths = 0
        self._read_only = False

    # --- what a backend supplies -----------------------------------------------------------

    @property
    def name(self) -> str:
        """The log's location, for messages (never a password)."""
        raise NotImplementedError

    async def _write_group(self, group: list[Write]) -> None:
        """Write ``group`` as one transaction and :meth:`_settle` it (see GroupCommit)."""
        raise NotImplementedError

    async def _fetch(
        self, after: int, upto: int, limit: int | None, *, with_predecessor: bool = False
    ) -> list[Row]:
        """Raw rows with ``after < seq <= upto`` in seq order, at most ``limit`` of them; with
        ``with_predecessor``, the row ``seq == after`` first (then up to ``limit + 1`` rows)."""
        raise NotImplementedError

    # --- state -----------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def head_hash(self) -> bytes:
        return self._head_hash

    @property
    def stats(self) -> WriteStats:
        return WriteStats(
            transactions=self._transactions, events=self._events, slow_paths=self._slow_paths
        )

    # --- writes ----------------------------------------------------------------------------

    async def append(
        self, batch: Sequence[Pending], *, expected_seq: int | None = None
    ) -> list[int]:
        self._check_writable()
        if not batch:
            await anyio.lowlevel.checkpoint()
            return []
        return await self._group.submit(Write(batch, expected_seq, None))

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        self._check_writable()
        await self._group.submit(Write((), None, snapshot))

    def _settle(self, plan: AppendPlan, appends: list[Write], saves: list[Write]) -> None:
        """The group committed: answer its calls and advance the cached tail."""
        for call, outcome in zip(appends, plan.outcomes, strict=True):
            call.outcome = outcome
        for call in saves:
            if call.outcome is None:
                call.outcome = []  # saved (a refused save already holds its error)
        self._transactions += 1
        if plan.rows:
            self._events += len(plan.rows)
            self._last_seq = plan.last_seq
            self._head_hash = plan.head_hash
            self._committed.fire()

    # --- reads -----------------------------------------------------------------------------

    async def read(
        self, after: int = 0, until: int | None = None, limit: int | None = None
    ) -> list[Record]:
        return await self._read(after, until, limit, None)

    async def iterate(self, after: int = 0, until: int | None = None) -> AsyncIterator[Record]:
        prev_hash: bytes | None = None
        while True:
            records = await self._read(after, until, CHUNK, prev_hash)
            for record in records:
                yield record
            if len(records) < CHUNK:
                return
            after, prev_hash = records[-1].seq, records[-1].hash

    async def follow(self, after: int = 0) -> AsyncIterator[Record]:
        prev_hash: bytes | None = None
        while not self._closed:
            # Taken before the read: a commit landing during the read sets this very event,
            # so no wake-up is lost.
            wake = self._committed.next()
            try:
                records = await self._read(after, None, CHUNK, prev_hash)
            except StoreError as exc:
                if exc.code == StoreCode.STORE_CLOSED:
                    return
                raise
            if not records:
                await wake.wait()
                continue
            for record in records:
                yield record
            after, prev_hash = records[-1].seq, records[-1].hash

    async def verify(self) -> VerifyReport:
        """Walk every stored row (past this store's own tail if another writer appended) and
        check that the head this store committed is still there."""
        self._check_open()
        known_seq, known_hash = self._last_seq, self._head_hash
        prev_seq, prev_hash, count = 0, GENESIS_HASH, 0

        def report(code: str, message: str, bad: int | None) -> VerifyReport:
            return VerifyReport(
                ok=False,
                records=count,
                last_seq=prev_seq,
                head_hash=prev_hash,
                first_bad_seq=bad,
                code=code,
                message=message,
            )

        try:
            while True:
                rows = await self._fetch(prev_seq, MAX_SEQ, CHUNK)
                for row in rows:
                    open_row(row, prev_seq, prev_hash)
                    if row[0] == known_seq and row[8] != known_hash:
                        return report(
                            StoreCode.CHAIN_BROKEN,
                            f"record {known_seq} is not the one that was committed (rewritten)",
                            known_seq,
                        )
                    prev_seq, prev_hash = row[0], row[8]
                    count += 1
                if len(rows) < CHUNK:
                    break
        except StoreError as exc:
            if exc.code == StoreCode.STORE_CLOSED:
                raise
            # Every check of open_row concerns the record after the last good one (a missing
            # position is named before anything else), and so does a read that fails.
            return report(exc.code, exc.message, prev_seq + 1)
        if prev_seq < known_seq:
            return report(
                StoreCode.CHAIN_BROKEN,
                f"the log ends at record {prev_seq} but record {known_seq} was committed",
                prev_seq + 1,
            )
        return VerifyReport(ok=True, records=count, last_seq=prev_seq, head_hash=prev_hash)

    async def _read(
        self, after: int, until: int | None, limit: int | None, prev_hash: bytes | None
    ) -> list[Record]:
        """Verified records after ``after``. ``prev_hash`` is the hash of record ``after`` when
        the caller already holds it (chunked reads); otherwise the predecessor row is fetched
        in the same query, so the first record is verified against its real predecessor."""
        self._check_open()
        if after < 0:
            raise StoreError(INVALID_INPUT, f"after must be >= 0, got {after}")
        if (limit is not None and limit <= 0) or (until is not None and until <= after):
            await anyio.lowlevel.checkpoint()
            return []
        upto = MAX_SEQ if until is None else until
        if prev_hash is not None or after == 0:
            rows = await self._fetch(after, upto, limit)
            prev = GENESIS_HASH if prev_hash is None else prev_hash
        else:
            rows = await self._fetch(after, upto, limit, with_predecessor=True)
            if not rows:
                return []
            if rows[0][0] != after:
                raise StoreError(StoreCode.CHAIN_BROKEN, f"record {after} is missing", seq=after)
            prev = rows[0][8]
            rows = rows[1:]
        out: list[Record] = []
        append = out.append
        prev_seq = after
        for row in rows:
            append(open_row(row, prev_seq, prev))
            prev_seq, prev = row[0], row[8]
        return out

    # --- guards ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(StoreCode.STORE_CLOSED, "the store is closed")

    def _check_writable(self) -> None:
        if self._closing:
            raise StoreError(StoreCode.STORE_CLOSED, "the store is closed")
        if self._read_only:
            raise StoreError(INVALID_INPUT, f"{self.name} was opened read-only")
