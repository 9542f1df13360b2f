"""What every durable store does above its database driver: the hash-chained log's rules.

:class:`~evlog.sqlite.SQLiteStore` and :class:`~evlog.postgres.PostgresStore` differ in how
they talk to their database (one file through aiosqlite; a server through asyncpg) and in how
they keep a second writer out while they re-plan. Everything else is the same promise and lives
here once, so the two cannot drift apart:

* the write path (:meth:`ChainedStore._write_group`): a fast path that plans a group from the
  cached tail and writes it in one statement, a slow path that re-plans it from what the
  database holds inside a transaction that keeps other writers out, the snapshot saves judged
  against the tail they commit with, and the failure rules (every call answered, the cached
  tail distrusted after any failure);
* the cached tail (``last_seq``, ``head_hash``) is only ever advanced by :meth:`_settle`,
  after the group's transaction committed;
* appends and snapshot saves go through one :class:`~evlog.group_commit.GroupCommit`;
* every record read is checked against its predecessor (its link and its own hash) before a
  caller sees it, chunk by chunk, so a replay of any length runs in bounded memory;
* ``follow`` cannot miss a commit: it takes the commit signal before it reads;
* ``verify`` walks the whole log, past this store's own tail, and also checks that the record
  this store committed last is still the one there (a rewritten tail is ``CHAIN_BROKEN``).

A backend supplies only its SQL and driver calls, the hooks listed first in the class (insert
rows, open a transaction, read the tail, look ids up, save snapshots, fetch rows, classify a
driver error, close its connections), plus its own open and snapshot load.

Why one module of ~440 lines: the write path and the read path share one discipline, the
cached tail the fast path trusts and ``verify`` compares against; split across files, that
invariant would have no single place to be read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import ClassVar

import anyio
import anyio.lowlevel

from evlog.append_plan import AppendPlan, AppendRequest, plan_appends
from evlog.errors import INVALID_INPUT, StoreCode, StoreError
from evlog.group_commit import GroupCommit, Write, WriteStats
from evlog.record import GENESIS_HASH, Pending, Record, Row, open_row
from evlog.store import CommitSignal, Snapshot, VerifyReport

MAX_SEQ = 2**63 - 1
CHUNK = 4096  # rows per read: bounded memory for a replay, few round trips
_NO_IDS: dict[bytes, int] = {}


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

    # --- what a backend supplies: its SQL and driver calls ---------------------------------

    CONSTRAINT_REFUSED: ClassVar[type[Exception]]
    """The driver's error for a statement that a constraint of the log refused (the seq
    PRIMARY KEY, the event_id UNIQUE index): the database wrote nothing of it, so the group is
    re-planned on the slow path."""

    ONE_STATEMENT_ROWS: ClassVar[int]
    """The most rows :meth:`_insert_committed` writes in one statement."""

    @property
    def name(self) -> str:
        """The log's location, for messages (never a password)."""
        raise NotImplementedError

    async def _insert_committed(self, rows: list[Row]) -> None:
        """Insert ``rows`` (at least one, at most ``ONE_STATEMENT_ROWS``) as ONE statement in
        autocommit mode: its own transaction, atomic and durable when it returns."""
        raise NotImplementedError

    def _transaction(self) -> AbstractAsyncContextManager[object]:
        """A write transaction on the writer connection: committed (durably) when the block
        ends, rolled back if it raises."""
        raise NotImplementedError

    async def _insert(self, rows: list[Row]) -> None:
        """Insert ``rows`` (at least one) inside the open transaction."""
        raise NotImplementedError

    async def _read_tail(self) -> tuple[int, bytes]:
        """Seq and hash of the newest stored record, ``(0, GENESIS_HASH)`` for an empty log,
        read inside the open transaction, which from here on keeps every other writer of the
        log waiting until it ends: what the slow path reads stays true while it writes."""
        raise NotImplementedError

    async def _stored_seqs(self, event_ids: list[bytes]) -> dict[bytes, int]:
        """The seq of each of ``event_ids`` (possibly none) already stored, read inside the
        open transaction."""
        raise NotImplementedError

    async def _save_snapshots(self, snapshots: list[Snapshot]) -> None:
        """Keep ``snapshots`` (already judged inside the log) inside the open transaction,
        replacing one at the same seq, then prune each code version to ``SNAPSHOTS_KEPT``."""
        raise NotImplementedError

    async def _fetch(
        self, after: int, upto: int, limit: int | None, *, with_predecessor: bool = False
    ) -> list[Row]:
        """Raw rows with ``after < seq <= upto`` in seq order, at most ``limit`` of them; with
        ``with_predecessor``, the row ``seq == after`` first (then up to ``limit + 1`` rows)."""
        raise NotImplementedError

    async def load_snapshot(self, code_version: str) -> Snapshot | None:
        """The newest snapshot written by ``code_version``, if any (read on the read side)."""
        raise NotImplementedError

    @staticmethod
    def _error(exc: BaseException, doing: str) -> StoreError:
        """``exc``, raised by the driver while ``doing``, as the StoreError a caller gets."""
        raise NotImplementedError

    async def _renew_writer(self) -> None:
        """Before each group: replace a writer connection the database dropped. A backend
        that replaced it sets ``_suspect``: the cached tail is then re-read, as after a
        failure."""

    async def _abandon_write(self) -> None:
        """After a failed group: end a transaction the failure may have left open, quietly
        (the group's own error is the one to report)."""

    async def _close_connections(self) -> None:
        """Close every connection of the store, quietly: a close that fails must neither stop
        the next one's nor reach the caller."""
        raise NotImplementedError

    # --- closing ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Refuse new calls, let the calls already queued commit, end followers, close.

        Shielded: an interrupted close would leave connections (and their threads) open.
        """
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            self._closing = True
            await self._group.wait_idle()
            self._closed = True
            self._committed.fire()
            await self._close_connections()

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

    async def _write_group(self, group: list[Write]) -> None:
        """Write ``group`` as one transaction and :meth:`_settle` it (see GroupCommit).

        Fast path: the group is planned from the cached tail, assuming none of its ids is
        stored yet, and written. The log's constraints turn every wrong assumption (a duplicate
        id, another writer having moved the tail) into ``CONSTRAINT_REFUSED`` with nothing
        written. Slow path, after such a refusal, after a refused call (it may be a retry of
        stored events), or while the cached tail is suspect: inside a transaction that keeps
        other writers out, the tail and the stored ids are read, not assumed, and the group is
        re-planned and written. A failure answers every call of the group ``STORE_FAILED``
        (its outcome is unknown: the caller retries with the same ids) and leaves the tail
        suspect, so the next group takes the slow path.
        """
        appends = [c for c in group if c.snapshot is None]
        saves = [c for c in group if c.snapshot is not None]
        requests: list[AppendRequest] = [(c.batch, c.expected_seq) for c in appends]
        try:
            await self._renew_writer()
            if not self._suspect:
                plan = plan_appends(requests, self._last_seq, self._head_hash, _NO_IDS)
                # A refused call may be a retry of stored events: only the slow path can tell.
                if not any(isinstance(o, StoreError) for o in plan.outcomes):
                    try:
                        await self._write_fast(plan, saves)
                    except self.CONSTRAINT_REFUSED:
                        pass  # nothing was written; re-plan from what the log holds
                    else:
                        self._settle(plan, appends, saves)
                        return
            self._slow_paths += 1
            async with self._transaction():
                plan = await self._plan_in_transaction(requests)
                await self._write_in_transaction(plan, saves)
            self._suspect = False
            self._settle(plan, appends, saves)
        except BaseException as exc:
            # Even a cancellation that bypassed the shield (a bare asyncio cancel) must not
            # leave the transaction open under the next group.
            self._suspect = True
            await self._abandon_write()
            if not isinstance(exc, Exception):
                raise
            for call in group:
                call.outcome = self._error(exc, "append failed, outcome unknown")

    async def _write_fast(self, plan: AppendPlan, saves: list[Write]) -> None:
        """Write ``plan`` and ``saves`` durably (returns after COMMIT).

        The common case, rows only and as many as one statement takes, is ONE statement in
        autocommit mode (one round trip or thread hop for the whole group); anything else is
        one explicit transaction.
        """
        if not saves and len(plan.rows) <= self.ONE_STATEMENT_ROWS:
            if plan.rows:
                await self._insert_committed(plan.rows)
            return
        async with self._transaction():
            await self._write_in_transaction(plan, saves)

    async def _plan_in_transaction(self, requests: list[AppendRequest]) -> AppendPlan:
        """Slow path, inside the transaction: the tail and the stored ids are read, not
        assumed, so the plan is right whatever the cache or another writer did."""
        last_seq, head_hash = await self._read_tail()
        ids = list({p.event_id for batch, _ in requests for p in batch})
        stored = await self._stored_seqs(ids)
        return plan_appends(requests, last_seq, head_hash, stored)

    async def _write_in_transaction(self, plan: AppendPlan, saves: list[Write]) -> None:
        if plan.rows:
            await self._insert(plan.rows)
        if saves:
            kept = _judge_saves(saves, plan.last_seq)
            if kept:
                await self._save_snapshots(kept)

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


def _judge_saves(saves: list[Write], last_seq: int) -> list[Snapshot]:
    """The snapshots of ``saves`` that stand inside the log (seq 0 .. ``last_seq``, the tail
    they commit with); each other save is answered ``INVALID_INPUT`` naming its seq."""
    kept: list[Snapshot] = []
    for call in saves:
        call.outcome = None  # an earlier, rolled-back attempt may have judged it
        snap = call.snapshot
        assert snap is not None
        if 0 <= snap.seq <= last_seq:
            kept.append(snap)
        else:
            call.outcome = StoreError(
                INVALID_INPUT,
                f"snapshot at seq {snap.seq} is outside the log (last seq {last_seq})",
                seq=snap.seq,
            )
    return kept


def verified_tail(rows: list[Row]) -> tuple[int, bytes]:
    """Seq and hash of the newest record, given the (up to) two newest rows, newest first,
    after checking its hash and its link to its predecessor (or to genesis when it is the
    only one): checked at open, it catches a torn or tampered tail before anything is
    appended on top of it."""
    if not rows:
        return 0, GENESIS_HASH
    tail = rows[0]
    if len(rows) > 1:
        open_row(tail, rows[1][0], rows[1][8])
    else:
        open_row(tail, 0, GENESIS_HASH)
    return tail[0], tail[8]
