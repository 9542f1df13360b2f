"""An owner life's secret, decided and folded (the book checks invariants after every step),
and kept across a restart of the ledger on a real SQLite log.

Only a call carrying the current life's secret binds, renews, releases or deregisters for it;
the log records the secret's digest, never the secret. A release's cause is one a caller may
state: the causes that say a life ended are the ledger's own."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from evlog.events import OwnerRegistered, SessionReleased
from evlog.memory import MemoryStore
from evlog.sqlite import SQLiteStore
from projections.registry import VersionState
from publisher.core import commands as c
from publisher.core.decider import check_lease
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from tests.publisher.core.book import Book
from tests.publisher.ray.kit import create
from tests.support.ledger import publish
from tests.support.runs import Clock

SECRET = "a" * 64
OTHER = "b" * 64


@pytest.fixture
def book() -> Book:
    """v1 published; owner w (life "a", secret SECRET) bound s1; relay gw (client-held) bound
    c1."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.run(c.RegisterOwner(owner="w", ttl_s=600.0, now=1.0, incarnation="a", secret=SECRET))
    book.run(c.Bind(session="s1", owner="w", incarnation="a", secret=SECRET))
    relay = c.RegisterOwner(
        owner="gw", ttl_s=600.0, now=1.0, incarnation="g", sessions_idle_s=0.0, secret=OTHER
    )
    book.run(relay)
    book.run(c.Bind(session="c1", owner="gw", incarnation="g", secret=OTHER))
    return book


def test_the_log_records_the_secrets_digest_not_the_secret(book: Book) -> None:
    registered = [e for e in book.events if isinstance(e, OwnerRegistered) and e.owner == "w"]
    assert [e.secret_digest for e in registered] == [hashlib.sha256(SECRET.encode()).hexdigest()]
    assert book.state.owners["w"].secret_digest == registered[0].secret_digest


def test_only_the_current_lifes_secret_acts_for_it(book: Book) -> None:
    before = len(book.events)
    for secret in ("", OTHER):
        book.refuse(c.Bind(session="s2", owner="w", secret=secret), Code.OWNER_SECRET_MISMATCH)
        book.refuse(c.Release(session="s1", owner="w", secret=secret), Code.OWNER_SECRET_MISMATCH)
        deregister = c.DeregisterOwner(owner="w", now=2.0, incarnation="a", secret=secret)
        refused = book.refusal(deregister, Code.OWNER_SECRET_MISMATCH)
        assert refused.details["owner"] == "w" and SECRET not in refused.message
        with pytest.raises(LedgerError) as renewal:  # the renewal rule (unlogged renewals)
            check_lease(book.state, "w", required=True, incarnation="a", secret=secret)
        assert renewal.value.code == Code.OWNER_SECRET_MISMATCH
    # a retry of the registration must be the life's own, too
    retry = c.RegisterOwner(owner="w", ttl_s=600.0, now=3.0, incarnation="a", secret=OTHER)
    book.refuse(retry, Code.OWNER_SECRET_MISMATCH)
    assert len(book.events) == before  # nothing written
    assert book.run(
        c.RegisterOwner(owner="w", ttl_s=600.0, now=3.0, incarnation="a", secret=SECRET)
    ).no_op
    check_lease(book.state, "w", required=True, incarnation="a", secret=SECRET)
    done = book.run(c.DeregisterOwner(owner="w", now=4.0, secret=SECRET))
    assert done.released == 1


def test_a_release_names_a_live_owner_and_a_cause_a_caller_may_state(book: Book) -> None:
    before = len(book.events)
    # a made-up owner cannot release a client's session
    book.refuse(c.Release(session="c1", owner="made-up", cause="closed"), Code.UNKNOWN_OWNER)
    # nor can any life write a cause that says an owner's life ended
    for cause in ("lease_expired", "owner_exited", "owner_restarted", "operator", "x"):
        release = c.Release(session="c1", owner="gw", cause=cause, secret=OTHER)
        book.refuse(release, Code.INVALID_INPUT)
    # idle: only the owner of an owner-held session says so (a client-held one goes idle by
    # the ledger's own release, with its evidence)
    book.refuse(c.Release(session="c1", owner="gw", cause="idle", secret=OTHER), Code.INVALID_INPUT)
    book.refuse(c.Release(session="s1", owner="gw", cause="idle", secret=OTHER), Code.INVALID_INPUT)
    assert len(book.events) == before
    book.run(c.Release(session="s1", owner="w", cause="idle", secret=SECRET))
    book.run(c.Release(session="c1", owner="gw", cause="closed", secret=OTHER))
    causes = [(e.session, e.cause) for e in book.events[before:] if isinstance(e, SessionReleased)]
    assert causes == [("s1", "idle"), ("c1", "closed")]


def test_a_life_registered_without_a_secret_takes_no_call_that_carries_one() -> None:
    """A life of a log written before secrets (or registered in process without one) is not
    reachable from another process, whose calls always carry a secret: it must re-register."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.run(c.RegisterOwner(owner="old", ttl_s=600.0, now=1.0, incarnation="o"))
    book.run(c.Bind(session="s", owner="old", incarnation="o"))  # in process: no secret
    refused = book.refusal(
        c.Release(session="s", owner="old", secret=OTHER), Code.OWNER_SECRET_MISMATCH
    )
    assert "register a new incarnation" in refused.message
    book.run(c.RegisterOwner(owner="old", ttl_s=600.0, now=2.0, incarnation="p", secret=OTHER))
    book.run(c.Bind(session="s2", owner="old", incarnation="p", secret=OTHER))


def test_a_short_secret_is_refused(book: Book) -> None:
    short = c.RegisterOwner(owner="v", ttl_s=60.0, now=1.0, incarnation="i", secret="x" * 31)
    book.refuse(short, Code.INVALID_INPUT)


@pytest.mark.anyio
async def test_a_lifes_secret_outlives_a_restart_of_the_ledger(tmp_path: Path) -> None:
    """A client-held session's relay renews across a restart of ``serve``: the digest is in
    the log, so the same secret is the life's after the restart, and only it."""
    path = tmp_path / "ledger.db"
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("gw", incarnation="g", sessions_idle_s=0.0, secret=SECRET)
        await ledger.bind("c1", "gw", incarnation="g", secret=SECRET)
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        ledger.renew_lease("gw", {("e0", 1): 1}, incarnation="g", secret=SECRET)
        with pytest.raises(LedgerError) as forged:
            ledger.renew_lease("gw", {}, incarnation="g", secret=OTHER)
        assert forged.value.code == Code.OWNER_SECRET_MISMATCH
        assert [x.count for x in ledger.inflight_evidence(1) if x.reporter == "gw"] == [1]
        assert not (await ledger.bind("c1", "gw", incarnation="g", secret=SECRET)).new
    assert_not_stored(tmp_path, SECRET)


@pytest.mark.anyio
async def test_a_stranger_replacing_a_live_life_cannot_make_its_running_request_reclaimable() -> (
    None
):
    """A new incarnation replaces a live life without its secret (a crashed worker restarts
    at once), so a stranger can fence a life; but the replaced life's last in-flight counts
    hold its version until that life's lease would have lapsed, as if it still ran."""
    clock = Clock(1000.0)
    async with Ledger.open(MemoryStore(), clock=clock) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("face", ttl_s=10.0, incarnation="a", secret=SECRET)
        clock.now = 1004.0
        ledger.renew_lease("face", {("e0", 1): 1}, incarnation="a", secret=SECRET)  # running
        await publish(ledger, 2)  # v1 RETIRED, no session bound: only the count holds it
        clock.now = 1005.0
        await ledger.register_owner("face", ttl_s=600.0, incarnation="x", secret=OTHER)
        ledger.renew_lease("face", {}, incarnation="x", secret=OTHER)  # the stranger: "idle"
        await ledger.deregister_owner("face", incarnation="x", secret=OTHER)  # and gone
        clock.now = 1013.9  # the replaced life's lease (renewed at 1004, ttl 10) still runs
        with pytest.raises(LedgerError) as busy:
            await ledger.claim_reclaim(1, ledger.inflight_evidence(1))
        assert busy.value.code == Code.REQUESTS_IN_FLIGHT
        assert "face (replaced life a)" in busy.value.message
        clock.now = 1014.0  # it would have lapsed: the running request is no one's word now
        await ledger.claim_reclaim(1, ledger.inflight_evidence(1))
        assert ledger.state.versions[1].state is VersionState.RECLAIMING


def assert_not_stored(folder: Path, secret: str) -> None:
    """No file of ``folder`` (the log, its WAL if any) holds ``secret``."""
    files = [p for p in folder.iterdir() if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
