"""``replay --why``: each stall of a version, field for field. Whoever asks why a version did
not publish reads which record stalled it, why (the refusal's own words), what held each slot
or blocked it (its state then, why it held, the sessions bound to it) and when each obstacle
cleared, and when the version went on, if it did: each is a promise of the explanation."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from evlog.memory import MemoryStore
from evlog.record import Record, pending
from projections.history import History
from projections.holders import HolderFold
from projections.stalls import Obstacle, Stall, explain
from publisher.core import commands as c
from tests.publisher.core.book import Book, digest_of

pytestmark = pytest.mark.anyio

FATAL = (
    "version 2 attempt 1 ended FAILED_FATAL (TIMEOUT): it may be loaded somewhere until "
    "inventories prove it absent"
)


async def _records(book: Book) -> list[Record]:
    store = MemoryStore()
    await store.append([pending(e, recorded_at=float(i)) for i, e in enumerate(book.events)])
    return await store.read()


async def test_a_block_names_its_cause_and_when_the_blocker_cleared() -> None:
    """v2's attempt ends fatal: v3 (never allocated, so no history of its own) and a retry of
    v2 are blocked until inventories prove v2 absent; v2 then goes on with a new attempt, v3
    never asks again."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.allocate(2)
    book.ready_all(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="t"))
    book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), "PUBLICATION_BLOCKED")
    book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), "PUBLICATION_BLOCKED")
    for engine in ("e0", "e1"):
        book.run(c.ObserveInventory(engine=engine, incarnation=book.incarnation(engine),
                                    adapters=()))  # fmt: skip
    book.allocate(2)
    records = await _records(book)
    assert [r.type for r in records[22:24]] == ["PublicationBlocked", "PublicationBlocked"]
    assert [r.type for r in records[-2:]] == ["FatalResolved", "AttemptStarted"]
    history = History().apply_all(records)
    blocker = Obstacle(
        version_id=2,
        state="FAILED_FATAL",
        reason="",
        bound=0,
        sessions=(),
        cleared_seq=29,
        cleared_at=28.0,
        cleared_by="FatalResolved",
        cleared_to="FAILED_RETRYABLE",
    )
    on_v3 = Stall(
        version_id=3,
        seq=23,
        at=22.0,
        event="PublicationBlocked",
        code="PUBLICATION_BLOCKED",
        cause=FATAL,
        obstacles=(blocker,),
    )
    assert explain(history, 3) == [on_v3]
    on_v2 = replace(on_v3, version_id=2, seq=24, at=23.0, went_on_seq=30, went_on_at=29.0)
    assert explain(history, 2) == [on_v2]
    assert explain(history, 9) == []
    holders = HolderFold()  # a block has no holding sessions: the holders' fold adds none
    for record in records:
        holders.apply(record)
    assert explain(history, 2, holders) == [on_v2]


async def test_a_skip_names_each_slot_holder_its_sessions_and_when_it_cleared() -> None:
    """Capacity 2: v1 retired but bound to s1, v2 the default; v3 is skipped until s1 lets
    go and v1 is reclaimed, then allocated. The sessions come from the holders' fold; without
    it, none are named."""
    book = Book().bootstrap(capacity=2)
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(2)
    book.run(c.Allocate(version_id=3, digest=digest_of(3)))
    book.run(c.Release(session="s1", owner="w1"))
    book.reclaim(1)
    book.allocate(3)
    records = await _records(book)
    history = History().apply_all(records)
    holders = HolderFold()
    for record in records:
        holders.apply(record)
    v1 = Obstacle(
        version_id=1,
        state="RETIRED",
        reason="sessions_bound",
        bound=1,
        sessions=("s1",),
        cleared_seq=26,
        cleared_at=25.0,
        cleared_by="ReclaimClaimed",
        cleared_to="RECLAIMING",
    )
    v2 = Obstacle(version_id=2, state="PUBLISHED", reason="default", bound=0, sessions=())
    stall = Stall(
        version_id=3,
        seq=24,
        at=23.0,
        event="PublicationSkipped",
        code="CAPACITY_ERROR",
        cause="capacity 2 is full: v1 retired, sessions bound (1 sessions), v2 the default",
        obstacles=(v1, v2),
        went_on_seq=30,
        went_on_at=29.0,
    )
    assert explain(history, 3, holders) == [stall]
    unnamed = (replace(v1, sessions=()), v2)
    assert explain(history, 3) == [replace(stall, obstacles=unnamed)]
