"""Timelines and session histories folded from a real log."""

from __future__ import annotations

import pytest

from evlog.memory import MemoryStore
from evlog.record import pending
from projections.history import History
from publisher.core import commands as c
from tests.publisher.core.book import Book, digest_of


async def _history_of(book: Book, **kwargs: object) -> History:
    store = MemoryStore()
    await store.append([pending(e, recorded_at=float(i)) for i, e in enumerate(book.events)])
    return History(**kwargs).apply_all(await store.read())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_version_timeline_shows_each_transition_with_its_cause() -> None:
    book = Book().bootstrap()
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.publish(2)
    book.run(c.Release(session="s", owner="w1"))
    book.reclaim(1)
    history = await _history_of(book)
    moves = [(e.event, e.from_state, e.to_state) for e in history.versions[1]]
    changes = [(ev, a, b) for ev, a, b in moves if a != b]
    assert changes == [
        ("VersionAllocated", None, "LOADING"),
        ("VersionPublished", "LOADING", "PUBLISHED"),
        ("VersionPublished", "PUBLISHED", "RETIRED"),
        ("ReclaimClaimed", "RETIRED", "RECLAIMING"),
        ("VersionReclaimed", "RECLAIMING", "RECLAIMED"),
    ]
    assert [e.seq for e in history.versions[1]] == sorted(e.seq for e in history.versions[1])
    retire = next(e for e in history.versions[1] if e.to_state == "RETIRED")
    assert retire.detail == "revision 2, retired v1"


@pytest.mark.anyio
async def test_session_history_and_filter() -> None:
    book = Book().bootstrap()
    book.publish(1)
    for s in ("a", "b"):
        book.run(c.Bind(session=s, owner="w1"))
    book.run(c.Release(session="a", owner="w1"))
    book.run(c.Forget(sessions=("a",)))
    history = await _history_of(book, sessions=["a"])
    assert set(history.sessions) == {"a"}
    assert [e.event for e in history.sessions["a"]] == [
        "SessionBound",
        "SessionReleased",
        "SessionsForgotten",
    ]
    assert history.sessions["a"][1].detail == "v1, closed"


@pytest.mark.anyio
async def test_engine_timeline_records_restart_and_repair() -> None:
    book = Book().bootstrap()
    book.publish(1)
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    book.run(c.RestoreVersion(version_id=1, engine="e1", incarnation="e1-i2"))
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i2"))
    history = await _history_of(book)
    events = [e.event for e in history.engines["e1"]]
    assert events[-3:] == ["EngineRestarted", "VersionRestored", "EngineRepaired"]
    assert history.engines["e1"][-3].detail == "e1-i1 -> e1-i2; lost v1; holds nothing"
    assert history.engines["e1"][-2].detail == "v1 e1 (e1-i2); loaded v1; holds v1"
    assert (history.engines["e1"][-1].from_state, history.engines["e1"][-1].to_state) == (
        "not routable",
        "routable",
    )


@pytest.mark.anyio
async def test_a_blocked_publication_is_explained_and_listed_as_an_incident() -> None:
    from projections.incidents import IncidentFold
    from projections.stalls import explain

    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.allocate(2)
    book.ready_all(2)
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="TIMEOUT", reason="t"))
    for _ in range(3):  # a trainer retrying: one record
        book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), "PUBLICATION_BLOCKED")
    for engine in ("e0", "e1"):
        book.run(c.ObserveInventory(engine=engine, incarnation=book.incarnation(engine),
                                    adapters=()))  # fmt: skip
    book.publish(3)
    history = await _history_of(book)
    (stall,) = explain(history, 3)
    (obstacle,) = stall.obstacles
    assert (stall.code, obstacle.version_id, obstacle.state) == ("PUBLICATION_BLOCKED", 2,
                                                                  "FAILED_FATAL")  # fmt: skip
    assert (obstacle.cleared_by, obstacle.cleared_to) == ("FatalResolved", "FAILED_RETRYABLE")
    assert stall.went_on_seq is not None and stall.went_on_seq > obstacle.cleared_seq  # type: ignore[operator]
    store = MemoryStore()
    await store.append([pending(e, recorded_at=float(i)) for i, e in enumerate(book.events)])
    fold = IncidentFold(stuck_after=60.0, pinned_top=5)
    async for record in store.iterate(after=0):
        fold.apply(record)
    blocked = [i for i in fold.finish() if i.kind == "blocked"]
    assert [i.subject for i in blocked] == ["v3"] and "v2" in blocked[0].summary
