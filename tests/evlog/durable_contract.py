"""What every durable store promises beyond the ``EventStore`` contract, run on each of them.

SQLite and PostgreSQL share one write path (:class:`evlog.chained_store.ChainedStore`: group
commit, a fast path from the cached tail, a slow path that re-plans under the database's write
lock, the failure rules), and these tests hold both to it: calls queued meanwhile merge into
few transactions; a second writer on the same log is detected and handled (and a stale ledger
fenced); cancellation never strands or misanswers a caller; a write that fails below the store
answers ``STORE_FAILED`` and leaves the cached tail distrusted until a slow path re-read it; a
database that is not a log of this layout is refused; a read-only open reads and refuses
writes.

A backend's test module subclasses :class:`DurableStoreContract` and supplies, besides the
hooks of :class:`~tests.evlog.contract.StoreContract`, raw access of its own kind: another
connection that holds the log's write lock (a write of the store then waits inside its
database call, for as long as the test says), a trigger that refuses every insert, tables
dropped or planted behind the store's back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from evlog.chained_store import CHUNK, ChainedStore
from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.group_commit import WriteStats
from evlog.record import Row
from evlog.store import Snapshot
from publisher.core.errors import Code
from publisher.core.ledger import Ledger
from tests.evlog.contract import StoreContract, batch_of, bound, raises_code, rehashed


class WriteLock(Protocol):
    """Another connection's hold on the log's write lock: a write of the store waits on it,
    inside its database call, until :meth:`release` (reads never wait)."""

    async def take(self) -> None: ...

    async def release(self) -> None: ...

    async def close(self) -> None:
        """Release the lock if it is held, and close the connection."""
        ...


async def _until_queued(store: ChainedStore, n: int) -> None:
    """Let the event loop run until a leader writes and ``n`` calls wait in the queue."""
    while not store._group.leading or store._group.queued != n:
        await anyio.lowlevel.checkpoint()


class DurableStoreContract(StoreContract):
    """Subclass per durable backend; implement the hooks below and those of StoreContract."""

    # --- hooks -----------------------------------------------------------------------------

    store_class: type[ChainedStore]
    """The backend's store class (subclassed by a test that stages a store's internals)."""

    REFUSED_INSERT_CAUSE: str
    """The driver's error class name for an insert that :meth:`refuse_inserts` refused."""

    MISSING_TABLE: tuple[str, str]
    """The driver's error class name for a query of a dropped table, and words its message
    holds."""

    async def connect(
        self, location: Any, store_class: type[ChainedStore] | None = None
    ) -> ChainedStore:
        """Open a store (of ``store_class``, a subclass of the backend's, if given) on
        ``location``; the caller closes it."""
        raise NotImplementedError

    async def connect_read_only(self, location: Any) -> ChainedStore:
        """Open the log at ``location`` read-only, as the forensic tools do."""
        raise NotImplementedError

    def write_lock(self, location: Any) -> WriteLock:
        """Another connection to ``location`` that can hold the log's write lock."""
        raise NotImplementedError

    def refuse_inserts(self, location: Any) -> None:
        """Make the database refuse every insert into the log (a trigger that raises)."""
        raise NotImplementedError

    def allow_inserts(self, location: Any) -> None:
        """Undo :meth:`refuse_inserts`."""
        raise NotImplementedError

    def drop_tables(self, location: Any) -> None:
        """Drop the log's tables (records and snapshots) behind the store's back."""
        raise NotImplementedError

    def plant_foreign_tables(self, location: Any) -> None:
        """Make ``location`` (empty) another application's database, whose tables the store
        must not take for a log."""
        raise NotImplementedError

    def mark_newer_layout(self, location: Any) -> None:
        """Mark the log at ``location`` as written in a layout newer than this code reads."""
        raise NotImplementedError

    @asynccontextmanager
    async def writes_held(self, location: Any) -> AsyncIterator[WriteLock]:
        """The log's write lock held by another connection for the block."""
        lock = self.write_lock(location)
        try:
            await lock.take()
            yield lock
        finally:
            await lock.close()

    @asynccontextmanager
    async def second_group(self, location: Any) -> AsyncIterator[_SecondGroup]:
        """A store on ``location`` and the staging of :class:`_SecondGroup` on it, both closed
        when the block ends."""
        store = await self.connect(location)
        staged = _SecondGroup(store, self.write_lock(location))
        try:
            yield staged
        finally:
            await staged.lock.close()
            await store.close()

    # --- group commit ----------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_queued_appends_are_merged_into_few_transactions(self, location: Any) -> None:
        store = await self.connect(location)
        try:
            got: list[list[int]] = []

            async def appender(k: int) -> None:
                got.append(await store.append(batch_of(2, f"w{k}")))

            async with anyio.create_task_group() as tg:
                for k in range(50):
                    tg.start_soon(appender, k)
            stats = store.stats
            assert stats.events == 100 and store.last_seq == 100
            # one by one would be 50 transactions; combining writes what queued meanwhile at once
            assert stats.transactions <= 5, stats
            assert stats.slow_paths == 0
            assert sorted(s for seqs in got for s in seqs) == list(range(1, 101))
        finally:
            await store.close()

    @pytest.mark.anyio
    async def test_the_write_statistics_count_transactions_events_and_slow_paths(
        self, location: Any
    ) -> None:
        store = await self.connect(location)
        try:
            assert store.stats == WriteStats(transactions=0, events=0, slow_paths=0)
            await store.append(batch_of(3, "a"))
            await store.append(batch_of(2, "b"))
            await store.append([bound(1, "c")])
            assert store.stats == WriteStats(transactions=3, events=6, slow_paths=0)
            first = batch_of(2, "d")
            await store.append(first)
            assert await store.append(first) == [7, 8]  # a duplicate: its ids collide, re-planned
            await store.save_snapshot(Snapshot(code_version="v", seq=8, state=b""))
            assert store.stats == WriteStats(transactions=6, events=8, slow_paths=1)
        finally:
            await store.close()

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("sizes", "groups"),
        [((4096, 4095, 1), 1), ((4096, 4096, 1), 2), ((8193,), 1)],
        ids=["8192 events merge", "8193 split", "one call over the bound"],
    )
    async def test_a_group_holds_at_most_8192_events_but_always_its_first_call(
        self, location: Any, sizes: tuple[int, ...], groups: int
    ) -> None:
        """Calls queued behind a write are merged up to 8,192 events per transaction (bounding
        the first caller's wait and the memory of a group); a single call above the bound is
        written alone, whole."""
        store = await self.connect(location)
        try:
            answered: dict[int, list[int]] = {}

            async def append(k: int, size: int) -> None:
                answered[k] = await store.append(batch_of(size, f"c{k}"))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg, self.writes_held(location):
                    tg.start_soon(append, -1, 1)
                    await _until_queued(store, 0)  # the first caller writes alone, held
                    for k, size in enumerate(sizes):
                        tg.start_soon(append, k, size)
                    await _until_queued(store, len(sizes))
            assert store.stats.transactions == 1 + groups
            assert [len(answered[k]) for k in range(len(sizes))] == list(sizes)
            assert store.last_seq == 1 + sum(sizes) and (await store.verify()).ok
        finally:
            await store.close()

    @pytest.mark.anyio
    async def test_close_lets_queued_appends_finish_and_refuses_new_ones(
        self, location: Any
    ) -> None:
        answered: dict[int, list[int] | str] = {}

        async def appender(store: ChainedStore, k: int) -> None:
            try:
                answered[k] = await store.append(batch_of(2, f"w{k}"))
            except LoraLedgerError as exc:
                answered[k] = exc.code

        store = await self.connect(location)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for k in range(20):
                    tg.start_soon(appender, store, k)
                await anyio.lowlevel.checkpoint()
                await store.close()
                tg.start_soon(appender, store, 99)
        assert answered.pop(99) == StoreCode.STORE_CLOSED
        acked = {s for v in answered.values() if isinstance(v, list) for s in v}
        async with self.opened(location) as again:
            assert again.last_seq == len(acked) and acked == set(range(1, len(acked) + 1))
            assert (await again.verify()).ok

    # --- a second writer on the same log ---------------------------------------------------

    @pytest.mark.anyio
    async def test_a_second_writer_on_the_same_log_is_detected_and_handled(
        self, location: Any
    ) -> None:
        one = await self.connect(location)
        two = await self.connect(location)
        try:
            assert await one.append(batch_of(3, "one")) == [1, 2, 3]
            # ``two`` believes the log is empty: its seq 1 collides, it re-reads the tail.
            assert await two.append(batch_of(2, "two")) == [4, 5]
            assert await one.append(batch_of(1, "one-again")) == [6]
            with raises_code(StoreCode.SEQ_CONFLICT):
                await two.append(batch_of(1, "stale"), expected_seq=5)
            assert one.stats.slow_paths >= 1 and two.stats.slow_paths >= 1
            report = await two.verify()
            assert report.ok and report.records == 6
        finally:
            await two.close()
            await one.close()

    @pytest.mark.anyio
    async def test_two_writers_racing_never_share_a_seq(self, location: Any) -> None:
        """Two stores appending at once on one log: every answered seq is unique, the chain is
        one chain (the log refuses a second seq n; the loser re-plans under the write lock)."""
        answered: dict[str, list[tuple[bytes, int]]] = {"a": [], "b": []}
        a = await self.connect(location)
        b = await self.connect(location)
        try:

            async def appender(name: str, store: ChainedStore, k: int) -> None:
                for j in range(15):
                    batch = batch_of(1 + (k + j) % 3, f"{name}{k}-{j}")
                    seqs = await store.append(batch)
                    answered[name] += [(p.event_id, s) for p, s in zip(batch, seqs, strict=True)]

            async with anyio.create_task_group() as tg:
                for k in range(8):
                    tg.start_soon(appender, "a", a, k)
                    tg.start_soon(appender, "b", b, k)
            pairs = answered["a"] + answered["b"]
            seqs = sorted(s for _, s in pairs)
            assert seqs == list(range(1, len(pairs) + 1))
            by_seq = {r.seq: r.event_id for r in await a.read()}
            assert all(by_seq[s] == eid for eid, s in pairs)
            assert (await a.verify()).ok and (await b.verify()).ok
            assert a.stats.slow_paths + b.stats.slow_paths >= 1
        finally:
            await b.close()
            await a.close()

    @pytest.mark.anyio
    async def test_a_stale_ledger_is_fenced_by_its_successor(self, location: Any) -> None:
        """The Ray restart story on one log: a ledger that kept running (a zombie on a node cut
        off) is refused by the store the moment its successor appended, and stops (FENCED)."""
        async with self.opened(location) as old_store, Ledger.open(old_store) as old:
            await old.create_deployment("d", prefix="p", capacity=2)
            await old.register_owner("w1", ttl_s=60)
            async with self.opened(location) as new_store, Ledger.open(new_store) as new:
                assert new.state.epoch == old.state.epoch + 1
                await new.register_owner("w2", ttl_s=60)
                with pytest.raises(LoraLedgerError) as fenced:
                    await old.register_owner("w3", ttl_s=60)
                assert fenced.value.code == Code.FENCED
                report = await new_store.verify()
                assert report.ok and report.last_seq == new_store.last_seq

    @pytest.mark.anyio
    async def test_verify_notices_a_head_rewritten_or_truncated_behind_its_back(
        self, location: Any
    ) -> None:
        """``verify`` checks that the record this store committed last is still the one there,
        and still there at all."""
        async with self.opened(location) as store:
            await store.append(batch_of(6))
            # a different record 6, consistently hashed onto record 5
            forged = rehashed(self.raw_row(location, 6), payload=bound(77).payload)
            self.rewrite(location, 6, **forged)
            report = await store.verify()
            assert (report.ok, report.first_bad_seq, report.code) == (
                False,
                6,
                StoreCode.CHAIN_BROKEN,
            )
            assert report.message == "record 6 is not the one that was committed (rewritten)"
            self.remove(location, 6)
            report = await store.verify()
            assert (report.ok, report.first_bad_seq, report.code) == (
                False,
                6,
                StoreCode.CHAIN_BROKEN,
            )
            assert report.records == 5
            assert report.message == "the log ends at record 5 but record 6 was committed"

    # --- failures below the store ----------------------------------------------------------

    @pytest.mark.anyio
    async def test_after_a_failed_write_the_next_group_rereads_the_tail_then_trusts_it_again(
        self, location: Any
    ) -> None:
        """A write that fails below the store (here a trigger that refuses every insert: a real
        database error) answers STORE_FAILED, outcome unknown, naming the cause; the cached tail
        is then suspect, so the next group reads it inside its transaction (the slow path), and
        the one after trusts it again. On an empty log: the slow path starts the chain at seq 1.
        """
        store = await self.connect(location)
        try:
            self.refuse_inserts(location)
            with raises_code(StoreCode.STORE_FAILED) as info:
                await store.append(batch_of(2, "lost"))
            assert info.value.message.startswith("append failed, outcome unknown: ")
            assert info.value.details == {"cause": self.REFUSED_INSERT_CAUSE}
            assert store.last_seq == 0
            failed_slow = store.stats.slow_paths  # a backend may retry the refusal slowly first
            self.allow_inserts(location)
            # the next group (a snapshot save) takes the slow path, which writes saves too
            await store.save_snapshot(Snapshot(code_version="v", seq=0, state=b"s"))
            assert store.stats.slow_paths == failed_slow + 1
            assert await store.append(batch_of(2, "a"), expected_seq=0) == [1, 2]
            assert store.stats.slow_paths == failed_slow + 1
            assert await store.load_snapshot("v") == Snapshot(code_version="v", seq=0, state=b"s")
            owners = [r.event.owner for r in await store.read()]  # type: ignore[union-attr]
            assert owners == ["a", "a"]
            assert await store.append(batch_of(2, "b"), expected_seq=2) == [3, 4]
            assert store.stats.slow_paths == failed_slow + 1
            assert (await store.verify()).ok
        finally:
            await store.close()

    @pytest.mark.anyio
    async def test_after_a_failed_first_write_the_chain_still_starts_at_seq_1(
        self, location: Any
    ) -> None:
        """The slow path reads the tail of an empty log as (0, genesis), not as what the cache
        says: the first record written after a failure is record 1, chained to genesis."""
        async with self.opened(location) as store:
            self.refuse_inserts(location)
            with raises_code(StoreCode.STORE_FAILED):
                await store.append(batch_of(2, "lost"))
            self.allow_inserts(location)
            assert await store.append(batch_of(2, "a")) == [1, 2]
            assert [r.seq for r in await store.read()] == [1, 2]
            assert (await store.verify()).ok

    @pytest.mark.anyio
    async def test_reads_that_fail_below_the_store_are_store_failed(self, location: Any) -> None:
        """The tables dropped behind the store's back: a read and a snapshot load fail with
        STORE_FAILED naming what was being read and the cause; verify reports it, before
        record 1."""
        cause, words = self.MISSING_TABLE
        async with self.opened(location) as store:
            await store.append(batch_of(3))
            self.drop_tables(location)
            with raises_code(StoreCode.STORE_FAILED) as info:
                await store.read()
            assert info.value.message.startswith("cannot read records after 0: ")
            assert words in info.value.message
            assert info.value.details == {"cause": cause}
            with raises_code(StoreCode.STORE_FAILED) as info:
                await store.load_snapshot("v1")
            assert info.value.message.startswith("cannot read snapshots: ")
            assert words in info.value.message
            assert info.value.details == {"cause": cause}
            report = await store.verify()
            assert (report.ok, report.code, report.first_bad_seq, report.records) == (
                False,
                StoreCode.STORE_FAILED,
                1,
                0,
            )
            assert words in report.message

    @pytest.mark.anyio
    async def test_a_verify_that_meets_a_close_between_chunks_is_store_closed(
        self, location: Any
    ) -> None:
        """A verify whose next chunk meets a close (staged by the real store holding its second
        fetch) fails STORE_CLOSED: it must not report the log broken."""
        async with self.opened(location) as store:
            await store.append(batch_of(CHUNK + 5))
        paused, resume = anyio.Event(), anyio.Event()

        def paused_before_its_second_fetch(base: type[ChainedStore]) -> type[ChainedStore]:
            class Paused(base):  # type: ignore[valid-type,misc]
                fetches = 0

                async def _fetch(
                    self,
                    after: int,
                    upto: int,
                    limit: int | None,
                    *,
                    with_predecessor: bool = False,
                ) -> list[Row]:
                    self.fetches += 1
                    if self.fetches == 2:
                        paused.set()
                        await resume.wait()
                    rows: list[Row] = await super()._fetch(
                        after, upto, limit, with_predecessor=with_predecessor
                    )
                    return rows

            return Paused

        store = await self.connect(location, paused_before_its_second_fetch(self.store_class))
        outcome: list[Exception] = []

        async def verify() -> None:
            try:
                await store.verify()
            except Exception as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(verify)
            await paused.wait()
            await store.close()
            resume.set()
        assert len(outcome) == 1, "the verify must fail, not report the log"
        with raises_code(StoreCode.STORE_CLOSED):
            raise outcome[0]

    # --- what is opened --------------------------------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize("what", ["another application's tables", "a newer layout"])
    async def test_a_database_that_is_not_a_log_in_this_layout_is_refused(
        self, location: Any, what: str
    ) -> None:
        """Tables named like the log's that another application wrote are ``CORRUPT_STORE``;
        a log in a layout newer than this code reads is ``UNKNOWN_SCHEMA``: never misread."""
        if what == "a newer layout":
            async with self.opened(location) as store:
                await store.append(batch_of(2))
            self.mark_newer_layout(location)
            code, words = StoreCode.UNKNOWN_SCHEMA, "layout"
        else:
            self.plant_foreign_tables(location)
            code, words = StoreCode.CORRUPT_STORE, "loraledger log"
        with raises_code(code) as info:
            await self.connect(location)
        assert words in info.value.message

    @pytest.mark.anyio
    async def test_a_read_only_store_reads_verifies_and_refuses_writes(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(3))
        reader = await self.connect_read_only(location)
        try:
            assert [r.seq for r in await reader.read()] == [1, 2, 3]
            assert (await reader.verify()).ok
            with raises_code(INVALID_INPUT):
                await reader.append(batch_of(1, "x"))
            with raises_code(INVALID_INPUT):
                await reader.save_snapshot(Snapshot(code_version="v", seq=3, state=b""))
        finally:
            await reader.close()
        async with self.opened(location) as store:
            assert store.last_seq == 3 and await store.load_snapshot("v") is None

    # --- cancellation inside the group commit ----------------------------------------------

    @pytest.mark.anyio
    async def test_cancelled_callers_never_strand_the_others(self, location: Any) -> None:
        async with self.opened(location) as store:
            done: dict[int, list[int]] = {}
            scopes: dict[int, anyio.CancelScope] = {}

            async def appender(k: int) -> None:
                with anyio.CancelScope() as scope:
                    scopes[k] = scope
                    done[k] = await store.append(batch_of(3, f"w{k}"))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for k in range(30):
                        tg.start_soon(appender, k)
                    await anyio.lowlevel.checkpoint()  # every appender queued; the first leads
                    for k in range(0, 30, 4):  # the leader and waiters, cancelled mid-flight
                        scopes[k].cancel()
            assert all(k in done for k in range(30) if k % 4)
            # the log holds whole batches only, gap-free, and stays writable
            records = await store.read()
            assert len(records) % 3 == 0 and len(records) >= 3 * len(done)
            assert await store.append(batch_of(1, "after")) == [len(records) + 1]
            assert (await store.verify()).ok

    @pytest.mark.anyio
    async def test_a_caller_cancelled_before_its_call_was_taken_is_never_written(
        self, location: Any
    ) -> None:
        """While the leader writes, w1 and w2 queue; w1 is cancelled: it is dropped (never
        written) and the leadership passes to w2, which writes its own batch."""
        store = await self.connect(location)
        try:
            answered: dict[str, list[int]] = {}
            scope = anyio.CancelScope()

            async def append(tag: str, scope: anyio.CancelScope | None = None) -> None:
                with scope or anyio.CancelScope():
                    answered[tag] = await store.append(batch_of(2, tag))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg, self.writes_held(location):
                    tg.start_soon(append, "leader")
                    await _until_queued(store, 0)  # the leader took its call, waits on the lock
                    tg.start_soon(append, "w1", scope)
                    tg.start_soon(append, "w2")
                    await _until_queued(store, 2)
                    scope.cancel()
                    await _until_queued(store, 1)
            assert answered == {"leader": [1, 2], "w2": [3, 4]}
            owners = [r.event.owner for r in await store.read()]  # type: ignore[union-attr]
            assert owners == ["leader", "leader", "w2", "w2"]
        finally:
            await store.close()

    @pytest.mark.anyio
    async def test_a_leader_cancelled_while_it_writes_still_answers_its_group(
        self, location: Any
    ) -> None:
        """The group is written for every caller in it: the leader's cancellation does not
        interrupt the write (a shielded scope), so the others in its group get their seqs."""
        store = await self.connect(location)
        try:
            answered: dict[str, list[int] | str] = {}
            scopes = {tag: anyio.CancelScope() for tag in ("first", "second", "w1", "w2", "w3")}

            async def append(tag: str) -> None:
                with scopes[tag]:
                    try:
                        answered[tag] = await store.append(batch_of(2, tag))
                    except LoraLedgerError as exc:
                        answered[tag] = exc.code
                    if tag == "first":
                        scopes["second"].cancel()  # the next leader, woken but not yet writing

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg, self.writes_held(location):
                    tg.start_soon(append, "first")
                    await _until_queued(store, 0)
                    for tag in ("second", "w1", "w2", "w3"):
                        tg.start_soon(append, tag)
                    await _until_queued(store, 4)
            assert answered["first"] == [1, 2]
            assert {tag: answered.get(tag) for tag in ("w1", "w2", "w3")} == {
                "w1": [5, 6],
                "w2": [7, 8],
                "w3": [9, 10],
            }
            assert store.last_seq == 10 and (await store.verify()).ok
        finally:
            await store.close()

    @pytest.mark.anyio
    async def test_a_caller_cancelled_after_its_call_was_taken_is_written_anyway(
        self, location: Any
    ) -> None:
        """w1 is cancelled while the group holding its call is being written: its events land
        (it cannot know, and a retry with the same ids is answered with their seqs)."""
        async with self.second_group(location) as staged:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await staged.stage(tg)
                    staged.scopes["w1"].cancel()
                    await anyio.sleep(0.01)
                    await staged.release()
            assert staged.answered == {"first": [1, 2], "second": [3, 4], "w2": [7, 8]}
            store = staged.store
            owners = [r.event.owner for r in await store.read()]  # type: ignore[union-attr]
            assert owners == ["first"] * 2 + ["second"] * 2 + ["w1"] * 2 + ["w2"] * 2
            assert await store.append(staged.batches["w1"]) == [5, 6]  # the retry

    @pytest.mark.anyio
    async def test_a_group_interrupted_under_the_shield_answers_store_failed(
        self, location: Any
    ) -> None:
        """A bare asyncio cancellation of the leader reaches through anyio's shield: the others
        in its group are answered STORE_FAILED (the write may have landed), never left waiting
        or told they were written, and the next group re-reads the tail."""
        async with self.second_group(location) as staged:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await staged.stage(tg)
                    staged.tasks["second"].cancel()
                    while len(staged.answered) < 4:  # noqa: ASYNC110 -- answers, no event
                        await anyio.sleep(0.001)
                    await staged.release()
            interrupted = "STORE_FAILED: the write was interrupted"
            assert staged.answered == {
                "first": [1, 2],
                "second": "cancelled under the shield",
                "w1": interrupted,
                "w2": interrupted,
            }
            store = staged.store
            slow = store.stats.slow_paths
            with anyio.fail_after(10):
                got = await store.append(batch_of(1, "after"))
            assert store.stats.slow_paths == slow + 1  # the tail was suspect: re-read
            assert got == [store.last_seq] and (await store.verify()).ok


class _SecondGroup:
    """Stages a group of several calls mid-write: ``first`` writes alone, held by the lock,
    while ``second``, w1 and w2 queue; the lock is released and ``first`` commits; ``second``
    then leads [second, w1, w2], and the lock is taken again just before that group's insert
    (the store's own insert call, wrapped once), which therefore waits inside its database call
    until :meth:`release`."""

    def __init__(self, store: ChainedStore, lock: WriteLock) -> None:
        self.store = store
        self.lock = lock
        self.answered: dict[str, list[int] | str] = {}
        self.scopes = {tag: anyio.CancelScope() for tag in ("first", "second", "w1", "w2")}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.batches = {tag: batch_of(2, tag) for tag in self.scopes}
        self.held_again = anyio.Event()

    async def append(self, tag: str) -> None:
        self.tasks[tag] = asyncio.current_task()  # type: ignore[assignment]
        with self.scopes[tag]:
            try:
                self.answered[tag] = await self.store.append(self.batches[tag])
            except LoraLedgerError as exc:
                self.answered[tag] = f"{exc.code}: {exc.message}"
            except asyncio.CancelledError:
                if self.scopes[tag].cancel_called:
                    raise  # anyio's own cancellation: its scope catches it
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                self.answered[tag] = "cancelled under the shield"

    async def stage(self, tg: anyio.abc.TaskGroup) -> None:
        store = self.store
        await self.lock.take()
        tg.start_soon(self.append, "first")
        await _until_queued(store, 0)  # first's insert is in its database call, on the lock
        for tag in ("second", "w1", "w2"):
            tg.start_soon(self.append, tag)
        await _until_queued(store, 3)
        insert = store._insert_committed

        async def behind_the_lock_again(rows: list[Row]) -> None:
            store._insert_committed = insert  # type: ignore[method-assign]
            await self.lock.take()
            self.held_again.set()
            await insert(rows)  # runs up to its database call before the test resumes

        store._insert_committed = behind_the_lock_again  # type: ignore[method-assign]
        await self.lock.release()  # first commits; second then takes its group and waits
        await self.held_again.wait()
        assert self.answered == {"first": [1, 2]} and not store._group.queued

    async def release(self) -> None:
        await self.lock.release()
