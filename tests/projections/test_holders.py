"""What made a reclaim possible, and which sessions held a skipped publication's slots: folded
from the log alone (``projections/holders.py``)."""

from __future__ import annotations

import pytest

from evlog.events import VersionPublished
from evlog.memory import MemoryStore
from evlog.record import Record, pending
from projections.holders import HolderFold
from publisher.core import commands as c
from tests.publisher.core.book import Book


async def _records(book: Book) -> list[Record]:
    store = MemoryStore()
    await store.append([pending(e, recorded_at=float(i)) for i, e in enumerate(book.events)])
    return await store.read()


def _fold(records: list[Record], versions: tuple[int, ...] | None = None) -> HolderFold:
    fold = HolderFold(versions)
    for record in records:
        fold.apply(record)
    return fold


@pytest.mark.anyio
async def test_the_last_binding_to_go_made_the_reclaim_possible() -> None:
    """v1 retires with two sessions; the second one's owner lets its lease run out: that
    release (session, owner, cause, seq) is what made the reclaim possible."""
    book = Book().bootstrap()
    book.run(c.RegisterOwner(owner="w2", ttl_s=5.0, now=0.0))
    book.publish(1)
    book.run(c.Bind(session="s-1", owner="w1"))
    book.run(c.Bind(session="s-2", owner="w2"))
    book.publish(2)
    book.run(c.Release(session="s-1", owner="w1"))
    book.run(c.ExpireOwner(owner="w2", now=100.0, last_seen=1.0))
    book.reclaim(1)
    records = await _records(book)
    released = [r for r in records if type(r.event).__name__ == "SessionReleased"]
    claimed = next(r for r in records if type(r.event).__name__ == "ReclaimClaimed")

    (cause,) = _fold(records).reclaims[1]
    assert cause.enabled_by == "release" and cause.claimed_seq == claimed.seq
    last = cause.last_release
    assert last is not None
    assert (last.session, last.owner, last.cause, last.seq) == (
        "s-2",
        "w2",
        "lease_expired",
        released[-1].seq,
    )
    assert cause.retired_seq is not None and cause.retired_seq < last.seq


@pytest.mark.anyio
async def test_a_version_whose_sessions_left_before_it_retired_was_freed_by_its_retirement() -> (
    None
):
    book = Book().bootstrap()
    book.publish(1)
    book.run(c.Bind(session="s-1", owner="w1"))
    book.run(c.Release(session="s-1", owner="w1", cause="idle"))
    book.publish(2)  # retires v1, which nobody holds any more
    book.reclaim(1)
    records = await _records(book)
    retired = next(
        r for r in records if isinstance(r.event, VersionPublished) and r.event.retired == 1
    )
    (cause,) = _fold(records).reclaims[1]
    assert (cause.enabled_by, cause.retired_seq) == ("retirement", retired.seq)
    assert cause.last_release is not None and cause.last_release.cause == "idle"


def test_the_fault_runs_reclaims_and_skip(fault_records: list[Record]) -> None:
    """The fault run: v1 went when s-b (w1) was closed; nothing was ever bound to v3, so its
    retirement freed it; v5's skip found v2 held by s-d."""
    fold = _fold(fault_records, versions=(5,))
    (v1,) = fold.reclaims[1]
    assert v1.enabled_by == "release" and v1.last_release is not None
    assert (v1.last_release.session, v1.last_release.owner, v1.last_release.cause) == (
        "s-b",
        "w1",
        "closed",
    )
    (v3,) = fold.reclaims[3]
    assert (v3.enabled_by, v3.last_release) == ("retirement", None)
    (skip,) = fold.skips.values()
    assert skip == {2: ("s-d",)}


def test_skips_of_versions_not_asked_about_keep_no_sessions(fault_records: list[Record]) -> None:
    assert _fold(fault_records, versions=(1,)).skips == {}
