"""Owner incarnations and clean deregistration, decided and folded (no store, invariants
checked after every step by the book): a new life of a live owner releases the sessions of the
life it replaces and fences that one out; the same life again is a no-op; a clean exit
releases the owner's sessions at once under its own cause; either way the versions they pinned
become reclaimable without waiting for a lease. Incidents: a lease expiry and a restart are
listed, a clean exit is not."""

from __future__ import annotations

import msgspec
import pytest

from evlog.events import (
    Event,
    OwnerDeregistered,
    OwnerLeaseExpired,
    OwnerRegistered,
    SessionReleased,
    decode_event,
    encode_event,
    stream_of,
)
from evlog.record import Record
from projections.incidents import incidents
from publisher.core import commands as c
from publisher.core.decider import check_lease, decide
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound, Deregistered, Done, Expired, ReclaimGranted
from tests.publisher.core.book import Book


@pytest.fixture
def book() -> Book:
    """v1 bound by two sessions of owner w (incarnation a), then v2 published (v1 RETIRED)."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=1.0, incarnation="a"))
    for session in ("s1", "s2"):
        book.run(c.Bind(session=session, owner="w", incarnation="a"))
    book.publish(2)
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)  # pinned
    return book


def _released(events: list[Event]) -> dict[str, str]:
    return {e.session: e.cause for e in events if isinstance(e, SessionReleased)}


def test_a_new_incarnation_releases_the_predecessors_sessions_at_once(book: Book) -> None:
    before = len(book.events)
    assert book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=2.0, incarnation="b")) == Done()
    new = book.events[before:]
    assert isinstance(new[0], OwnerRegistered)
    assert (new[0].incarnation, new[0].replaced) == ("b", "a")
    assert _released(new) == {"s1": "owner_restarted", "s2": "owner_restarted"}
    assert book.state.versions[1].bound == 0
    owner = book.state.owners["w"]
    assert (owner.incarnation, owner.retired, owner.live) == ("b", ("a",), True)
    # the version they pinned is reclaimable now, not one lease (ten minutes) later
    assert isinstance(book.run(c.ClaimReclaim(version_id=1)), ReclaimGranted)
    # the new life binds as usual; its predecessor's sessions stay released
    assert isinstance(book.run(c.Bind(session="s3", owner="w", incarnation="b")), Bound)
    book.refuse(c.Bind(session="s1", owner="w", incarnation="b"), Code.SESSION_CLOSED)


def test_the_same_incarnation_again_is_a_no_op_that_releases_nothing(book: Book) -> None:
    before = len(book.events)
    again = book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=5.0, incarnation="a"))
    assert again == Done(no_op=True)
    assert book.events[before:] == []
    assert book.state.versions[1].bound == 2
    # unnamed incarnations (callers that never name one) keep the old rule: a no-op too
    book.run(c.RegisterOwner(owner="old", ttl_s=10.0, now=0.0))
    assert book.run(c.RegisterOwner(owner="old", ttl_s=10.0, now=1.0)) == Done(no_op=True)


def test_a_replaced_incarnation_is_fenced_out(book: Book) -> None:
    book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=2.0, incarnation="b"))
    before = len(book.events)
    # a zombie of the dead life: it may not bind, release, register again, deregister the
    # successor, or renew (the renewal rule is check_lease, shared with the ledger)
    book.refuse(c.Bind(session="z1", owner="w", incarnation="a"), Code.OWNER_RESTARTED)
    book.refuse(c.Bind(session="s1", owner="w", incarnation="a"), Code.OWNER_RESTARTED)
    book.refuse(c.Release(session="s1", owner="w", incarnation="a"), Code.OWNER_RESTARTED)
    book.refuse(
        c.RegisterOwner(owner="w", ttl_s=600.0, now=3.0, incarnation="a"), Code.OWNER_RESTARTED
    )
    book.refuse(c.DeregisterOwner(owner="w", now=3.0, incarnation="a"), Code.OWNER_RESTARTED)
    book.refuse(
        c.ExpireOwner(owner="w", now=9e9, last_seen=0.0, incarnation="a"), Code.OWNER_RESTARTED
    )
    with pytest.raises(LedgerError) as renewal:
        check_lease(book.state, "w", required=True, incarnation="a")
    assert renewal.value.code == Code.OWNER_RESTARTED
    # an incarnation that never registered is unknown, not a restart
    book.refuse(c.Bind(session="z2", owner="w", incarnation="zz"), Code.UNKNOWN_OWNER)
    assert book.events[before:] == []  # every refusal wrote nothing
    assert book.state.owners["w"].live and book.state.owners["w"].incarnation == "b"
    check_lease(book.state, "w", required=True, incarnation="b")  # the live one renews


def test_deregistration_releases_with_its_own_cause_and_frees_the_version(book: Book) -> None:
    book.run(c.Bind(session="s3", owner="w", incarnation="a"))  # on v2
    book.run(c.Release(session="s3", owner="w", incarnation="a"))  # closed by the worker
    before = len(book.events)
    outcome = book.run(c.DeregisterOwner(owner="w", now=3.0, incarnation="a"))
    assert outcome == Deregistered(owner="w", released=2)
    new = book.events[before:]
    assert new[0] == OwnerDeregistered(owner="w", incarnation="a", at=3.0)
    assert _released(new) == {"s1": "owner_exited", "s2": "owner_exited"}
    assert isinstance(book.run(c.ClaimReclaim(version_id=1)), ReclaimGranted)
    # idempotent; and the ended life may no longer act (nor register again)
    again = book.run(c.DeregisterOwner(owner="w", now=4.0, incarnation="a"))
    assert again == Deregistered(owner="w", released=0, no_op=True)
    book.refuse(c.Bind(session="s9", owner="w", incarnation="a"), Code.OWNER_DEREGISTERED)
    book.refuse(
        c.RegisterOwner(owner="w", ttl_s=600.0, now=5.0, incarnation="a"),
        Code.OWNER_DEREGISTERED,
    )
    # an expiry decided on a stale view of the lease finds nothing to expire
    assert book.run(c.ExpireOwner(owner="w", now=9e9, last_seen=0.0)) == Expired(
        owner="w", released=0
    )
    assert not any(isinstance(e, OwnerLeaseExpired) for e in book.events)
    # a new life of the owner id starts afresh, with nothing to release
    before = len(book.events)
    book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=6.0, incarnation="c"))
    assert _released(book.events[before:]) == {}
    book.refuse(c.DeregisterOwner(owner="nobody", now=1.0), Code.UNKNOWN_OWNER)


def test_a_new_life_after_a_lease_expiry_is_allowed_the_expired_one_is_not() -> None:
    book = Book().bootstrap()
    book.publish(1)
    book.run(c.RegisterOwner(owner="w", ttl_s=1.0, now=0.0, incarnation="a"))
    book.run(c.Bind(session="s1", owner="w", incarnation="a"))
    assert book.run(c.ExpireOwner(owner="w", now=5.0, last_seen=0.0, incarnation="a")).released
    book.refuse(c.RegisterOwner(owner="w", ttl_s=1.0, now=6.0, incarnation="a"), Code.LEASE_EXPIRED)
    before = len(book.events)
    book.run(c.RegisterOwner(owner="w", ttl_s=1.0, now=6.0, incarnation="b"))
    assert _released(book.events[before:]) == {}  # the expiry already released s1
    assert isinstance(book.run(c.Bind(session="s2", owner="w", incarnation="b")), Bound)


def test_a_command_id_recorded_before_incarnations_still_names_the_same_command() -> None:
    """A Bind sent with a command id, then again after an upgrade: ``incarnation`` at its
    default is left out of the fingerprint, so the resend is the same command."""
    book = Book().bootstrap()
    book.publish(1)
    first = book.run(c.Bind(session="s", owner="w1", command_id="k"))
    assert book.run(c.Bind(session="s", owner="w1", incarnation="", command_id="k")) == first
    refused = decide(book.state, c.Bind(session="t", owner="w1", command_id="k"))
    assert refused.error is not None and refused.error.code == Code.COMMAND_CONFLICT


def test_an_old_owner_registered_record_reads_as_an_unnamed_incarnation() -> None:
    v1 = msgspec.msgpack.encode({"type": "OwnerRegistered", "owner": "w", "ttl_s": 5.0, "at": 1.0})
    event = decode_event(v1, "OwnerRegistered", 1)
    assert event == OwnerRegistered(owner="w", ttl_s=5.0, at=1.0, incarnation="", replaced=None)
    current = OwnerRegistered(owner="w", ttl_s=5.0, at=1.0, incarnation="a", replaced="b")
    assert decode_event(encode_event(current), "OwnerRegistered", 2) == current


def _records(events: list[Event]) -> list[Record]:
    """The events as stored records, one second apart (the incident fold reads the envelope)."""
    return [
        Record(
            seq=i,
            event_id=b"",
            stream=stream_of(e),
            type=type(e).__name__,
            schema=type(e).SCHEMA,
            recorded_at=float(i),
            payload=b"",
            prev_hash=b"",
            hash=b"",
            event=e,  # type: ignore[arg-type]  # the book keeps Event, each one of AnyEvent
        )
        for i, e in enumerate(events, 1)
    ]


def test_a_clean_exit_is_not_an_incident_a_restart_and_a_lease_expiry_are() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    for owner in ("clean", "crashed", "restarted"):
        book.run(c.RegisterOwner(owner=owner, ttl_s=1.0, now=0.0, incarnation="a"))
        book.run(c.Bind(session=f"{owner}-s", owner=owner, incarnation="a"))
    book.run(c.DeregisterOwner(owner="clean", now=1.0, incarnation="a"))
    book.run(c.ExpireOwner(owner="crashed", now=5.0, last_seen=0.0))
    book.run(c.RegisterOwner(owner="restarted", ttl_s=1.0, now=6.0, incarnation="b"))
    found = incidents(_records(book.events))
    kinds = {(i.kind, i.subject) for i in found if i.kind in ("lease_expired", "owner_restarted")}
    assert kinds == {("lease_expired", "owner crashed"), ("owner_restarted", "owner restarted")}
    assert not any("clean" in i.subject or "clean" in i.summary for i in found)
    restarted = next(i for i in found if i.kind == "owner_restarted")
    assert "(a -> b)" in restarted.summary and "1 sessions released" in restarted.summary
