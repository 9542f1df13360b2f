"""Client-held sessions, decided and folded (no store; the book checks the invariants after
every step): a session bound through a relay (an OpenAI face, registered with
``sessions_idle_s``) belongs to its client, not to the process that relayed it. No end of the
relay's life (a clean exit, a lease expiry, a new incarnation) releases it; a later process binds
it again and gets the same binding; a release from anyone records the binding's owner. It ends
by an explicit release, ``max_staleness``, an operator, or the ledger's idle release, which is
refused unless the evidence it carries shows the session idle and which records that evidence.

Before, every end of the relay's life released every session it had bound (``owner_exited``,
``lease_expired``, ``owner_restarted``): 0 of 8 sessions bound through ``serve``'s OpenAI
routes survived its restart."""

from __future__ import annotations

import pytest

from evlog.events import Event, SessionBound, SessionReleased, SessionsForgotten
from publisher.core import commands as c
from publisher.core.errors import Code
from publisher.core.outcomes import Bound, Deregistered, Expired, Released
from tests.publisher.core.book import Book

IDLE_S = 100.0


@pytest.fixture
def book() -> Book:
    """v1 published; relay ``face`` (life a) bound ``r1``, ``r2``; worker ``w`` (owner-held,
    life a) bound ``o1``; then v2 published (v1 RETIRED, still pinned by all three)."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.run(c.RegisterOwner(owner="face", ttl_s=30.0, now=1.0, incarnation="a",
                             sessions_idle_s=IDLE_S))  # fmt: skip
    book.run(c.RegisterOwner(owner="w", ttl_s=30.0, now=1.0, incarnation="a"))
    for session in ("r1", "r2"):
        book.run(c.Bind(session=session, owner="face", incarnation="a"))
    book.run(c.Bind(session="o1", owner="w", incarnation="a"))
    book.publish(2)
    return book


def _released(events: list[Event]) -> dict[str, str]:
    return {e.session: e.cause for e in events if isinstance(e, SessionReleased)}


def test_the_binding_keeps_the_idle_bound_of_the_owner_that_bound_it(book: Book) -> None:
    sessions = book.state.sessions
    assert (sessions["r1"].idle_s, sessions["o1"].idle_s) == (IDLE_S, None)
    assert book.state.owners["face"].sessions_idle_s == IDLE_S
    # a later life of the relay with another bound: the sessions bound before keep theirs
    book.run(c.RegisterOwner(owner="face", ttl_s=30.0, now=2.0, incarnation="b",
                             sessions_idle_s=5.0))  # fmt: skip
    book.run(c.Bind(session="r3", owner="face", incarnation="b"))
    assert (sessions["r1"].idle_s, sessions["r3"].idle_s) == (IDLE_S, 5.0)
    book.refuse(
        c.RegisterOwner(owner="x", ttl_s=1.0, now=0.0, sessions_idle_s=-1.0), Code.INVALID_INPUT
    )
    book.refuse(
        c.RegisterOwner(owner="x", ttl_s=1.0, now=0.0, sessions_idle_s=float("inf")),
        Code.INVALID_INPUT,
    )


@pytest.mark.parametrize("end", ["deregister", "expire", "restart"])
def test_no_end_of_a_relays_life_releases_its_sessions(book: Book, end: str) -> None:
    before = len(book.events)
    if end == "deregister":
        assert book.run(c.DeregisterOwner(owner="face", now=5.0, incarnation="a")) == (
            Deregistered(owner="face", released=0)
        )
    elif end == "expire":
        expired = c.ExpireOwner(owner="face", now=99.0, last_seen=1.0, incarnation="a")
        assert book.run(expired) == Expired(owner="face", released=0)
    else:
        book.run(c.RegisterOwner(owner="face", ttl_s=30.0, now=5.0, incarnation="b",
                                 sessions_idle_s=IDLE_S))  # fmt: skip
    assert _released(book.events[before:]) == {}
    assert {"r1", "r2"} <= set(book.state.sessions)
    # the owner-held session of a worker still ends with its owner's life
    book.run(c.DeregisterOwner(owner="w", now=6.0, incarnation="a"))
    assert "o1" not in book.state.sessions
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)  # r1, r2 still pin v1


def test_a_later_process_binds_the_session_again_and_anyone_may_release_it(book: Book) -> None:
    book.run(c.DeregisterOwner(owner="face", now=5.0, incarnation="a"))  # the face stopped
    # the restarted face, and a face under another owner id, both get the existing binding
    book.run(c.RegisterOwner(owner="face", ttl_s=30.0, now=6.0, incarnation="b",
                             sessions_idle_s=IDLE_S))  # fmt: skip
    book.run(c.RegisterOwner(owner="gw-2", ttl_s=30.0, now=6.0, incarnation="x",
                             sessions_idle_s=IDLE_S))  # fmt: skip
    for owner, life in (("face", "b"), ("gw-2", "x")):
        again = book.run(c.Bind(session="r1", owner=owner, incarnation=life))
        assert isinstance(again, Bound) and (again.version_id, again.new) == (1, False)
    before = len(book.events)
    released = book.run(c.Release(session="r1", owner="gw-2", incarnation="x"))
    assert released == Released(session="r1", released=True, version_id=1, tombstoned=True)
    assert book.events[before:] == [
        SessionReleased(session="r1", owner="face", version_id=1, cause="closed")
    ]  # the binding's owner, whoever asked


def test_the_idle_release_needs_evidence_of_idleness_and_records_it(book: Book) -> None:
    before = len(book.events)
    # not idle by its own evidence: refused, as an expiry of a live lease is
    book.refuse(c.ReleaseIdle(session="r1", now=150.0, last_turn=60.0), Code.INVALID_INPUT)
    # an owner-held session is its owner's to end
    book.refuse(c.ReleaseIdle(session="o1", now=1e6, last_turn=0.0), Code.INVALID_INPUT)
    book.refuse(c.ReleaseIdle(session="r1", now=float("nan"), last_turn=0.0), Code.INVALID_INPUT)
    assert book.events[before:] == []

    released = book.run(c.ReleaseIdle(session="r1", now=170.0, last_turn=60.0))
    assert released == Released(session="r1", released=True, version_id=1, tombstoned=True)
    assert book.events[-1] == SessionReleased(
        session="r1", owner="face", version_id=1, cause="idle", last_turn=60.0, idle_s=IDLE_S,
        at=170.0,
    )  # fmt: skip
    assert book.state.idle_released == {"r1": 170.0}
    # again (a sweep that raced a release): nothing to do
    assert book.run(c.ReleaseIdle(session="r1", now=180.0, last_turn=60.0)) == Released(
        session="r1", released=False
    )
    # a late turn is refused, and says why
    closed = book.refusal(c.Bind(session="r1", owner="face", incarnation="a"), Code.SESSION_CLOSED)
    assert closed.details["cause"] == "idle" and "without a turn" in closed.message
    # a relay whose sessions never go idle (0): its sessions are never released so
    book.run(c.RegisterOwner(owner="never", ttl_s=30.0, now=1.0, sessions_idle_s=0.0))
    book.run(c.Bind(session="n1", owner="never"))
    book.refuse(c.ReleaseIdle(session="n1", now=1e9, last_turn=0.0), Code.INVALID_INPUT)


def test_forgetting_an_idle_tombstone_forgets_its_idle_release(book: Book) -> None:
    book.run(c.ReleaseIdle(session="r1", now=170.0, last_turn=60.0))
    book.run(c.Release(session="r2", owner="face", incarnation="a"))
    assert set(book.state.idle_released) == {"r1"}
    book.run(c.Forget(sessions=("r1",)))
    assert book.events[-1] == SessionsForgotten(sessions=("r1",))
    assert book.state.idle_released == {} and "r1" not in book.state.tombstones
    assert "r2" in book.state.tombstones  # the face released it: the face forgets it


def test_a_first_turn_naming_another_version_binds_nothing(book: Book) -> None:
    """``Bind.expect_version``: the ledger, on its own state, refuses a first turn whose
    named version is not the default, and writes nothing; an existing binding is answered
    whatever it is (the face judges it); the default's own name binds."""
    before = len(book.events)
    refused = book.refusal(
        c.Bind(session="new", owner="face", incarnation="a", expect_version=1),
        Code.VERSION_NOT_BOUND,
    )
    assert "version 2" in refused.message and refused.details["default"] == 2
    assert book.events[before:] == [] and "new" not in book.state.sessions
    existing = book.run(c.Bind(session="r1", owner="face", incarnation="a", expect_version=2))
    assert (existing.version_id, existing.new) == (1, False)
    bound = book.run(c.Bind(session="new", owner="face", incarnation="a", expect_version=2))
    assert (bound.version_id, bound.new) == (2, True)
    assert isinstance(book.events[-1], SessionBound)
