"""Decider rules that mutation testing found unchecked (tests/mutation/campaign.py).

Each test is named for the rule; the mutants it kills are those listed under it in
RELIABILITY.md ("Mutation testing"): an outcome that answers the wrong version, engine or
owner; a fatal entry or a reclaim that an engine's departure completes; the boundary of a
lease; the codes of refusals no other test reached.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from evlog.errors import LoraLedgerError
from evlog.events import (
    AttemptFailed,
    CommandRecorded,
    DeploymentConfigured,
    EngineLeft,
    EngineReady,
    EngineRepaired,
    FatalResolved,
    InFlight,
    PublicationBlocked,
    PublicationSkipped,
    ReceiptRejected,
    ReclaimAmbiguous,
    ReclaimClaimed,
    SessionReleased,
    VersionAllocated,
    VersionReclaimed,
)
from projections.registry import VersionState
from publisher.core import commands as c
from publisher.core import decider
from publisher.core.decider import checks
from publisher.core.errors import Code
from publisher.core.outcomes import (
    Allocated,
    AttemptEnded,
    Bound,
    Claimed,
    Done,
    Expired,
    InventoryRecorded,
    Published,
    ReclaimGranted,
    Released,
    Skipped,
    UnloadRecorded,
)
from tests.publisher.core.book import Book, digest_of


@pytest.fixture
def book() -> Book:
    return Book().bootstrap()


def _fatal(book: Book, version_id: int) -> None:
    """Allocate ``version_id`` and fail it without absence proof: FAILED_FATAL."""
    book.allocate(version_id)
    book.run(c.FailAttempt(version_id=version_id, attempt=1, clean=False, code="X", reason="r"))
    assert book.state.versions[version_id].state is VersionState.FAILED_FATAL


def test_every_outcome_names_the_version_engine_and_owner_it_answers(book: Book) -> None:
    book.publish(1)
    v2 = book.allocate(2)
    assert v2 == Allocated(
        version_id=2,
        lora_name=book.state.versions[2].lora_name,
        digest=digest_of(2),
        attempt=1,
        fleet=("e0", "e1"),
        state="LOADING",
    )
    assert book.allocate(2) == Allocated(**{**msgspec.structs.asdict(v2), "resumed": True})
    claimed = book.run(c.ClaimTransport(version_id=2, attempt=1, owner="trainer"))
    assert claimed == Claimed(version_id=2, attempt=1, owner="trainer")
    again = book.run(c.ClaimTransport(version_id=2, attempt=1, owner="trainer"))
    assert again == Claimed(version_id=2, attempt=1, owner="trainer")
    ended = book.run(c.FailAttempt(version_id=2, attempt=1, clean=True, code="X", reason="r",
                                   absent_on=("e1", "e0")))  # fmt: skip
    assert ended == AttemptEnded(version_id=2, attempt=1, state="FAILED_RETRYABLE")
    assert book.events[-1].absent_on == ("e0", "e1")  # type: ignore[attr-defined]
    repeat = book.run(c.FailAttempt(version_id=2, attempt=1, clean=True, code="X", reason="r"))
    assert repeat == AttemptEnded(version_id=2, attempt=1, state="FAILED_RETRYABLE")
    book.publish(2)  # attempt 2; version 1 is retired
    name1 = book.state.versions[1].lora_name
    granted = book.run(c.ClaimReclaim(version_id=1))
    assert granted == ReclaimGranted(version_id=1, lora_name=name1, engines=("e0", "e1"))
    assert book.events[-1].evidence == ()  # type: ignore[attr-defined]
    first = book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert first == UnloadRecorded(version_id=1, engine="e0", reclaimed=False)
    before = len(book.events)
    repeat_unload = book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    assert repeat_unload == UnloadRecorded(version_id=1, engine="e0", reclaimed=False)
    assert len(book.events) == before  # a duplicate unload records nothing
    last = book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    assert last == UnloadRecorded(version_id=1, engine="e1", reclaimed=True)
    done = book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    assert done == UnloadRecorded(version_id=1, engine="e1", reclaimed=True)
    seen = book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert seen == InventoryRecorded(engine="e1")


def test_a_fatal_entry_whose_last_missing_proof_leaves_with_its_engine_is_resolved() -> None:
    book = Book().bootstrap(engines=("e0", "e1", "e2"))
    book.publish(1)
    _fatal(book, 2)
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    book.run(c.LeaveEngine(engine="e2"))  # e1 has not proved absence yet
    assert book.state.versions[2].state is VersionState.FAILED_FATAL
    assert book.events[-1] == EngineLeft(engine="e2")
    book.run(c.LeaveEngine(engine="e1"))  # the only missing proof leaves with its engine
    assert book.events[-2:] == [EngineLeft(engine="e1"), FatalResolved(version_id=2, attempt=1)]
    assert book.state.versions[2].state is VersionState.FAILED_RETRYABLE


def test_a_fatal_entry_waits_for_an_engine_outside_its_fleet_that_holds_the_candidate() -> None:
    """The attempt's fleet proving absence is not enough when a member that joined later holds
    the name: resolving then would leave it holding a FAILED_RETRYABLE name nothing fences."""
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    _fatal(book, 2)
    name = book.state.versions[2].lora_name
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))
    seen = book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=(name,)))
    assert seen.resolved == ()
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    seen = book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert seen.resolved == ()  # the fleet proved absence; e2 still holds it
    assert book.state.versions[2].state is VersionState.FAILED_FATAL
    seen = book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=()))
    assert seen.resolved == (2,)  # an engine outside the fleet completes the resolution
    assert book.events[-1] == FatalResolved(version_id=2, attempt=1)
    assert book.state.versions[2].state is VersionState.FAILED_RETRYABLE


def test_a_departure_does_not_resolve_a_fatal_entry_another_member_still_holds() -> None:
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    _fatal(book, 2)
    name = book.state.versions[2].lora_name
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))
    book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=(name,)))
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    book.run(c.LeaveEngine(engine="e1"))  # e1's proof is no longer needed, but e2 holds it
    assert book.events[-1] == EngineLeft(engine="e1")
    assert book.state.versions[2].state is VersionState.FAILED_FATAL
    book.run(c.LeaveEngine(engine="e2"))  # the holder leaves: nothing holds the name any more
    assert book.events[-2:] == [EngineLeft(engine="e2"), FatalResolved(version_id=2, attempt=1)]


def test_a_reclaim_is_completed_by_a_departure_only_when_the_others_confirmed() -> None:
    book = Book().bootstrap(engines=("e0", "e1", "e2"))
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    book.run(c.LeaveEngine(engine="e2"))  # e1 has not unloaded yet
    assert book.state.versions[1].state is VersionState.RECLAIMING
    book.run(c.LeaveEngine(engine="e1"))
    assert book.events[-1] == VersionReclaimed(version_id=1)


def test_refusals_no_other_test_reached_carry_their_codes(book: Book) -> None:
    book.publish(1)
    book.refuse(c.ClaimTransport(version_id=1, attempt=1, owner="t"), Code.INVALID_STATE)
    _fatal(book, 2)
    book.refuse(
        c.RestoreVersion(version_id=2, engine="e0", incarnation="e0-i1"), Code.INVALID_STATE
    )
    book.refuse(c.ExpireOwner(owner="nobody", now=1.0, last_seen=0.0), Code.UNKNOWN_OWNER)
    book.refuse(c.ClaimReclaim(version_id=1), Code.NOT_RECLAIMABLE)
    book.refuse(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"),
                Code.INVALID_STATE)  # fmt: skip
    book.refuse(c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason="r"), Code.INVALID_STATE)


def test_restoring_a_version_the_engine_holds_is_a_no_op(book: Book) -> None:
    book.publish(1)
    before = len(book.events)
    again = book.run(c.RestoreVersion(version_id=1, engine="e0", incarnation="e0-i1"))
    assert again == Done(no_op=True) and len(book.events) == before


def test_a_lease_expires_exactly_at_its_ttl(book: Book) -> None:
    """The owner was registered with ttl 10 s: 9.999 s of silence is a live lease, 10 s is not."""
    book.refuse(c.ExpireOwner(owner="w1", now=109.999, last_seen=100.0), Code.INVALID_INPUT)
    expired = book.run(c.ExpireOwner(owner="w1", now=110.0, last_seen=100.0))
    assert expired == Expired(owner="w1", released=0)
    again = book.run(c.ExpireOwner(owner="w1", now=111.0, last_seen=100.0))
    assert again == Expired(owner="w1", released=0)


@pytest.mark.parametrize(
    ("command", "field"),
    [
        (c.ObserveRestart(engine="e0", incarnation=""), "incarnation"),
        (c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=("",)), "adapter name"),
        (c.ClaimTransport(version_id=1, attempt=1, owner=""), "owner"),
    ],
)
def test_a_malformed_field_is_named_in_the_refusal(
    book: Book, command: c.Command, field: str
) -> None:
    book.allocate(1)
    with pytest.raises(LoraLedgerError) as info:
        book.run(command)
    assert info.value.code == Code.INVALID_INPUT
    assert info.value.details["field"] == field


def _refusal(book: Book, command: c.Command) -> LoraLedgerError:
    with pytest.raises(LoraLedgerError) as info:
        book.run(command)
    assert isinstance(info.value.message, str) and info.value.message
    return info.value


def test_refusals_carry_what_holds_them_in_their_details(book: Book) -> None:
    book.publish(1)
    book.allocate(2)
    book.run(c.ClaimTransport(version_id=2, attempt=1, owner="a"))
    driven = _refusal(book, c.ClaimTransport(version_id=2, attempt=1, owner="b"))
    assert driven.code == Code.PUBLICATION_IN_PROGRESS and driven.details["owner"] == "a"
    book.run(c.Bind(session="s1", owner="w1"))
    book.ready_all(2)
    book.run(c.Commit(version_id=2, attempt=1))
    held = _refusal(book, c.ClaimReclaim(version_id=1))
    assert held.code == Code.NOT_RECLAIMABLE and held.details["bound"] == 1
    bound = _refusal(book, c.Forget(sessions=("s1",)))
    assert bound.code == Code.SESSION_STILL_BOUND and bound.details["sessions"] == ["s1"]


def test_a_reclaim_claim_records_its_evidence_and_completes_on_an_empty_fleet(book: Book) -> None:
    book.publish(1)
    book.publish(2)
    idle = (InFlight(reporter="w1", engine="*", count=0, at=2.0),)
    book.run(c.LeaveEngine(engine="e0"))
    book.run(c.LeaveEngine(engine="e1"))
    granted = book.run(c.ClaimReclaim(version_id=1, evidence=idle))
    assert granted.engines == ()
    assert book.events[-2:] == [
        ReclaimClaimed(version_id=1, evidence=idle),
        VersionReclaimed(version_id=1),
    ]


def test_an_engine_that_joined_after_a_version_confirms_its_reclaim_by_inventory() -> None:
    book = Book().bootstrap()
    book.publish(1)
    book.publish(2)
    book.run(c.JoinEngine(engine="e2", incarnation="e2-i1"))
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-i1"))
    book.run(c.RecordUnloaded(version_id=1, engine="e1", incarnation="e1-i1"))
    outcome = book.run(c.ObserveInventory(engine="e2", incarnation="e2-i1", adapters=()))
    assert outcome.reclaimed == (1,)
    assert book.state.versions[1].state is VersionState.RECLAIMED


def test_an_adapter_seen_again_withdraws_the_absence_its_engine_proved(book: Book) -> None:
    book.publish(1)
    _fatal(book, 2)
    name = book.state.versions[2].lora_name
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=(name,)))
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    assert book.state.versions[2].state is VersionState.FAILED_FATAL


def test_recorded_reasons_are_cut_at_2000_characters(book: Book) -> None:
    book.publish(1)
    book.allocate(2)
    reason = "r" * 2001
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=False, code="X", reason=reason))
    assert book.events[-1] == AttemptFailed(
        version_id=2, attempt=1, clean=False, code="X", reason="r" * 2000
    )
    book.run(c.ObserveInventory(engine="e0", incarnation="e0-i1", adapters=()))
    book.run(c.ObserveInventory(engine="e1", incarnation="e1-i1", adapters=()))
    book.publish(3)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e0", reason=reason))
    assert book.events[-1] == ReclaimAmbiguous(version_id=1, engine="e0", reason="r" * 2000)


def test_a_recorded_command_fingerprint_is_stable_across_releases(book: Book) -> None:
    """A retry is matched against the fingerprint stored in the log, perhaps by the next
    release: the fingerprint (a hash of the command without its id) must not change with it,
    or every retry after an upgrade is refused COMMAND_CONFLICT."""
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1", command_id="k1"))
    recorded = book.events[-1]
    assert isinstance(recorded, CommandRecorded)
    assert recorded.fingerprint == "8d1fd008c7726b2eb762416e5bbd8475"
    assert recorded.command_id == "k1"
    conflict = _refusal(book, c.Bind(session="other", owner="w1", command_id="k1"))
    assert conflict.code == Code.COMMAND_CONFLICT and conflict.details["command_id"] == "k1"


def test_sessions_outcomes_and_events_name_the_session_owner_and_cause(book: Book) -> None:
    first = book.publish(1)
    replay = book.run(c.Commit(version_id=1, attempt=1))
    assert replay == Published(
        version_id=1, lora_name=first.lora_name, revision=1, retired=None, no_op=True
    )
    bound = book.run(c.Bind(session="s", owner="w1"))
    again = book.run(c.Bind(session="s", owner="w1"))
    assert again == Bound(**{**msgspec.structs.asdict(bound), "new": False})
    released = book.run(c.Release(session="s", owner="w1", cause="closed"))
    assert released == Released(session="s", released=True, version_id=1, tombstoned=True)
    assert book.events[-1] == SessionReleased(session="s", owner="w1", version_id=1, cause="closed")
    assert book.run(c.Release(session="s", owner="w1", cause="idle")) == Released(
        session="s", released=False
    )
    book.refuse(c.Release(session="s2", owner="w1", cause="abandoned"), Code.INVALID_INPUT)
    closed = book.run(c.Release(session="s2", owner="w1", cause="idle"))
    assert closed == Released(session="s2", released=False, tombstoned=True)  # it wrote one
    assert book.events[-1] == SessionReleased(
        session="s2", owner="w1", version_id=None, cause="idle"
    )
    refused = _refusal(book, c.Bind(session="s2", owner="w1"))
    assert refused.code == Code.SESSION_CLOSED and refused.details["session"] == "s2"


def test_a_session_needs_a_registered_owner_only_for_its_first_bind_or_release(
    book: Book,
) -> None:
    book.publish(1)
    book.refuse(c.Release(session="s9", owner="stranger", cause="closed"), Code.UNKNOWN_OWNER)
    book.run(c.Bind(session="s", owner="w1"))
    # a bound session's retry is answered whoever asks (only an expired owner is refused)
    assert not book.run(c.Bind(session="s", owner="stranger")).new


def test_a_capacity_skip_records_and_answers_what_was_skipped() -> None:
    book = Book().bootstrap(capacity=1)
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    skipped = book.run(c.Allocate(version_id=2, digest=digest_of(2)))
    assert isinstance(skipped, Skipped)
    assert skipped.version_id == 2 and skipped.code == Code.CAPACITY_ERROR and skipped.message
    recorded = book.events[-1]
    assert isinstance(recorded, PublicationSkipped)
    assert (recorded.version_id, recorded.digest) == (2, digest_of(2))
    assert (recorded.code, recorded.message) == (Code.CAPACITY_ERROR, skipped.message)


def test_an_allocation_records_its_size_as_given(book: Book) -> None:
    book.run(c.Allocate(version_id=1, digest=digest_of(1), size_bytes=0))
    allocated = [e for e in book.events if isinstance(e, VersionAllocated)]
    assert [e.size_bytes for e in allocated] == [0]
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    book.run(c.Allocate(version_id=2, digest=digest_of(2), size_bytes=4096))
    allocated = [e for e in book.events if isinstance(e, VersionAllocated)]
    assert [e.size_bytes for e in allocated] == [0, 4096]


@pytest.mark.parametrize(
    ("command", "code", "details"),
    [
        (c.JoinEngine(engine="bad/name", incarnation="i"), Code.INVALID_INPUT, {"field": "engine"}),
        (c.JoinEngine(engine="e9", incarnation=""), Code.INVALID_INPUT, {"field": "incarnation"}),
        (c.RegisterOwner(owner="", ttl_s=1.0, now=0.0), Code.INVALID_INPUT, {"field": "owner"}),
        (c.RegisterOwner(owner="w2", ttl_s=0.0, now=0.0), Code.INVALID_INPUT, {}),
        (c.RegisterOwner(owner="w2", ttl_s=float("nan"), now=0.0), Code.INVALID_INPUT, {}),
        (c.Bind(session="s" * 257, owner="w1"), Code.INVALID_INPUT, {"field": "session"}),
        (c.Release(session="", owner="w1"), Code.INVALID_INPUT, {"field": "session"}),
        (c.Release(session="s7", owner=""), Code.INVALID_INPUT, {"field": "owner"}),
        (c.Bind(session="s", owner="stranger"), Code.UNKNOWN_OWNER, {"owner": "stranger"}),
        (c.Allocate(version_id=0, digest=digest_of(0)), Code.INVALID_VERSION, {"version_id": 0}),
        (
            c.RecordUnloaded(version_id=1, engine="e0", incarnation="e0-old"),
            Code.ENGINE_RESTARTED,
            {"engine": "e0"},
        ),
    ],
)
def test_bad_input_is_refused_with_its_code_and_the_field_it_names(
    book: Book, command: c.Command, code: str, details: dict[str, object]
) -> None:
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    refused = _refusal(book, command)
    assert refused.code == code
    assert {k: refused.details.get(k) for k in details} == details


def test_a_key_of_256_characters_is_accepted(book: Book) -> None:
    book.publish(1)
    assert book.run(c.Bind(session="s" * 256, owner="w1")).new


def test_deployment_and_fleet_names_are_checked_and_recorded() -> None:
    book = Book()
    for bad, field in [
        (c.CreateDeployment(deployment="a/b", prefix="p", capacity=1), "deployment"),
        (c.CreateDeployment(deployment="d", prefix="p:", capacity=1), "prefix"),
        (c.CreateDeployment(deployment="d", prefix="p", capacity=1, fleet=("e/0",)), "engine"),
    ]:
        assert _refusal(book, bad).details["field"] == field
    book.refuse(c.CreateDeployment(deployment="d", prefix="p", capacity=0), Code.INVALID_INPUT)
    book.run(c.CreateDeployment(deployment="d", prefix="p", capacity=1, fleet=("e0",)))
    assert book.events[-1].fleet == ("e0",)  # type: ignore[attr-defined]
    book.run(c.JoinEngine(engine="e0", incarnation="i1", endpoint="http://x", kind="vllm"))
    assert (book.events[-1].endpoint, book.events[-1].kind) == ("http://x", "vllm")  # type: ignore[attr-defined]


def test_owner_registration_is_idempotent_and_an_expired_owner_is_refused(book: Book) -> None:
    before = len(book.events)
    assert book.run(c.RegisterOwner(owner="w1", ttl_s=10.0, now=5.0)) == Done(no_op=True)
    assert len(book.events) == before
    book.run(c.RegisterOwner(owner="w2", ttl_s=3.0, now=7.0))
    assert (book.events[-1].ttl_s, book.events[-1].at) == (3.0, 7.0)  # type: ignore[attr-defined]
    book.run(c.ExpireOwner(owner="w1", now=20.0, last_seen=0.0))
    expired = _refusal(book, c.RegisterOwner(owner="w1", ttl_s=10.0, now=21.0))
    assert expired.code == Code.LEASE_EXPIRED and expired.details["owner"] == "w1"
    lost = _refusal(book, c.Bind(session="s", owner="w1"))
    assert lost.code == Code.LEASE_EXPIRED and lost.details["owner"] == "w1"


def test_repairing_a_repaired_engine_is_a_no_op(book: Book) -> None:
    before = len(book.events)
    assert book.run(c.RepairEngine(engine="e0", incarnation="e0-i1")) == Done(no_op=True)
    assert len(book.events) == before


def test_a_repair_names_what_is_missing_and_records_the_incarnation(book: Book) -> None:
    book.publish(1)
    book.run(c.ObserveRestart(engine="e1", incarnation="e1-i2"))
    missing = _refusal(book, c.RepairEngine(engine="e1", incarnation="e1-i2"))
    assert missing.code == Code.NOT_READY and missing.details["missing"] == [1]
    book.run(c.RestoreVersion(version_id=1, engine="e1", incarnation="e1-i2"))
    book.run(c.RepairEngine(engine="e1", incarnation="e1-i2"))
    assert book.events[-1] == EngineRepaired(engine="e1", incarnation="e1-i2")


def test_receipts_record_what_they_carry_and_a_rejection_what_was_wrong(book: Book) -> None:
    book.publish(1)
    book.allocate(2)
    book.claim(2)
    v = book.state.versions[2]
    receipt: dict[str, Any] = dict(version_id=2, attempt=1, engine="e0", incarnation="e0-i1")
    book.run(c.RecordPrepared(**receipt, digest=v.digest, lora_name=v.lora_name))
    before = len(book.events)
    duplicate = book.run(c.RecordPrepared(**receipt, digest=v.digest, lora_name=v.lora_name))
    assert duplicate == Done(no_op=True) and len(book.events) == before
    not_ready = _refusal(book, c.Commit(version_id=2, attempt=1))
    assert not_ready.code == Code.NOT_READY and not_ready.details["missing"] == ["e0", "e1"]
    wrong = digest_of("wrong")
    rejected = _refusal(book, c.RecordReady(**receipt, digest=wrong, lora_name=v.lora_name))
    detail = f"receipt echoes {v.lora_name}/{wrong[:16]}, expected {v.lora_name}/{v.digest[:16]}"
    assert rejected.code == Code.READY_MISMATCH and rejected.details["version_id"] == 2
    assert rejected.message == detail
    assert book.events[-1] == ReceiptRejected(code=Code.READY_MISMATCH, detail=detail, **receipt)
    book.run(c.RecordReady(**receipt, digest=v.digest, lora_name=v.lora_name))
    assert book.events[-1] == EngineReady(**receipt, digest=v.digest, lora_name=v.lora_name)


def test_a_forget_refusal_names_at_most_20_bound_sessions(book: Book) -> None:
    book.publish(1)
    sessions = tuple(f"s{i:02}" for i in range(25))
    for session in sessions:
        book.run(c.Bind(session=session, owner="w1"))
    refused = _refusal(book, c.Forget(sessions=sessions))
    assert refused.code == Code.SESSION_STILL_BOUND
    assert refused.details["sessions"] == list(sessions[:20])


def test_a_commit_answers_the_version_it_published(book: Book) -> None:
    book.publish(1)
    published = book.publish(2)
    assert (published.version_id, published.revision, published.retired) == (2, 2, 1)


def test_allocation_refusals_name_what_holds_them() -> None:
    book = Book().bootstrap(capacity=1)
    book.allocate(1)
    conflict = _refusal(book, c.Allocate(version_id=1, digest=digest_of("other")))
    assert conflict.code == Code.VERSION_CONFLICT and conflict.details["version_id"] == 1
    loading = _refusal(book, c.Allocate(version_id=2, digest=digest_of(2)))
    assert loading.code == Code.CAPACITY_ERROR and loading.details["capacity"] == 1
    book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="X", reason="r"))
    blocked = _refusal(book, c.Allocate(version_id=2, digest=digest_of(2)))
    assert blocked.code == Code.PUBLICATION_BLOCKED and blocked.details["versions"] == [1]


def test_a_version_in_progress_is_named_and_a_retry_keeps_its_name() -> None:
    book = Book().bootstrap(capacity=3)
    book.publish(1)
    first = book.allocate(2)
    busy = _refusal(book, c.Allocate(version_id=3, digest=digest_of(3)))
    assert busy.code == Code.PUBLICATION_IN_PROGRESS and busy.details["version_id"] == 2
    book.run(c.FailAttempt(version_id=2, attempt=1, clean=True, code="X", reason="r",
                           absent_on=("e0", "e1")))  # fmt: skip
    retry = book.allocate(2)
    assert (retry.lora_name, retry.attempt, retry.version_id) == (first.lora_name, 2, 2)


def test_an_ill_typed_command_is_refused_naming_its_kind(book: Book) -> None:
    refused = _refusal(book, c.Bind(session=5, owner="w1"))  # type: ignore[arg-type]
    assert refused.code == Code.INVALID_INPUT and refused.details["command"] == "Bind"
    assert refused.message.startswith("Bind: ")


def test_the_first_command_of_a_kind_builds_its_decoder(book: Book) -> None:
    """``_well_typed`` caches one decoder per command class; a fresh process starts with none
    (cleared here, and restored, so the rest of the session keeps its warm cache)."""
    warm = dict(checks._command_decoders)
    checks._command_decoders.clear()
    try:
        assert book.run(c.RegisterOwner(owner="w2", ttl_s=1.0, now=0.0)) == Done()
        assert c.RegisterOwner in checks._command_decoders
    finally:
        checks._command_decoders.update(warm)


# --- written from the mutation rerun over the stall and configuration functions ----------------


def test_max_staleness_is_configured_from_zero_up_and_cleared_with_none(book: Book) -> None:
    """0 is a bound (a session must be on the default), a negative one is bad input, the same
    value again writes nothing, and None lifts the bound."""
    assert book.refuse(c.ConfigureDeployment(max_staleness=-1), Code.INVALID_INPUT) == []
    book.run(c.ConfigureDeployment(max_staleness=0))
    assert book.events[-1] == DeploymentConfigured(max_staleness=0)
    assert book.state.max_staleness == 0
    before = len(book.events)
    assert book.run(c.ConfigureDeployment(max_staleness=0)).no_op is True
    assert len(book.events) == before
    assert book.run(c.ConfigureDeployment(max_staleness=None)).no_op is False
    assert book.events[-1] == DeploymentConfigured(max_staleness=None)
    assert book.state.max_staleness is None


def test_a_stall_records_its_cause_cut_at_2000_characters_and_answers_it_whole() -> None:
    """The refusal's details carry the whole cause (the caller reads it once); the log keeps
    2,000 characters of it, as every recorded reason."""
    engines = tuple(f"engine-{i:02d}-" + "n" * 52 for i in range(40))  # 62 of 64 characters
    book = Book()
    book.run(c.CreateDeployment(deployment="dep", prefix="agent", capacity=2))
    for engine in engines:
        book.run(c.JoinEngine(engine=engine, incarnation="i1"))  # members, none routable
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.Allocate(version_id=1, digest=digest_of(1)))
    assert info.value.code == Code.FLEET_MISMATCH
    cause = info.value.details["cause"]
    assert len(cause) > 2000 and all(engine in cause for engine in engines)
    assert info.value.details["versions"] == []
    event = book.events[-1]
    assert isinstance(event, PublicationBlocked) and event.cause == cause[:2000]


def test_an_ambiguous_unload_blocks_with_its_own_cause() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.publish(2)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e1", reason="timed out"))
    (event,) = book.refuse(c.Allocate(version_id=3, digest=digest_of(3)), Code.PUBLICATION_BLOCKED)
    assert isinstance(event, PublicationBlocked) and event.blocked_by == (1,)
    assert event.cause == (
        "version 1's unload was ambiguous: it may still be loaded until inventories prove it absent"
    )


def test_every_slot_holder_is_named_with_the_reason_it_still_holds() -> None:
    """``slot_holders`` explains a full capacity: each holdable state has its own reason (what
    an operator must do differs: wait, release sessions, reclaim, reconcile), oldest first."""
    book = Book().bootstrap(capacity=8)
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    for version_id in (2, 3, 4):
        book.publish(version_id)
    book.run(c.ClaimReclaim(version_id=2))
    book.allocate(5)

    def holders() -> list[tuple[int, str, str, int]]:
        return [
            (h.version_id, h.state, h.reason, h.bound) for h in decider.slot_holders(book.state)
        ]

    assert holders() == [
        (1, "RETIRED", "sessions_bound", 1),
        (2, "RECLAIMING", "reclaim_in_progress", 0),
        (3, "RETIRED", "awaiting_reclaim", 0),
        (4, "PUBLISHED", "default", 0),
        (5, "LOADING", "loading", 0),
    ]
    book.claim(5)  # before the block: a claim waits for it
    book.run(c.ClaimReclaim(version_id=3))
    book.run(c.MarkReclaimAmbiguous(version_id=3, engine="e1", reason="timed out"))
    book.run(c.FailAttempt(version_id=5, attempt=1, clean=False, code="X", reason="r"))
    assert holders()[2:] == [
        (3, "RECLAIMING", "ambiguous", 0),
        (4, "PUBLISHED", "default", 0),
        (5, "FAILED_FATAL", "failed_fatal", 0),
    ]


def test_a_stall_without_routable_engines_says_so_in_exact_words() -> None:
    """The recorded cause is what ``loraledger status`` shows: the bare sentence with no member
    at all, the members listed (comma separated) when some exist."""
    book = Book()
    book.run(c.CreateDeployment(deployment="dep", prefix="agent", capacity=2))
    (event,) = book.refuse(c.Allocate(version_id=1, digest=digest_of(1)), Code.FLEET_MISMATCH)
    assert isinstance(event, PublicationBlocked)
    assert event.cause == "no routable engine to publish to"
    for engine in ("e1", "e0"):
        book.run(c.JoinEngine(engine=engine, incarnation=f"{engine}-i1"))
    # another version's stall (the same one again is not recorded twice)
    (event,) = book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), Code.FLEET_MISMATCH)
    assert isinstance(event, PublicationBlocked)
    assert event.cause == "no routable engine to publish to (members not routable: e0, e1)"


def test_a_stall_behind_two_blockers_names_both_causes() -> None:
    book = Book().bootstrap(capacity=6)
    book.publish(1)
    book.publish(2)
    book.allocate(3)
    book.claim(3)
    book.run(c.ClaimReclaim(version_id=1))
    book.run(c.MarkReclaimAmbiguous(version_id=1, engine="e1", reason="timed out"))
    book.run(c.FailAttempt(version_id=3, attempt=1, clean=False, code="LOAD_TIMEOUT", reason="r"))
    (event,) = book.refuse(c.Allocate(version_id=4, digest=digest_of(4)), Code.PUBLICATION_BLOCKED)
    assert isinstance(event, PublicationBlocked) and event.blocked_by == (1, 3)
    assert event.cause == (
        "version 1's unload was ambiguous: it may still be loaded until inventories prove it "
        "absent; version 3 attempt 1 ended FAILED_FATAL (LOAD_TIMEOUT): it may be loaded "
        "somewhere until inventories prove it absent"
    )


def test_a_regression_refusal_names_the_version_and_the_default() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(2)
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.Allocate(version_id=1, digest=digest_of(1)))
    assert info.value.code == Code.VERSION_REGRESSION
    assert info.value.details == {"version_id": 1, "default": 2}
    assert info.value.message == (
        "version 1 is lower than the default 2: publishing it would roll the policy back "
        "(pass allow_rollback=True to mean it)"
    )


def test_a_full_capacity_lists_every_holder_comma_separated() -> None:
    book = Book().bootstrap(capacity=2)
    book.publish(1)
    book.run(c.Bind(session="s1", owner="w1"))
    book.publish(2)
    assert isinstance(book.run(c.Allocate(version_id=3, digest=digest_of(3))), Skipped)
    skipped = book.events[-1]
    assert isinstance(skipped, PublicationSkipped)
    assert skipped.message == (
        "capacity 2 is full: v1 retired, sessions bound (1 sessions), v2 the default"
    )


def test_a_reclaimed_version_holds_no_slot_and_hides_none_after_it() -> None:
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.publish(2)
    book.reclaim(1)
    assert [(h.version_id, h.reason) for h in decider.slot_holders(book.state)] == [(2, "default")]


def test_a_refused_commit_names_the_step_and_a_committed_attempt_cannot_fail() -> None:
    """A commit of a version that is not LOADING says it was the commit that was refused (the
    same check guards claims and receipts); failing an attempt that committed is refused
    naming the version."""
    book = Book().bootstrap(capacity=4)
    book.publish(1)
    book.allocate(2)
    book.run(
        c.FailAttempt(
            version_id=2, attempt=1, clean=True, code="X", reason="r", absent_on=("e0", "e1")
        )
    )
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.Commit(version_id=2, attempt=1))
    assert info.value.code == Code.INVALID_STATE
    assert info.value.message == "commit: version 2 is FAILED_RETRYABLE at attempt 1, not LOADING"
    assert info.value.details == {"version_id": 2}
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.FailAttempt(version_id=1, attempt=1, clean=False, code="X", reason="r"))
    assert (info.value.code, info.value.details) == (Code.INVALID_STATE, {"version_id": 1})
    assert info.value.message == (
        "attempt 1 of version 1 cannot fail: it committed (the version is PUBLISHED)"
    )


def test_a_release_as_too_stale_within_the_bound_is_refused_saying_how_far_behind() -> None:
    book = Book().bootstrap(capacity=4)
    book.run(c.ConfigureDeployment(max_staleness=1))
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.publish(2)
    with pytest.raises(LoraLedgerError) as info:
        book.run(c.Release(session="s", owner="w1", cause="too_stale"))
    assert (info.value.code, info.value.details) == (Code.INVALID_INPUT, {"session": "s"})
    assert info.value.message == (
        "session s is 1 versions behind the default, within max_staleness 1: "
        "not released as too_stale"
    )
