"""Per-session audits folded from a real fault run."""

from __future__ import annotations

from typing import Any

from evlog.events import SessionBound, SessionReleased, SessionsForgotten
from evlog.record import Record
from projections.audit import AuditFold
from tests.support.ledger import digest


def test_a_session_names_its_exact_version_and_what_it_did_meanwhile(
    fault_records: list[Record],
) -> None:
    (audit,) = AuditFold(sessions=["s-b"]).apply_all(fault_records).finish()
    assert (audit.session, audit.owner, audit.version_id, audit.revision) == ("s-b", "w1", 1, 1)
    assert audit.digest == digest(1)
    assert audit.lora_name == f"agent@dep-1-{digest(1)[:16]}"
    assert (audit.bound_at, audit.released_at, audit.cause) == (1002.0, 1100.0, "closed")
    facts = [(f.what, f.at, f.during) for f in audit.version_facts]
    assert facts == [
        ("loading", 1001.0, False),
        ("published", 1001.0, False),
        ("retired", 1010.0, True),  # retired while s-b still used it
        ("reclaiming", 1101.0, False),  # only after s-b let go
        ("reclaimed", 1101.0, False),
    ]


def test_owner_filter_lease_release_and_open_sessions(fault_records: list[Record]) -> None:
    by_owner = AuditFold(owner="w2").apply_all(fault_records).finish()
    assert [a.session for a in by_owner] == ["s-c"]
    (lost,) = by_owner
    expiry = next(r.seq for r in fault_records if r.type == "OwnerLeaseExpired")
    assert (lost.cause, lost.lease_expired_seq) == ("lease_expired", expiry)
    everyone = AuditFold().apply_all(fault_records).finish()
    assert [a.session for a in everyone] == ["s-a", "s-b", "s-c", "s-d"]
    open_one = everyone[-1]
    assert open_one.released_seq is None and open_one.version_id == 2
    assert ("restored", True) in [(f.what, f.during) for f in open_one.version_facts]


def test_a_forgotten_session_that_binds_again_is_a_second_life() -> None:
    """Bound to v1, released, forgotten; bound again (to v2, the default by then), released,
    forgotten; then a late release of the forgotten id. The decider's own events: three lives,
    the last one never bound."""

    def rec(seq: int, event: Any) -> Record:
        return Record(
            seq=seq, event_id=b"", stream="", type=type(event).__name__, schema=1,
            recorded_at=float(seq), payload=b"", prev_hash=b"", hash=b"", event=event,
        )  # fmt: skip

    from publisher.core import commands as c
    from tests.publisher.core.book import Book

    book = Book().bootstrap()
    book.publish(1)
    life = [c.Bind(session="x", owner="w1"), c.Release(session="x", owner="w1")]
    for command in [*life, c.Forget(sessions=("x",))]:
        book.run(command)
    book.publish(2)
    for command in [*life, c.Forget(sessions=("x",)), c.Release(session="x", owner="w1")]:
        book.run(command)
    records = [rec(i + 1, e) for i, e in enumerate(book.events)]
    bound = [r.seq for r in records if isinstance(r.event, SessionBound)]
    released = [r.seq for r in records if isinstance(r.event, SessionReleased)]
    forgotten = [r.seq for r in records if isinstance(r.event, SessionsForgotten)]
    assert len(bound) == 2 and len(released) == 3 and len(forgotten) == 2

    lives = AuditFold(sessions=["x"]).apply_all(records).finish()
    assert [(a.version_id, a.bound_seq, a.released_seq, a.forgotten_seq) for a in lives] == [
        (1, bound[0], released[0], forgotten[0]),
        (2, bound[1], released[1], forgotten[1]),
        (None, None, released[2], None),
    ]
    assert lives[0].forgotten_at == float(forgotten[0])
    assert lives[1].bound_at == float(bound[1]) and lives[1].revision == 2
