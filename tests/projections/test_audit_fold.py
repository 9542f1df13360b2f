"""The session audit, fact for fact: what ``loraledger audit`` prints for each session life is
read by a person reconstructing what a session ran on, so every field is a promise: which
version, when bound and released, and each thing that happened to that version (with its
seq, its time, its words and whether the session was bound at the time)."""

from __future__ import annotations

import pytest

from evlog.memory import MemoryStore
from evlog.record import Record, pending
from projections.audit import AuditFold, SessionAudit, VersionFact
from publisher.core import commands as c
from tests.publisher.core.book import Book

pytestmark = pytest.mark.anyio


async def _records(book: Book) -> list[Record]:
    store = MemoryStore()
    await store.append([pending(e, recorded_at=float(i)) for i, e in enumerate(book.events)])
    return await store.read()


async def _run() -> list[Record]:
    """A release of a session never bound (a life of its own), then ``x`` bound to v1 while
    an engine served other content under v1's name and was restored, v1 replaced by v2, and
    both sessions forgotten."""
    book = Book().bootstrap()
    book.publish(1)
    book.run(c.Release(session="ghost", owner="w1"))
    book.run(c.Bind(session="x", owner="w1"))
    v1 = book.state.versions[1]
    digests = ((v1.lora_name, "0" * 64),)
    e1 = book.incarnation("e1")
    book.run(
        c.ObserveInventory(engine="e1", incarnation=e1, adapters=(v1.lora_name,), digests=digests)
    )
    book.run(c.RestoreVersion(version_id=1, engine="e1", incarnation=e1))
    book.publish(2)
    book.run(c.Release(session="x", owner="w1"))
    book.run(c.Forget(sessions=("ghost", "x")))
    records = await _records(book)
    assert [r.type for r in records[14:]] == [
        "SessionReleased",
        "SessionBound",
        "ServedContentMismatch",
        "InventoryObserved",
        "VersionRestored",
        *["VersionAllocated", "AttemptStarted", "TransportClaimed"],
        *["EnginePrepared", "EngineReady"] * 2,
        *["VersionPublished", "SessionReleased", "SessionsForgotten"],
    ]
    return records


X = SessionAudit(
    session="x",
    owner="w1",
    version_id=1,
    lora_name="agent@dep-1-6b86b273ff34fce1",
    digest="6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b",
    revision=1,
    bound_seq=16,
    bound_at=15.0,
    released_seq=28,
    released_at=27.0,
    cause="closed",
    forgotten_seq=29,
    forgotten_at=28.0,
    version_facts=(
        VersionFact(seq=7, at=6.0, what="loading", detail="", during=False),
        VersionFact(
            seq=14, at=13.0, what="published", detail="default at revision 1", during=False
        ),
        VersionFact(
            seq=17,
            at=16.0,
            what="content_mismatch",
            detail="e1 served other content under its name (digest)",
            during=True,
        ),
        VersionFact(
            seq=19, at=18.0, what="restored", detail="reloaded on restarted e1", during=True
        ),
        VersionFact(seq=27, at=26.0, what="retired", detail="replaced by v2", during=True),
    ),
)
GHOST = SessionAudit(
    session="ghost",
    owner="w1",
    released_seq=15,
    released_at=14.0,
    cause="closed",
    forgotten_seq=29,
    forgotten_at=28.0,
)


async def test_every_life_is_audited_fact_for_fact_in_the_order_it_began() -> None:
    """A life that was never bound comes first here, and does not end the list."""
    records = await _run()
    assert AuditFold().apply_all(records).finish() == [GHOST, X]


async def test_a_selection_keeps_its_sessions_whole_and_ignores_the_others() -> None:
    """By session or by owner, a selected session's life is the same as in the whole audit;
    forgetting a session outside the selection is no error."""
    records = await _run()
    assert AuditFold(sessions=["x"]).apply_all(records).finish() == [X]
    assert AuditFold(owner="w1").apply_all(records).finish() == [GHOST, X]
    assert AuditFold(owner="w2").apply_all(records).finish() == []
