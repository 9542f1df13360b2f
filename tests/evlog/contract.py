"""The ``EventStore`` contract, written once and run against every backend.

A backend's test module subclasses :class:`StoreContract` and supplies the hooks: where a log
lives (``location``), how to open a store on it, and raw access that bypasses the store (read,
rewrite or remove one stored row; list the kept snapshots), the way an attacker, a bad disk or
an old version of the code would touch the file. Every behaviour of ``evlog/store.py`` is
checked here, so every backend (memory, SQLite, PostgreSQL) is held to one standard; what the
durable ones promise beyond it is in :mod:`tests.evlog.durable_contract`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import anyio
import msgspec
import pytest

from evlog import events as ev
from evlog.errors import INVALID_INPUT, LoraLedgerError, StoreCode
from evlog.events import (
    EngineJoined,
    SessionBound,
    VersionAllocated,
    VersionPublished,
)
from evlog.record import GENESIS_HASH, Pending, Record, Row, chain_hash, new_event_id, pending
from evlog.store import SNAPSHOTS_KEPT, EventStore, Snapshot, VerifyReport

# --- helpers -------------------------------------------------------------------------------


def bound(i: int, owner: str = "w0") -> Pending:
    return pending(SessionBound(session=f"s{i}", owner=owner, version_id=1, revision=1))


def batch_of(n: int, tag: str = "b") -> list[Pending]:
    return [bound(i, owner=tag) for i in range(n)]


def rehashed(row: Row, **changes: Any) -> dict[str, Any]:
    """Columns for ``row`` with ``changes`` applied and its hash recomputed, i.e. a record
    rewritten *consistently* (it verifies on its own; only the chain can betray it)."""
    names = ("seq", "event_id", "stream", "type", "schema", "recorded_at", "payload", "prev_hash")
    fields: dict[str, Any] = dict(zip(names, row[:8], strict=True)) | changes
    fields["hash"] = chain_hash(
        fields["prev_hash"],
        fields["seq"],
        fields["event_id"],
        fields["stream"],
        fields["type"],
        fields["schema"],
        fields["recorded_at"],
        fields["payload"],
    )
    del fields["seq"]
    return fields


async def collect(it: AsyncIterator[Record]) -> list[Record]:
    return [r async for r in it]


@contextmanager
def raises_code(
    code: str, seq: int | None = None
) -> Iterator[pytest.ExceptionInfo[LoraLedgerError]]:
    """``pytest.raises`` for a LoraLedgerError with ``code`` (and, if given, ``details['seq']``)
    and a message, which names the problem (the seq, when given)."""
    with pytest.raises(LoraLedgerError) as info:
        yield info
    err = info.value
    assert err.code == code, f"expected {code}, got {err.code}: {err.message}"
    assert isinstance(err.message, str) and err.message, err
    if seq is not None:
        assert str(seq) in err.message, err.message
    if seq is not None:
        assert err.details.get("seq") == seq, (err.details, err.message)


def assert_bad(report: VerifyReport, code: str, first_bad_seq: int, records: int) -> None:
    """A failed verification: what broke, where (named in its message too), what is trusted."""
    assert (report.ok, report.code, report.first_bad_seq) == (False, code, first_bad_seq), report
    assert (report.records, report.last_seq) == (records, first_bad_seq - 1), report
    assert f"record {first_bad_seq}" in report.message, report.message


class StoreContract:
    """Subclass per backend; implement the hooks below. Tests are methods of this class."""

    # --- hooks -----------------------------------------------------------------------------

    @pytest.fixture
    def location(self, tmp_path: Any) -> Any:
        """Where one log lives (a file path, a MemoryLog...): opened and reopened by tests."""
        raise NotImplementedError

    def opened(self, location: Any) -> AbstractAsyncContextManager[EventStore]:
        """Open a store on ``location`` (create it if empty); close it on exit."""
        raise NotImplementedError

    def raw_row(self, location: Any, seq: int) -> Row:
        """The stored row at ``seq``, read without the store."""
        raise NotImplementedError

    def rewrite(self, location: Any, seq: int, **columns: Any) -> None:
        """Overwrite columns of the stored row at ``seq`` without the store."""
        raise NotImplementedError

    def remove(self, location: Any, seq: int) -> None:
        """Delete the stored row at ``seq`` without the store."""
        raise NotImplementedError

    def snapshot_seqs(self, location: Any, code_version: str) -> list[int]:
        """Seqs of the snapshots kept for ``code_version``, ascending, read without the store."""
        raise NotImplementedError

    # --- empty log and round trip ----------------------------------------------------------

    @pytest.mark.anyio
    async def test_empty_log(self, location: Any) -> None:
        async with self.opened(location) as store:
            assert isinstance(store, EventStore)
            assert store.last_seq == 0
            assert store.head_hash == GENESIS_HASH
            assert await store.read() == []
            assert await store.read(after=3) == [] and await store.read(after=3, limit=2) == []
            assert await collect(store.iterate()) == []
            assert await collect(store.iterate(after=3)) == []
            report = await store.verify()
            assert report.ok and report.records == 0 and report.last_seq == 0
            assert report.head_hash == GENESIS_HASH
            assert await store.load_snapshot("v1") is None
            assert await store.append([]) == []
            assert store.last_seq == 0

    @pytest.mark.anyio
    async def test_round_trip_keeps_every_field(self, location: Any) -> None:
        originals = [
            EngineJoined(engine="e0", incarnation="i-1", endpoint="http://e0", kind="vllm"),
            VersionAllocated(version_id=3, digest="ab" * 32, lora_name="p@d-3-abab", size_bytes=9),
            SessionBound(session="s1", owner="w0", version_id=3, revision=1),
            VersionPublished(version_id=3, attempt=1, revision=1, retired=None),
        ]
        items = [pending(e, recorded_at=1_700_000_000.25 + i) for i, e in enumerate(originals)]
        async with self.opened(location) as store:
            assert await store.append(items[:1]) == [1]
            assert await store.append(items[1:], expected_seq=1) == [2, 3, 4]
            records = await store.read()
            assert [r.seq for r in records] == [1, 2, 3, 4]
            prev = GENESIS_HASH
            for record, item, event in zip(records, items, originals, strict=True):
                assert record.event == event
                assert record.event_id == item.event_id
                assert record.stream == item.stream
                assert record.type == type(event).__name__ == item.type
                assert record.schema == item.schema == type(event).SCHEMA
                assert record.recorded_at == item.recorded_at
                assert record.payload == item.payload
                assert record.prev_hash == prev
                assert record.hash == chain_hash(
                    prev,
                    record.seq,
                    item.event_id,
                    item.stream,
                    item.type,
                    item.schema,
                    item.recorded_at,
                    item.payload,
                )
                prev = record.hash
            assert store.last_seq == 4
            assert store.head_hash == records[-1].hash
            assert records[0].stream == "engine-e0" and records[1].stream == "version-3"

    @pytest.mark.anyio
    async def test_seqs_are_gap_free_across_calls(self, location: Any) -> None:
        async with self.opened(location) as store:
            got: list[int] = []
            for size in (1, 3, 2, 5, 1):
                got += await store.append(batch_of(size, tag=f"t{len(got)}"))
            assert got == list(range(1, 13))
            assert [r.seq for r in await store.read()] == got

    # --- expected_seq and atomicity --------------------------------------------------------

    @pytest.mark.anyio
    async def test_refused_batch_writes_nothing(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(3, "a"))
            head = store.head_hash
            refused = batch_of(5, "r")
            with raises_code(StoreCode.SEQ_CONFLICT) as info:
                await store.append(refused, expected_seq=1)
            assert info.value.details == {"expected": 1, "actual": 3}
            assert store.last_seq == 3 and store.head_hash == head
            assert len(await store.read()) == 3
            with raises_code(StoreCode.SEQ_CONFLICT):
                await store.append(refused, expected_seq=4)  # ahead of the log: refused too
            # None of the refused ids was kept: the same events now get fresh seqs.
            assert await store.append(refused, expected_seq=3) == [4, 5, 6, 7, 8]
            assert (await store.verify()).ok

    @pytest.mark.anyio
    async def test_expected_seq_accepts_the_current_tail(self, location: Any) -> None:
        async with self.opened(location) as store:
            assert await store.append(batch_of(2, "a"), expected_seq=0) == [1, 2]
            assert await store.append(batch_of(1, "b"), expected_seq=2) == [3]
            with raises_code(StoreCode.SEQ_CONFLICT):
                await store.append(batch_of(1, "c"), expected_seq=2)

    # --- idempotency -----------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_duplicate_returns_the_original_seq(self, location: Any) -> None:
        a, b, c, d = bound(1), bound(2), bound(3), bound(4)
        async with self.opened(location) as store:
            assert await store.append([a, b]) == [1, 2]
            assert await store.append([b, c]) == [2, 3]
            assert await store.append([a]) == [1]
            assert await store.append([d, d, a]) == [4, 4, 1]
            assert store.last_seq == 4
            assert [r.event_id for r in await store.read()] == [
                a.event_id,
                b.event_id,
                c.event_id,
                d.event_id,
            ]
            # A duplicate with different content is still the stored event (the id decides).
            clash = Pending(**{**msgspec.structs.asdict(b), "payload": c.payload})
            assert await store.append([clash]) == [2]
            assert (await store.read(after=1, limit=1))[0].payload == b.payload

    @pytest.mark.anyio
    async def test_retried_batch_with_stale_expected_seq_gets_original_seqs(
        self, location: Any
    ) -> None:
        first = batch_of(3, "x")
        async with self.opened(location) as store:
            assert await store.append(first, expected_seq=0) == [1, 2, 3]
            await store.append(batch_of(2, "y"))
            # The reply was lost; the caller retries exactly what it sent.
            assert await store.append(first, expected_seq=0) == [1, 2, 3]
            # A batch mixing stored and new events under a stale expected_seq is a conflict.
            with raises_code(StoreCode.SEQ_CONFLICT):
                await store.append([first[0], bound(99, "z")], expected_seq=0)
            assert store.last_seq == 5

    @pytest.mark.anyio
    async def test_duplicates_are_recognised_after_reopen(self, location: Any) -> None:
        first = batch_of(3, "x")
        async with self.opened(location) as store:
            await store.append(first, expected_seq=0)
            await store.append(batch_of(2, "y"))
        async with self.opened(location) as store:
            assert await store.append(first, expected_seq=0) == [1, 2, 3]
            assert await store.append([first[1]]) == [2]
            assert store.last_seq == 5

    @pytest.mark.anyio
    async def test_a_batch_of_any_size_is_stored_whole(self, location: Any) -> None:
        """Sizes around the powers of two and the thousand-row marks a backend may batch its
        statements by; then a retry of a 1,500-event batch, every id recognised."""
        sizes = (1, 2, 3, 511, 512, 513, 1023, 1024, 1025)
        async with self.opened(location) as store:
            last = 0
            for size in sizes:
                got = await store.append(batch_of(size, f"size{size}"), expected_seq=last)
                assert got == list(range(last + 1, last + size + 1)), size
                last += size
            big = batch_of(1500, "big")
            first = await store.append(big)
            assert first == list(range(last + 1, last + 1501))
            assert await store.append(big) == first
            assert await store.append(big[::-1]) == first[::-1]
            report = await store.verify()
            assert (report.ok, report.records) == (True, last + 1500)

    @pytest.mark.anyio
    async def test_a_large_batch_is_atomic_and_stores_a_repeated_event_once(
        self, location: Any
    ) -> None:
        """3,000 events in one call (more than a backend may put in one statement), one of them
        twice: stored whole, once each, the repeat answered with its seq; a refused call of
        3,000 writes nothing."""
        async with self.opened(location) as store:
            await store.append(batch_of(1, "first"))
            big = batch_of(3000, "big")
            big[2500] = big[10]  # a duplicate inside: the store keeps one, answers its seq twice
            got = await store.append(big, expected_seq=1)
            assert got[2500] == got[10] and store.last_seq == 3000
            with raises_code(StoreCode.SEQ_CONFLICT):
                await store.append(batch_of(3000, "late"), expected_seq=1)
            assert store.last_seq == 3000
            assert (await store.verify()).ok

    # --- concurrency -----------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_concurrent_appenders_get_unique_gap_free_unsplit_seqs(
        self, location: Any
    ) -> None:
        results: list[tuple[list[Pending], list[int]]] = []

        async def appender(k: int, store: EventStore) -> None:
            for j in range(40):
                batch = [bound(i, owner=f"w{k}-{j}") for i in range(1 + (k + j) % 3)]
                results.append((batch, await store.append(batch)))

        async with self.opened(location) as store:
            async with anyio.create_task_group() as tg:
                for k in range(50):
                    tg.start_soon(appender, k, store)
            seqs = sorted(s for _, got in results for s in got)
            assert seqs == list(range(1, len(seqs) + 1))
            assert store.last_seq == len(seqs)
            by_seq = {r.seq: r for r in await store.read()}
            for batch, got in results:
                # one call, one contiguous run of seqs, in the batch's order
                assert got == list(range(got[0], got[0] + len(batch)))
                assert [by_seq[s].event_id for s in got] == [p.event_id for p in batch]
            assert (await store.verify()).ok

    @pytest.mark.anyio
    async def test_a_refused_caller_does_not_affect_concurrent_callers(self, location: Any) -> None:
        outcomes: dict[int, list[int] | str] = {}
        retried = batch_of(2, "retry")

        async def appender(k: int, store: EventStore) -> None:
            if k % 7 == 3:
                expected: int | None = 10_000  # always stale
                batch = batch_of(2, f"bad{k}")
            elif k % 7 == 5:
                expected, batch = 0, retried  # a retry of a committed batch
            else:
                expected, batch = None, batch_of(2, f"ok{k}")
            try:
                outcomes[k] = await store.append(batch, expected_seq=expected)
            except LoraLedgerError as exc:
                outcomes[k] = exc.code

        async with self.opened(location) as store:
            assert await store.append(retried) == [1, 2]
            async with anyio.create_task_group() as tg:
                for k in range(40):
                    tg.start_soon(appender, k, store)
            for k, outcome in outcomes.items():
                if k % 7 == 3:
                    assert outcome == StoreCode.SEQ_CONFLICT
                elif k % 7 == 5:
                    assert outcome == [1, 2]
                else:
                    assert isinstance(outcome, list) and len(outcome) == 2
            written = sum(1 for k in outcomes if k % 7 not in (3, 5))
            assert store.last_seq == 2 + 2 * written
            owners = {r.event.owner for r in await store.read()}  # type: ignore[union-attr]
            assert not any(o.startswith("bad") for o in owners)
            assert (await store.verify()).ok

    # --- follow ----------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_follow_sees_every_commit_once_in_order(self, location: Any) -> None:
        seen: list[int] = []
        async with self.opened(location) as store:
            await store.append(batch_of(3, "a"))

            async def follower() -> None:
                async for record in store.follow(after=1):
                    seen.append(record.seq)
                    if record.seq == 12:
                        return

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(follower)
                    await anyio.sleep(0.01)  # the follower is now waiting for commits
                    for size in (1, 4, 2, 2):
                        await store.append(batch_of(size, f"f{size}"))
                        await anyio.sleep(0.001)
            assert seen == list(range(2, 13))

    @pytest.mark.anyio
    async def test_follow_ends_when_the_store_closes(self, location: Any) -> None:
        seen: list[int] = []
        ended = anyio.Event()
        async with self.opened(location) as store:
            await store.append(batch_of(2, "a"))

            async def follower() -> None:
                async for record in store.follow():
                    seen.append(record.seq)
                ended.set()

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(follower)
                    await anyio.sleep(0.01)
                    await store.close()
                    await ended.wait()
        assert seen == [1, 2]

    @pytest.mark.anyio
    async def test_follow_can_be_abandoned_or_cancelled(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(3, "a"))
            with anyio.fail_after(10):
                async for record in store.follow():
                    if record.seq == 2:
                        break
                with anyio.move_on_after(0.05) as scope:
                    async for _ in store.follow(after=3):
                        pytest.fail("nothing was committed after 3")
                assert scope.cancelled_caught
            assert await store.append(batch_of(1, "b")) == [4]

    # --- reads -----------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_read_ranges(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(10, "a"))

            async def seqs(
                after: int = 0, until: int | None = None, limit: int | None = None
            ) -> list[int]:
                return [r.seq for r in await store.read(after, until, limit)]

            assert await seqs() == list(range(1, 11))
            assert await seqs(after=3) == list(range(4, 11))
            assert await seqs(after=3, until=6) == [4, 5, 6]
            assert await seqs(until=2) == [1, 2]
            assert await seqs(limit=3) == [1, 2, 3]
            assert await seqs(after=2, limit=3) == [3, 4, 5]
            assert await seqs(after=8, limit=5) == [9, 10]
            assert await seqs(after=4, until=9, limit=2) == [5, 6]
            assert await seqs(after=10) == []
            assert await seqs(after=15) == []
            assert await seqs(after=5, until=5) == []
            assert await seqs(limit=0) == []
            with raises_code(INVALID_INPUT):
                await store.read(after=-1)

    @pytest.mark.anyio
    async def test_iterate_streams_ranges_in_order(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(5000, "big"))
            await store.append(batch_of(3, "small"))
            all_seqs = [r.seq for r in await collect(store.iterate())]
            assert all_seqs == list(range(1, 5004))
            part = [r.seq for r in await collect(store.iterate(after=10, until=4500))]
            assert part == list(range(11, 4501))
            assert [r.seq for r in await collect(store.iterate(after=5001))] == [5002, 5003]
            report = await store.verify()  # the chain across chunk boundaries, to the end
            assert (report.ok, report.records, report.last_seq) == (True, 5003, 5003)
            assert report.head_hash == store.head_hash

    # --- corruption ------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_a_corrupted_row_is_refused_and_named(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(8, "a"))
            payload = self.raw_row(location, 5)[6]
            self.rewrite(location, 5, payload=payload[:-1] + bytes([payload[-1] ^ 1]))
            with raises_code(StoreCode.CORRUPT_RECORD, seq=5):
                await store.read()
            with raises_code(StoreCode.CORRUPT_RECORD, seq=5):
                await store.read(after=4, limit=1)
            with raises_code(StoreCode.CORRUPT_RECORD, seq=5):
                await collect(store.iterate())
            with raises_code(StoreCode.CORRUPT_RECORD, seq=5), anyio.fail_after(5):
                async for _ in store.follow(after=2):
                    pass
            assert [r.seq for r in await store.read(until=4)] == [1, 2, 3, 4]
            report = await store.verify()
            assert_bad(report, StoreCode.CORRUPT_RECORD, 5, records=4)
            assert report.head_hash == self.raw_row(location, 4)[8]

    @pytest.mark.anyio
    async def test_a_consistently_rewritten_record_breaks_the_chain(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(8, "a"))
            forged = pending(
                SessionBound(session="forged", owner="a", version_id=1, revision=1)
            ).payload
            self.rewrite(location, 4, **rehashed(self.raw_row(location, 4), payload=forged))
            with raises_code(StoreCode.CHAIN_BROKEN, seq=5):
                await store.read()
            assert_bad(await store.verify(), StoreCode.CHAIN_BROKEN, 5, records=4)

    @pytest.mark.anyio
    async def test_a_record_spliced_onto_another_predecessor_is_refused(
        self, location: Any
    ) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(8, "a"))
            self.rewrite(location, 6, **rehashed(self.raw_row(location, 6), prev_hash=b"\x01" * 32))
            with raises_code(StoreCode.CHAIN_BROKEN, seq=6):
                await store.read(after=2)
            assert_bad(await store.verify(), StoreCode.CHAIN_BROKEN, 6, records=5)

    @pytest.mark.anyio
    async def test_a_missing_record_is_named(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(8, "a"))
            self.remove(location, 5)
            with raises_code(StoreCode.CHAIN_BROKEN, seq=5):
                await store.read()
            with raises_code(StoreCode.CHAIN_BROKEN, seq=5):
                await store.read(after=5)  # its successor cannot be linked either
            # an empty range reads nothing, so nothing is missing from it
            assert await store.read(after=5, until=5) == []
            assert await store.read(after=5, limit=0) == []
            assert_bad(await store.verify(), StoreCode.CHAIN_BROKEN, 5, records=4)

    @pytest.mark.anyio
    async def test_an_undecodable_or_mislabelled_payload_is_corrupt(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(6, "a"))
            self.rewrite(location, 3, **rehashed(self.raw_row(location, 3), payload=b"\xc1junk"))
            with raises_code(StoreCode.CORRUPT_RECORD, seq=3):
                await store.read()
            self.rewrite(location, 5, **rehashed(self.raw_row(location, 5), type="SessionReleased"))
            with raises_code(StoreCode.CORRUPT_RECORD, seq=5):
                await store.read(after=4)
            assert_bad(await store.verify(), StoreCode.CORRUPT_RECORD, 3, records=2)

    @pytest.mark.anyio
    async def test_a_tampered_tail_is_refused_at_open(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(4, "a"))
        payload = self.raw_row(location, 4)[6]
        self.rewrite(location, 4, payload=payload + b"\x00")
        with raises_code(StoreCode.CORRUPT_RECORD, seq=4):
            async with self.opened(location):
                pass
        self.rewrite(location, 4, **rehashed(self.raw_row(location, 4), prev_hash=b"\x07" * 32))
        with raises_code(StoreCode.CHAIN_BROKEN, seq=4):
            async with self.opened(location):
                pass

    @pytest.mark.anyio
    async def test_a_log_of_one_record_reopens_and_its_tail_is_checked(self, location: Any) -> None:
        """The tail check at open links the newest record to its predecessor, or to the genesis
        hash when it is the only one."""
        async with self.opened(location) as store:
            assert await store.append(batch_of(1, "only")) == [1]
            head = store.head_hash
        async with self.opened(location) as store:
            assert (store.last_seq, store.head_hash) == (1, head)
            assert [r.seq for r in await store.read()] == [1]
        self.rewrite(location, 1, **rehashed(self.raw_row(location, 1), prev_hash=b"\x07" * 32))
        with raises_code(StoreCode.CHAIN_BROKEN, seq=1):
            async with self.opened(location):
                pass

    # --- snapshots -------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_a_snapshot_may_stand_at_any_seq_of_the_log_and_nowhere_else(
        self, location: Any
    ) -> None:
        """Seq 0 (the empty state) and the last seq are inside the log; -1 and last + 1 not."""
        async with self.opened(location) as store:
            await store.save_snapshot(Snapshot(code_version="v1", seq=0, state=b"empty"))
            assert await store.load_snapshot("v1") == Snapshot(
                code_version="v1", seq=0, state=b"empty"
            )
            await store.append(batch_of(3, "a"))
            await store.save_snapshot(Snapshot(code_version="v1", seq=3, state=b"tail"))
            assert (await store.load_snapshot("v1")).seq == 3  # type: ignore[union-attr]
            for seq in (-1, 4):
                with raises_code(INVALID_INPUT, seq=seq):
                    await store.save_snapshot(Snapshot(code_version="v2", seq=seq, state=b"x"))
            assert await store.load_snapshot("v2") is None

    @pytest.mark.anyio
    async def test_snapshots_newest_per_code_version(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(9, "a"))
            await store.save_snapshot(Snapshot(code_version="v1", seq=3, state=b"three"))
            await store.save_snapshot(Snapshot(code_version="v1", seq=7, state=b"seven"))
            await store.save_snapshot(Snapshot(code_version="v1", seq=5, state=b"five"))
            await store.save_snapshot(Snapshot(code_version="v2", seq=4, state=b"other"))
            assert await store.load_snapshot("v1") == Snapshot(
                code_version="v1", seq=7, state=b"seven"
            )
            assert await store.load_snapshot("v2") == Snapshot(
                code_version="v2", seq=4, state=b"other"
            )
            assert await store.load_snapshot("v3") is None
            await store.save_snapshot(Snapshot(code_version="v1", seq=7, state=b"again"))
            assert (await store.load_snapshot("v1")).state == b"again"  # type: ignore[union-attr]
            with raises_code(INVALID_INPUT, seq=10):
                await store.save_snapshot(Snapshot(code_version="v1", seq=10, state=b"future"))
        assert self.snapshot_seqs(location, "v1") == [5, 7][-SNAPSHOTS_KEPT:]
        assert self.snapshot_seqs(location, "v2") == [4]
        async with self.opened(location) as store:
            assert (await store.load_snapshot("v1")).seq == 7  # type: ignore[union-attr]

    # --- reopen ----------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_reopen_keeps_everything_and_continues_the_chain(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(5, "a"))
            before = await store.read()
            head = store.head_hash
        async with self.opened(location) as store:
            assert store.last_seq == 5 and store.head_hash == head
            assert await store.read() == before
            assert await store.append(batch_of(2, "b"), expected_seq=5) == [6, 7]
            records = await store.read(after=5)
            assert records[0].prev_hash == head
        async with self.opened(location) as store:
            report = await store.verify()
            assert report.ok and report.records == 7 and report.head_hash == store.head_hash

    @pytest.mark.anyio
    async def test_a_closed_store_refuses_calls(self, location: Any) -> None:
        async with self.opened(location) as store:
            await store.append(batch_of(1, "a"))
        with raises_code(StoreCode.STORE_CLOSED):
            await store.append(batch_of(1, "b"))
        with raises_code(StoreCode.STORE_CLOSED):
            await store.read()
        with raises_code(StoreCode.STORE_CLOSED):
            await store.save_snapshot(Snapshot(code_version="v", seq=1, state=b""))
        await store.close()  # closing twice is harmless

    # --- schema evolution ------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_old_schema_records_are_upcast_on_read(
        self, location: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A log written by code where EngineJoined (schema 1) called its endpoint ``url``...
        old = Pending(
            event_id=new_event_id(),
            stream="engine-e0",
            type="EngineJoined",
            schema=1,
            recorded_at=1_700_000_000.0,
            payload=msgspec.msgpack.encode(
                {"type": "EngineJoined", "engine": "e0", "incarnation": "i0", "url": "http://e0"}
            ),
        )
        async with self.opened(location) as store:
            await store.append([old, bound(1)])
        # ...is read by code whose EngineJoined is schema 2.
        monkeypatch.setattr(EngineJoined, "SCHEMA", 2)
        async with self.opened(location) as store:
            with raises_code(StoreCode.UNKNOWN_SCHEMA, seq=1):
                await store.read()  # no upcaster for 1 -> 2 yet: refused, not misread

            def v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
                data = dict(data)
                data["endpoint"] = data.pop("url")
                return data

            monkeypatch.setitem(ev._UPCASTERS, ("EngineJoined", 1), v1_to_v2)
            first = (await store.read(limit=1))[0]
            assert first.event == EngineJoined(engine="e0", incarnation="i0", endpoint="http://e0")
            assert first.schema == 1  # the record is unchanged; only the reading code moved on
            assert (await store.verify()).ok

    @pytest.mark.anyio
    async def test_a_schema_newer_than_the_code_is_refused(self, location: Any) -> None:
        newer = Pending(**{**msgspec.structs.asdict(bound(1)), "schema": SessionBound.SCHEMA + 1})
        async with self.opened(location) as store:
            await store.append([bound(0), newer, bound(2)])
            with raises_code(StoreCode.UNKNOWN_SCHEMA, seq=2):
                await store.read()
            assert_bad(await store.verify(), StoreCode.UNKNOWN_SCHEMA, 2, records=1)
