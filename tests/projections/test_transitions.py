"""The transitions table: ``evolve`` takes every version state from it, an impossible step fails
loudly (naming the version, its state and the event) and changes nothing, and the table holds
exactly the steps the ledger takes."""

from __future__ import annotations

import msgspec
import pytest

from evlog import events as ev
from evlog.events import (
    AttemptFailed,
    EngineReady,
    EngineUnloaded,
    Event,
    ReclaimClaimed,
    SessionBound,
    SessionReleased,
    VersionAllocated,
    VersionPublished,
)
from evlog.record import Record
from projections import registry
from projections.registry import RegistryState, encode_state, evolve
from projections.transitions import TRANSITIONS, TransitionViolation, VersionState, next_state
from publisher.core import commands as c
from tests.publisher.core.book import Book


def _published_twice() -> Book:
    """v1 RETIRED (one session bound to it), v2 PUBLISHED (the default)."""
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(2)
    return book


def _cases() -> list[tuple[str, Event, tuple[str, ...]]]:
    """(what, impossible event, words its violation must name) on :func:`_published_twice`."""
    return [
        (
            "publishing a version that is not LOADING",
            VersionPublished(version_id=1, attempt=1, revision=3, retired=2),
            ("version 1", "RETIRED", "VersionPublished"),
        ),
        (
            "publishing a version never allocated",
            VersionPublished(version_id=9, attempt=1, revision=3, retired=2),
            ("version 9", "ABSENT", "VersionPublished"),
        ),
        (
            "allocating an id twice",
            VersionAllocated(version_id=2, digest="0" * 64, lora_name="x", size_bytes=0),
            ("version 2", "PUBLISHED", "VersionAllocated"),
        ),
        (
            "failing a published attempt",
            AttemptFailed(version_id=2, attempt=1, clean=True, code="X", reason="x"),
            ("version 2", "PUBLISHED", "AttemptFailed(clean)"),
        ),
        (
            "a READY receipt after the commit",
            EngineReady(
                version_id=2, attempt=1, engine="e0", incarnation="e0-i1", digest="d", lora_name="n"
            ),
            ("version 2", "PUBLISHED", "EngineReady"),
        ),
        (
            "reclaiming the default",
            ReclaimClaimed(version_id=2),
            ("version 2", "PUBLISHED", "ReclaimClaimed"),
        ),
        (
            "reclaiming a retired version with a session bound",
            ReclaimClaimed(version_id=1),
            ("version 1", "RETIRED", "ReclaimClaimed", "1 sessions bound"),
        ),
        (
            "an unload proof outside a reclaim",
            EngineUnloaded(version_id=1, engine="e0", incarnation="e0-i1"),
            ("version 1", "RETIRED", "EngineUnloaded"),
        ),
        (
            "releasing a missing binding",
            SessionReleased(session="ghost", owner="w1", version_id=1, cause="closed"),
            ("session ghost", "not bound", "SessionReleased(1)"),
        ),
        (
            "releasing a binding under another version",
            SessionReleased(session="s1", owner="w1", version_id=2, cause="closed"),
            ("session s1", "bound to version 1", "SessionReleased(2)"),
        ),
        (
            "binding a session twice",
            SessionBound(session="s1", owner="w1", version_id=2, revision=2),
            ("session s1", "bound", "SessionBound"),
        ),
    ]


@pytest.mark.parametrize(("what", "event", "named"), _cases(), ids=[c[0] for c in _cases()])
def test_an_impossible_step_raises_naming_it_and_changes_nothing(
    what: str, event: Event, named: tuple[str, ...]
) -> None:
    state = _published_twice().state
    before = encode_state(state)
    with pytest.raises(TransitionViolation) as info:
        evolve(state, event, state.last_seq + 1)
    assert isinstance(info.value, AssertionError)  # a broken invariant, never a refusal
    for word in named:
        assert word in str(info.value), (what, str(info.value))
    assert encode_state(state) == before, what


def test_a_release_after_release_and_records_out_of_order_are_refused() -> None:
    book = _published_twice()
    book.run(c.Release(session="s1", owner="w1"))
    again = SessionReleased(session="s1", owner="w1", version_id=None, cause="closed")
    state = book.state
    with pytest.raises(TransitionViolation, match="session s1 is released"):
        evolve(state, again, state.last_seq + 1)
    with pytest.raises(TransitionViolation, match="records apply once each"):
        evolve(state, again, state.last_seq + 2)


def _steps_taken(records: list[Record], monkeypatch: pytest.MonkeyPatch) -> set[tuple[object, str]]:
    """Replay ``records`` and collect every (state, event) step taken through the table."""
    return _steps_of([(r.seq, r.event) for r in records], monkeypatch)


def _served_other_content() -> list[tuple[int, Event]]:
    """Canary baselines, then other weights under both committed names (v2 PUBLISHED, v1
    RETIRED with a session), then each restored: the steps of served-content checks, which the
    fault run does not take."""
    book = _published_twice()
    for version_id in (1, 2):
        book.run(c.CheckCanary(engine="e0", incarnation="e0-i1", version_id=version_id, answer="7"))
    names = [book.state.versions[v].lora_name for v in (1, 2)]
    digests = tuple((name, "0" * 64) for name in names)
    book.run(
        c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=tuple(names), digests=digests)
    )
    for version_id in (1, 2):
        book.run(c.RestoreVersion(version_id=version_id, engine="e0", incarnation="e0-i1"))
    return list(enumerate(book.events, start=1))


def _steps_of(
    events: list[tuple[int, Event]], monkeypatch: pytest.MonkeyPatch
) -> set[tuple[object, str]]:
    taken: set[tuple[object, str]] = set()
    real = registry.next_state  # type: ignore[attr-defined]  # the name evolve looks up

    def recording(version_id: int, state: VersionState | None, event: str) -> VersionState:
        taken.add((state, event))
        return real(version_id, state, event)

    monkeypatch.setattr(registry, "next_state", recording)
    state = RegistryState()
    for seq, event in events:
        evolve(state, event, seq)
    return taken


def test_the_ledger_takes_every_step_of_the_table_and_no_other(
    fault_records: list[Record], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault run (tests/support/runs.py: a real ledger: clean and fatal failures, a retry,
    a restart with restorations, a reclaim and an ambiguous one), with other content served
    under committed names, walks the whole table: every step it takes is in it (or the replay
    would raise), and no entry is dead."""
    taken = _steps_taken(fault_records, monkeypatch)
    taken |= _steps_of(_served_other_content(), monkeypatch)
    assert taken == set(TRANSITIONS)


def test_every_event_about_a_version_lifecycle_has_a_step() -> None:
    """A new event that names a version must join the table, or be listed here as one that
    does not move a version's lifecycle."""
    not_lifecycle = {
        "SessionBound",
        "SessionReleased",
        "PublicationSkipped",
        "PublicationBlocked",
        "ReceiptRejected",
        "VerdictConflict",
    }
    stepped = {event.split("(")[0] for _, event in TRANSITIONS}
    for cls in vars(ev).values():
        if not (isinstance(cls, type) and issubclass(cls, Event) and cls is not Event):
            continue
        fields = {f.name for f in msgspec.structs.fields(cls)}
        if "version_id" in fields and cls.__name__ not in not_lifecycle:
            assert cls.__name__ in stepped, f"{cls.__name__} has no step in TRANSITIONS"
    assert stepped <= {cls.__name__ for cls in vars(ev).values() if isinstance(cls, type)}


def test_every_target_is_a_state_and_versions_start_by_allocation() -> None:
    assert all(isinstance(after, VersionState) for after in TRANSITIONS.values())
    assert [event for before, event in TRANSITIONS if before is None] == ["VersionAllocated"]


def test_a_step_outside_the_table_names_the_absent_state_and_why() -> None:
    """Found by mutation testing: no test read the wording of a violation from ``next_state``
    for a version the log never allocated."""
    with pytest.raises(TransitionViolation) as info:
        next_state(7, None, "VersionPublished")
    assert str(info.value) == (
        "version 7 is ABSENT: VersionPublished is impossible "
        "(not a transition of the version lifecycle)"
    )
