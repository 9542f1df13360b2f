"""Timelines and session histories folded from a real log."""

from __future__ import annotations

import pytest

from evlog.memory import MemoryStore
from evlog.record import pending
from projections.history import History
from publisher import commands as c
from tests.publisher.book import Book


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
