"""An engine that does not answer a publication's call leaves the attempt's target set: the
decider suspends it (cause ``unanswered``) from two pieces of recorded evidence -- the call
waited at least the control timeout, and the engine's probes failed (an open outage) -- so the
version commits on the rest; a slow engine that answers probes keeps its place; the engine
serves again only after its repair loaded what is needed (docs/publication.md, "Commit").

Driven through :class:`Book` (decide + evolve, invariants after every step).
"""

from __future__ import annotations

from evlog.events import EngineSuspended
from publisher.core import commands as c
from publisher.core.errors import Code
from tests.publisher.core.book import Book

ENGINES = ("e0", "e1", "e2")


def _attempt_waiting_for_e2() -> Book:
    """Version 1 published on all three; version 2's attempt READY on e0 and e1 only."""
    book = Book().bootstrap(capacity=4, engines=ENGINES)
    book.publish(1)
    book.allocate(2)
    book.claim(2)
    v = book.state.versions[2]
    for engine in ("e0", "e1"):
        for receipt in (c.RecordPrepared, c.RecordReady):
            book.run(receipt(version_id=2, attempt=1, engine=engine, incarnation=f"{engine}-i1",
                             digest=v.digest, lora_name=v.lora_name))  # fmt: skip
    return book


def _probe_failed(book: Book) -> None:
    book.run(
        c.ReportUnreachable(
            engine="e2",
            incarnation="e2-i1",
            at=100.0,
            error="TIMEOUT: GET /v1/incarnation: no answer in 10.0 s",
            source="probe",
            reporter="reconciler",
        )
    )


def _unanswered(waited_s: float = 10.4, *, incarnation: str = "e2-i1") -> c.SuspendUnanswered:
    return c.SuspendUnanswered(
        engine="e2",
        incarnation=incarnation,
        call="publication call",
        waited_s=waited_s,
        timeout_s=10.0,
    )


def test_an_unanswered_unreachable_engine_leaves_the_target_set_and_the_rest_commit() -> None:
    book = _attempt_waiting_for_e2()
    book.refuse(c.Commit(version_id=2, attempt=1), Code.NOT_READY)
    _probe_failed(book)
    book.refuse(c.Commit(version_id=2, attempt=1), Code.NOT_READY)  # an outage alone: waited for
    before = len(book.events)
    assert not book.run(_unanswered()).no_op
    (event,) = book.events[before:]
    assert isinstance(event, EngineSuspended)
    assert (event.engine, event.incarnation, event.cause) == ("e2", "e2-i1", "unanswered")
    assert "unanswered for 10.4 s (control timeout 10.0 s)" in event.detail
    assert "TIMEOUT: GET /v1/incarnation" in event.detail  # the probe's evidence, recorded
    published = book.run(c.Commit(version_id=2, attempt=1))
    assert published.version_id == 2 and book.state.default == 2
    assert book.state.routable_engines() == ("e0", "e1")
    assert book.run(_unanswered()).no_op  # once: the attempt ended, e2 is suspended


def test_an_engine_that_answers_probes_is_slow_not_frozen_and_stays_in_the_target_set() -> None:
    book = _attempt_waiting_for_e2()
    assert book.run(_unanswered(waited_s=250.0)).no_op  # no outage: its load may be long
    assert not book.state.engines["e2"].suspended
    book.refuse(c.Commit(version_id=2, attempt=1), Code.NOT_READY)


def test_a_wait_shorter_than_the_control_timeout_is_no_evidence() -> None:
    book = _attempt_waiting_for_e2()
    _probe_failed(book)
    book.refuse(_unanswered(waited_s=9.9), Code.INVALID_INPUT)
    assert not book.state.engines["e2"].suspended


def test_an_earlier_life_or_an_engine_outside_the_attempt_writes_nothing() -> None:
    book = _attempt_waiting_for_e2()
    _probe_failed(book)
    assert book.run(_unanswered(incarnation="e2-i0")).no_op
    assert not book.state.engines["e2"].suspended


def test_the_unanswered_engine_serves_again_only_after_its_repair_loaded_the_version() -> None:
    book = _attempt_waiting_for_e2()
    _probe_failed(book)
    book.run(_unanswered())
    book.run(c.Commit(version_id=2, attempt=1))
    book.refuse(c.RepairEngine(engine="e2", incarnation="e2-i1"), Code.NOT_READY)
    book.run(c.RestoreVersion(version_id=2, engine="e2", incarnation="e2-i1"))
    book.run(c.RepairEngine(engine="e2", incarnation="e2-i1"))
    member = book.state.engines["e2"]
    assert member.routable and not member.suspended
    assert book.state.versions[2].lora_name in member.holds
