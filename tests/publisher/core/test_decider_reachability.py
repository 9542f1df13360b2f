"""Engine reachability in the decider: an outage opens once with its first error, takes the
engine out of routing at once, counts the dispatch failures of its sessions, and ends when a
probe of the same life answers (or the engine comes back as a new life); late reports, an
earlier life's reports and duplicates write nothing (docs/state-machine.md, "Engine health").

Driven through :class:`Book` (decide + evolve, invariants after every step).
"""

from __future__ import annotations

import pytest

from evlog.events import (
    DispatchFailures,
    EngineReachable,
    EngineRestarted,
    EngineUnreachable,
    TurnFailures,
)
from projections.status import status_of
from publisher.core import commands as c
from publisher.core.errors import Code
from tests.publisher.core.book import Book

ENGINES = ("e0", "e1", "e2")


def _fleet() -> Book:
    book = Book().bootstrap(capacity=4, engines=ENGINES)
    book.publish(1)
    return book


def _written(book: Book, command: c.Command) -> list[object]:
    before = len(book.events)
    book.run(command)
    return list(book.events[before:])


def _unreachable(
    engine: str = "e2", *, at: float = 100.0, incarnation: str = "", source: str = "dispatch"
) -> c.ReportUnreachable:
    return c.ReportUnreachable(
        engine=engine,
        incarnation=incarnation or f"{engine}-i1",
        at=at,
        error="ENGINE_UNREACHABLE: POST /generate: cannot connect",
        source=source,
        reporter="gw-1",
    )


def _counts(engine: str = "e2", incarnation: str = "", **sessions: int) -> c.CountDispatchFailures:
    return c.CountDispatchFailures(
        engine=engine,
        incarnation=incarnation or f"{engine}-i1",
        failures=tuple(TurnFailures(session=s, not_run=n) for s, n in sessions.items()),
    )


def test_an_unreachable_engine_leaves_routing_at_once_and_the_outage_is_recorded_once() -> None:
    book = _fleet()
    name = book.state.versions[1].lora_name
    assert _written(book, _unreachable(at=100.0)) == [
        EngineUnreachable(
            engine="e2",
            incarnation="e2-i1",
            at=100.0,
            error="ENGINE_UNREACHABLE: POST /generate: cannot connect",
            source="dispatch",
            reporter="gw-1",
        )
    ]
    assert book.state.holders(name) == ("e0", "e1")
    assert book.state.routable_engines() == ("e0", "e1")
    member = book.state.engines["e2"]
    assert member.routable and not member.serving  # repaired as before: nothing to repair
    # the same outage seen again, by a probe or another face: nothing more is written
    assert _written(book, _unreachable(at=101.0, source="probe")) == []
    assert _written(book, _unreachable(at=100.0)) == []
    outage = status_of(book.state).engines[2].unreachable
    assert outage is not None and (outage.since, outage.source) == (100.0, "dispatch")
    assert not status_of(book.state).engines[2].routable


def test_a_new_publication_attempt_leaves_an_unreachable_engine_out() -> None:
    book = _fleet()
    book.run(_unreachable())
    assert book.allocate(2).fleet == ("e0", "e1")


def test_failures_are_counted_per_session_against_the_open_outage() -> None:
    book = _fleet()
    book.run(_unreachable(at=100.0))
    assert _written(book, _counts(s1=2, s2=1)) == [
        DispatchFailures(
            engine="e2",
            incarnation="e2-i1",
            since=100.0,
            failures=(
                TurnFailures(session="s1", not_run=2),
                TurnFailures(session="s2", not_run=1),
            ),
        )
    ]
    ambiguous = c.CountDispatchFailures(
        engine="e2",
        incarnation="e2-i1",
        failures=(TurnFailures(session="s1", ambiguous=1), TurnFailures(session="s3")),
    )
    events = _written(book, ambiguous)
    assert [e.failures for e in events if isinstance(e, DispatchFailures)] == [
        (TurnFailures(session="s1", ambiguous=1),)  # a row of zeros is not worth a record
    ]
    outage = book.state.engines["e2"].unreachable
    assert outage is not None
    assert outage.failures == {"s1": (2, 1), "s2": (1, 0)}
    status = status_of(book.state).engines[2].unreachable
    assert status is not None and (status.not_run, status.ambiguous) == (3, 1)


def test_counts_without_an_open_outage_or_of_an_earlier_life_write_nothing() -> None:
    book = _fleet()
    assert _written(book, _counts(s1=1)) == []  # no outage: nothing to count against
    book.run(_unreachable())
    assert _written(book, _counts(incarnation="e2-i0", s1=1)) == []
    assert _written(book, _counts(s1=0)) == []
    book.refuse(
        c.CountDispatchFailures(
            engine="e2",
            incarnation="e2-i1",
            failures=(TurnFailures(session="s1", not_run=-1),),
        ),
        Code.INVALID_INPUT,
    )


def test_a_probe_of_the_same_life_ends_the_outage_and_the_engine_serves_again() -> None:
    book = _fleet()
    name = book.state.versions[1].lora_name
    book.run(_unreachable(at=100.0))
    ended = _written(book, c.ReportReachable(engine="e2", incarnation="e2-i1", at=103.5))
    assert ended == [EngineReachable(engine="e2", incarnation="e2-i1", at=103.5, since=100.0)]
    assert book.state.holders(name) == ("e0", "e1", "e2")
    assert book.state.engines["e2"].reachable_at == 103.5
    # nothing open any more: another answer writes nothing
    assert _written(book, c.ReportReachable(engine="e2", incarnation="e2-i1", at=104.0)) == []


def test_a_late_report_after_the_engine_answered_opens_nothing() -> None:
    """A face's report of a failure seen before the probe that answered (delayed in transit,
    or sent just before the engine came back) must not take a live engine out again."""
    book = _fleet()
    book.run(_unreachable(at=100.0))
    book.run(c.ReportReachable(engine="e2", incarnation="e2-i1", at=103.5))
    assert _written(book, _unreachable(at=103.0)) == []
    assert _written(book, _counts(s1=1)) == []  # the outage they belonged to is over
    assert book.state.engines["e2"].serving
    # a failure seen after that answer is a new outage
    assert [type(e) for e in _written(book, _unreachable(at=104.0))] == [EngineUnreachable]


def test_an_earlier_lifes_report_is_ignored_and_a_restart_ends_the_outage() -> None:
    book = _fleet()
    book.run(_unreachable(at=100.0))
    # the engine comes back as a new process: the restart ends the outage (it answered)
    restarted = _written(book, c.ObserveRestart(engine="e2", incarnation="e2-i2"))
    assert [type(e) for e in restarted] == [EngineRestarted]
    assert book.state.engines["e2"].unreachable is None
    # the dead life's failures, reported late, say nothing about the new one
    assert _written(book, _unreachable(at=105.0, incarnation="e2-i1")) == []
    assert book.state.engines["e2"].unreachable is None


def test_a_reachable_report_of_a_life_the_ledger_has_not_seen_is_refused() -> None:
    book = _fleet()
    book.run(_unreachable())
    book.refuse(
        c.ReportReachable(engine="e2", incarnation="e2-i2", at=101.0), Code.ENGINE_RESTARTED
    )
    assert book.state.engines["e2"].unreachable is not None


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (_unreachable(engine="e9"), Code.UNKNOWN_ENGINE),
        (_unreachable(source="gossip"), Code.INVALID_INPUT),
        (_unreachable(at=float("nan")), Code.INVALID_INPUT),
        (c.ReportReachable(engine="e2", incarnation="", at=1.0), Code.INVALID_INPUT),
    ],
)
def test_malformed_reports_are_refused(command: c.Command, code: str) -> None:
    _fleet().refuse(command, code)
